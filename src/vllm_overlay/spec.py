"""PatchSpec: what a patch is, declared as data. The one source of what a patch wraps and rewrites
(``mechanisms/install.py`` installs exactly this), of the vLLM releases it applies on (its
``support`` rows over ``versions.RELEASES``), and of the ledger (`vllm-overlay plan`) and the
support matrix (`vllm-overlay matrix`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from packaging.specifiers import SpecifierSet
from packaging.version import Version

STATUSES = ("applies", "upstream-merged", "not-needed", "unsupported")
HOOKS = ("prepare", "on_revert")  # the patch-module functions a spec may declare (PatchSpec.hooks)


@dataclass(frozen=True)
class Target:
    """One place a patch changes: ``module`` + ``qualname`` for the vLLM versions in ``vllm``.

    ``wrapper`` names the function of the patch module that wraps it (wrapt signature
    ``(wrapped, instance, args, kwargs)``); a target without one is changed by a source rewrite
    recorded in ``PatchSpec.rewrites``. ``params`` are the parameters the wrapper reads by name:
    the support sweep checks them in every release's source. ``platform`` limits the target to one
    vLLM build ("cuda" or "cpu"; "" = every platform of the patch): a module only that build imports
    (e.g. the CPU worker's) would otherwise leave the patch armed forever on the other.
    """

    module: str
    qualname: str
    vllm: str = ""  # PEP 440 specifier; "" = every release the patch applies on
    wrapper: str | None = None
    params: tuple[str, ...] = ()
    platform: str = ""

    def __post_init__(self) -> None:
        if self.platform not in ("", "cuda", "cpu"):
            raise ValueError(f"Target.platform={self.platform!r}: expected '', 'cuda' or 'cpu'")

    def __str__(self) -> str:
        return f"{self.module}:{self.qualname}"

    def applies_to(self, version: str) -> bool:
        return not self.vllm or Version(version) in SpecifierSet(self.vllm)

    def on_platform(self, platform: str | None) -> bool:
        """True where this target is installed: every platform when ``platform`` is None."""
        return platform is None or not self.platform or self.platform == platform


@dataclass(frozen=True)
class Edit:
    """One anchored replacement in a source rewrite: ``anchor`` must occur exactly once."""

    anchor: str
    replacement: str


@dataclass(frozen=True)
class Rewrite:
    """An in-memory source rewrite of one function for one exact vLLM version.

    ``path`` is the file relative to the vllm package (for the textual check against a wheel),
    ``sha256`` the hash of the pristine function source (its lines as in the file).
    """

    target: Target
    version: str
    path: str
    sha256: str
    edits: tuple[Edit, ...]
    gone: tuple[str, ...] = ()  # text the rewritten function must no longer contain (the sweep checks)


def per_release(target: Target, path: str, edits: tuple[Edit, ...], hashes: dict[str, str],
                gone: tuple[str, ...] = ()) -> tuple[Rewrite, ...]:
    """One Rewrite per release of ``hashes`` (release -> pristine sha256), all with the same edits.
    `vllm-overlay verify --wheel X --propose` prints the entry to add for a new release."""
    return tuple(
        Rewrite(Target(target.module, target.qualname, f"=={v}"), v, path, sha, edits, gone)
        for v, sha in hashes.items()
    )


@dataclass(frozen=True)
class Proof:
    """Text whose presence (or absence) in vllm/<path> shows why a support row holds."""

    path: str
    text: str
    present: bool = True


@dataclass(frozen=True)
class Support:
    """What the patch does on the releases in ``vllm`` (first matching row wins), and why."""

    vllm: str  # PEP 440 specifier over versions.RELEASES
    status: str  # one of STATUSES
    reason: str
    proof: tuple[Proof, ...] = ()

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"Support.status={self.status!r}: expected one of {', '.join(STATUSES)}")
        SpecifierSet(self.vllm)  # raises on a bad specifier

    def covers(self, version: str) -> bool:
        return Version(version) in SpecifierSet(self.vllm)


@dataclass(frozen=True)
class PatchSpec:
    id: str  # stable kebab-case id
    title: str
    why: str  # a paragraph
    upstream: str  # link to the upstream issue / PR / code
    targets: tuple[Target, ...]
    mechanism: str  # "wrap" | "rewrite" | "wrap+rewrite"
    support: tuple[Support, ...]  # per release of versions.RELEASES: applies / upstream-merged / ...
    default: bool  # on unless disabled
    retire_when: str
    requires: tuple[str, ...] = ()
    conflicts: tuple[str, ...] = ()
    settings: tuple[str, ...] = ()  # names of the settings it reads
    platforms: tuple[str, ...] = ("cuda", "cpu")
    enabled_by: str | None = None  # a setting whose non-zero value turns the patch on
    disabled_by: str | None = None  # a setting whose value 0 turns a default-on patch off
    changes_traced_code: bool = False  # must change vLLM's compile-cache key
    # the settings of ``settings`` that change what its traced code does (buffer shapes, guards):
    # compile-cache-key folds them into vLLM's compile-cache key; only with changes_traced_code
    traced_settings: tuple[str, ...] = ()
    rewrites: tuple[Rewrite, ...] = field(default=())
    # groups of modules of which one hooked completes the patch: vLLM imports the model runner
    # module it builds (V1 or Model Runner V2), and on some releases never the other one. The
    # patch is "applied" once every other module and one module of each group are hooked; a
    # group's other modules are still hooked if vLLM imports them later.
    either_modules: tuple[tuple[str, ...], ...] = ()
    # report counters of which one above 0 shows the patch acted (not only installed): a GPU result
    # proves the patch on its cell only then (bench/evidence.py); empty: applied is enough
    shown_by: tuple[str, ...] = ()
    # functions of the patch module that mechanisms/install.py and core.revert call: "prepare"
    # (prepare(module_name), before the first wrap once a target module is imported) and
    # "on_revert" (on_revert(), after its wrappers are removed); a module defining one must declare it
    hooks: tuple[str, ...] = ()
    # ids of the patches whose wrappers this one's enclose on every vLLM function both change (this
    # one sees the call first and passes on what it changed): two patches that change one
    # module:qualname on a release declare their order here, and the registry installs them in it
    # (``wrap_order_problems`` checks both)
    wraps_outside: tuple[str, ...] = ()
    # the releases (PEP 440 specifier) on which the patch acts on Model Runner V2; None: the patch
    # does not depend on the runner. On V2 of any other release it stands aside (one WARNING in
    # the worker) and its support level there is "unsupported" (levels.cell)
    v2_releases: str | None = None

    def __post_init__(self) -> None:
        if not self.id or not all(p.isalnum() and p == p.lower() for p in self.id.split("-")):
            raise ValueError(f"PatchSpec.id={self.id!r}: expected kebab-case (a-z, 0-9, '-')")
        if self.mechanism not in ("wrap", "rewrite", "wrap+rewrite"):
            raise ValueError(
                f"PatchSpec.mechanism={self.mechanism!r}: expected 'wrap', 'rewrite' or 'wrap+rewrite'"
            )
        if self.enabled_by and self.disabled_by:
            raise ValueError(f"PatchSpec {self.id!r}: enabled_by and disabled_by are exclusive")
        if self.disabled_by and not self.default:
            raise ValueError(f"PatchSpec {self.id!r}: disabled_by turns off a default-on patch; default=False")
        if isinstance(self.hooks, str) or not set(self.hooks) <= set(HOOKS) or len(set(self.hooks)) != len(self.hooks):
            raise ValueError(f"PatchSpec {self.id!r}: hooks={self.hooks!r}: expected a tuple of distinct names "
                             f"from {', '.join(HOOKS)}")
        if isinstance(self.shown_by, str) or not all(isinstance(c, str) and c for c in self.shown_by):
            raise ValueError(f"PatchSpec {self.id!r}: shown_by={self.shown_by!r}: expected a tuple of counter names")
        if isinstance(self.traced_settings, str) or any(n not in self.settings for n in self.traced_settings):
            raise ValueError(f"PatchSpec {self.id!r}: traced_settings={self.traced_settings!r}: expected a tuple "
                             f"of names from its settings ({', '.join(self.settings) or 'none'})")
        if self.traced_settings and not self.changes_traced_code:
            raise ValueError(f"PatchSpec {self.id!r}: traced_settings={self.traced_settings!r} with "
                             "changes_traced_code=False; expected changes_traced_code=True (only traced code's "
                             "settings enter the compile-cache key)")
        if isinstance(self.wraps_outside, str) or not all(isinstance(p, str) and p for p in self.wraps_outside):
            raise ValueError(f"PatchSpec {self.id!r}: wraps_outside={self.wraps_outside!r}: expected a tuple of "
                             "patch ids")
        if self.v2_releases is not None:
            SpecifierSet(self.v2_releases)  # raises on a bad specifier
        if self.id in self.wraps_outside:
            raise ValueError(f"PatchSpec {self.id!r}: wraps_outside={self.wraps_outside!r} names the patch "
                             "itself; expected the ids of other patches")
        rewritten = {(rw.target.module, rw.target.qualname) for rw in self.rewrites}
        for t in self.targets:
            if t.wrapper is None and (t.module, t.qualname) not in rewritten:
                raise ValueError(
                    f"PatchSpec {self.id!r}: target {t} has no wrapper and no recorded rewrite; "
                    "name the patch module's wrapper function (Target(..., wrapper='_name'))"
                )

    def blocking(self, pending: set[str]) -> set[str]:
        """The modules of ``pending`` (not hooked yet) that keep the patch from being applied."""
        done = {m for group in self.either_modules if any(g not in pending for g in group) for m in group}
        return pending - done

    def support_for(self, version: str) -> Support | None:
        """The support row of ``version``; None for a release the matrix does not cover."""
        from vllm_overlay.versions import RELEASES

        if version not in RELEASES:
            return None
        return next((row for row in self.support if row.covers(version)), None)

    def applies_on(self) -> list[str]:
        from vllm_overlay.versions import RELEASES

        return [v for v in RELEASES if (row := self.support_for(v)) is not None and row.status == "applies"]

    @property
    def vllm(self) -> str:
        """The releases it applies on, compactly (for display): '0.20.0-0.20.2, 0.22.0'."""
        from vllm_overlay.versions import compact

        return compact(self.applies_on()) or "none"

    def wrap_targets(self, version: str, platform: str | None = None) -> tuple[Target, ...]:
        """The wrapped targets on ``version`` (on ``platform``; every platform's when None)."""
        return tuple(t for t in self.targets
                     if t.wrapper is not None and t.applies_to(version) and t.on_platform(platform))

    def rewrites_for(self, version: str) -> tuple[Rewrite, ...]:
        return tuple(rw for rw in self.rewrites if rw.version == version)

    def changes(self, version: str) -> set[str]:
        """The module:qualname of every function it wraps or rewrites on ``version`` (any platform)."""
        return {str(t) for t in self.wrap_targets(version)} | {str(rw.target) for rw in self.rewrites_for(version)}

    def modules(self, version: str, platform: str | None = None) -> list[str]:
        """The vLLM modules whose import installs this patch on ``version`` (and ``platform``)."""
        mods = ([t.module for t in self.wrap_targets(version, platform)]
                + [rw.target.module for rw in self.rewrites_for(version) if rw.target.on_platform(platform)])
        return sorted(set(mods))

    def default_text(self) -> str:
        """The default in words, for the README and `plan --ledger`."""
        if self.enabled_by:
            return f"off (on when `{self.enabled_by}` > 0)"
        if self.disabled_by:
            return f"on (off when `{self.disabled_by}`=0)"
        return "on" if self.default else "off"


def changed_functions(specs: Sequence[PatchSpec]) -> dict[tuple[str, str], list[str]]:
    """(module:qualname, release) -> ids of the patches of ``specs`` that wrap or rewrite that
    function on that release of ``versions.RELEASES`` (a release the patch applies on), in
    ``specs`` order; only the functions more than one patch changes."""
    out: dict[tuple[str, str], list[str]] = {}
    for spec in specs:
        for v in spec.applies_on():
            for where in sorted(spec.changes(v)):
                out.setdefault((where, v), []).append(spec.id)
    return {k: ids for k, ids in out.items() if len(ids) > 1}


def wrap_order_problems(specs: Sequence[PatchSpec]) -> list[str]:
    """What is wrong with the declared wrap order of ``specs`` (the registry, in install order:
    a patch installed later wraps outside the ones installed before it), one line each:

    - a ``wraps_outside`` entry that is no patch id, or names a patch with which it shares no function;
    - two patches that change one module:qualname on a release with no order declared between them,
      or with each declared outside the other;
    - a declaration the install order contradicts (the outer patch must come later)."""
    problems: list[str] = []
    ids = [s.id for s in specs]
    position = {pid: i for i, pid in enumerate(ids)}
    by_id = {s.id: s for s in specs}
    shared: dict[frozenset[str], tuple[str, str]] = {}  # pair -> first (function, release) they share
    for (where, v), pids in changed_functions(specs).items():
        for i, a in enumerate(pids):
            for b in pids[i + 1:]:
                shared.setdefault(frozenset((a, b)), (where, v))
    for spec in specs:
        for other in spec.wraps_outside:
            if other not in by_id:
                problems.append(f"PatchSpec {spec.id!r}: wraps_outside names {other!r}, which is no patch of "
                                f"the registry; expected ids of: {', '.join(ids)}")
            elif frozenset((spec.id, other)) not in shared:
                problems.append(f"PatchSpec {spec.id!r}: wraps_outside names {other!r}, but the two change no "
                                "vLLM function in common on any release; expected only patches it shares a "
                                "wrapped or rewritten module:qualname with (remove the entry)")
            elif position[other] > position[spec.id]:
                problems.append(f"PatchSpec {spec.id!r}: wraps_outside names {other!r}, but the registry "
                                f"installs {spec.id!r} first, so its wrappers end up inside; expected "
                                f"{other!r} listed before {spec.id!r} in PATCH_MODULES")
    for pair, (where, v) in sorted(shared.items(), key=lambda kv: sorted(kv[0])):
        a, b = sorted(pair, key=position.__getitem__)
        a_out, b_out = b in by_id[a].wraps_outside, a in by_id[b].wraps_outside
        if a_out and b_out:
            problems.append(f"PatchSpecs {a!r} and {b!r}: each names the other in wraps_outside (both change "
                            f"{where} on vLLM {v}); expected one of them to")
        elif not (a_out or b_out):
            problems.append(f"PatchSpecs {a!r} and {b!r} both change {where} on vLLM {v} and declare no order "
                            f"between them; expected wraps_outside={(a,)!r} on {b!r} (or the other way round, "
                            "with the registry order to match)")
    return problems


def wrap_order(specs: Sequence[PatchSpec], where: str, version: str) -> list[str]:
    """The ids of ``specs`` that change ``where`` (module:qualname) on ``version``, innermost first
    (the install order)."""
    return [s.id for s in specs if version in s.applies_on() and where in s.changes(version)]


def version_problems(spec: PatchSpec) -> list[str]:
    """Where ``spec``'s version facts disagree with ``versions.RELEASES``, the one list of releases, or
    with each other: a support row that matches no release or a release another row already took, a
    release no row covers, a target range reaching releases the patch does not apply on (or none at
    all), a recorded rewrite for a release the patch does not apply on, and a rewritten target without
    a rewrite for a release where it applies. One line each, naming the spec and the field."""
    from vllm_overlay.versions import RELEASES

    out = []
    taken: dict[str, int] = {}
    for i, row in enumerate(spec.support):
        hit = [v for v in RELEASES if row.covers(v)]
        if not hit:
            out.append(f"{spec.id}: support[{i}] vllm={row.vllm!r} matches no release of versions.RELEASES")
        for v in hit:
            if v in taken:
                out.append(f"{spec.id}: support[{i}] vllm={row.vllm!r} covers {v}, already covered by "
                           f"support[{taken[v]}]")
            else:
                taken[v] = i
    gaps = [v for v in RELEASES if v not in taken]
    if gaps:
        out.append(f"{spec.id}: no support row covers {', '.join(gaps)} (add a row, e.g. 'unsupported')")
    applies = set(spec.applies_on())
    rewritten = {(rw.target.module, rw.target.qualname) for rw in spec.rewrites}
    for t in spec.targets:
        if not t.vllm:
            continue
        hit = {v for v in RELEASES if t.applies_to(v)}
        if not hit & applies:
            out.append(f"{spec.id}: target {t} vllm={t.vllm!r} matches no release the patch applies on")
        elif hit - applies and t.wrapper is not None:
            out.append(f"{spec.id}: target {t} vllm={t.vllm!r} reaches {', '.join(sorted(hit - applies))}, where "
                       "the patch does not apply")
    for rw in spec.rewrites:
        if rw.version not in applies:
            out.append(f"{spec.id}: a rewrite of {rw.target} is recorded for {rw.version}, where the patch does "
                       "not apply")
    for t in spec.targets:
        if t.wrapper is None and (t.module, t.qualname) in rewritten:
            have = {rw.version for rw in spec.rewrites
                    if (rw.target.module, rw.target.qualname) == (t.module, t.qualname)}
            want = {v for v in applies if t.applies_to(v)}
            if want - have:
                out.append(f"{spec.id}: target {t} is rewritten but no rewrite is recorded for "
                           f"{', '.join(sorted(want - have))}")
    return out
