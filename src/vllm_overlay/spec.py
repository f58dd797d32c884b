"""PatchSpec: what a patch is, declared as data. The one source of what a patch wraps and rewrites
(``mechanisms/install.py`` installs exactly this), of the vLLM releases it applies on (its
``support`` rows over ``versions.RELEASES``), and of the ledger (`vllm-overlay plan`) and the
support matrix (`vllm-overlay matrix`).

Version facts: ``versions.RELEASES`` is the only list of releases. Every other version fact is a
range over it or must equal a selection of it: the support rows (each release in exactly one),
``Target.vllm`` (within the releases of the 'applies' rows), the hash keys given to ``per_release``
(exactly the releases a rewritten target's range and the 'applies' rows select). ``version_problems``
checks them, once per set of specs when the registry loads; ``PatchSpec.applies_on(version)`` is the
one answer to "does it apply on this release"."""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from packaging.specifiers import SpecifierSet
from packaging.version import Version

STATUSES = ("applies", "upstream-merged", "not-needed", "unsupported")
BEYOND_MATRIX = ("", "carry", "never")  # PatchSpec.beyond_matrix ("": undeclared, refused by the registry)
# Modules vLLM imports in worker processes only (the model runners, the worker classes, the model's layers):
# a patch armed in another process (API server, engine core) that waits only for these acts in the workers,
# and reports say so (reports.shown_status) instead of "armed" forever.
WORKER_MODULES = ("vllm.v1.worker.", "vllm.model_executor.layers.")
HOOKS = ("prepare", "on_revert", "bind", "metric_families", "bucket_edges")  # the patch-module functions a spec may declare (PatchSpec.hooks)


Wrapper = Callable[[Any, Any, tuple[Any, ...], dict[str, Any]], Any]  # wrapt's (wrapped, instance, args, kwargs)
_W = TypeVar("_W", bound=Wrapper)
BOUND = "_overlay_targets"  # on a wrapper function: the Targets ``wraps`` bound it to


@dataclass(frozen=True)
class Target:
    """One place a patch changes: ``module`` + ``qualname`` for the vLLM versions in ``vllm``.

    ``wrapper`` is the function of the patch module that wraps it (wrapt signature
    ``(wrapped, instance, args, kwargs)``), bound once with ``@wraps(TARGET)`` on the function,
    which follows the SPEC in the module; a target without one is changed by a source rewrite
    recorded in ``PatchSpec.rewrites`` (``binding_problems`` checks that every target has one or
    the other). ``params`` are the parameters the wrapper reads by name: the support sweep checks
    them in every release's source. ``platform`` limits the target to one vLLM build ("cuda" or
    "cpu"; "" = every platform of the patch): a module only that build imports (e.g. the CPU
    worker's) would otherwise leave the patch armed forever on the other.
    """

    module: str
    qualname: str
    vllm: str = ""  # PEP 440 specifier; "" = every release the patch applies on
    params: tuple[str, ...] = ()
    platform: str = ""
    # the wrapper function; set by ``wraps`` (or passed here where the function exists before the Target)
    wrapper: Wrapper | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.platform not in ("", "cuda", "cpu"):
            raise ValueError(f"Target.platform={self.platform!r}: expected '', 'cuda' or 'cpu'")
        if self.wrapper is not None and not isinstance(self.wrapper, types.FunctionType):
            raise TypeError(f"Target {self}: wrapper={self.wrapper!r}: expected the wrapper function itself "
                            "(wrapped, instance, args, kwargs), bound with @wraps(TARGET) on it in the patch module")

    def __str__(self) -> str:
        return f"{self.module}:{self.qualname}"

    @property
    def wrapper_name(self) -> str | None:
        """The wrapper's name in its module (for the ledger, the docs and error messages); None for a
        rewritten target."""
        return None if self.wrapper is None else self.wrapper.__name__

    def applies_to(self, version: str) -> bool:
        return not self.vllm or Version(version) in SpecifierSet(self.vllm)

    def on_platform(self, platform: str | None) -> bool:
        """True where this target is installed: every platform when ``platform`` is None."""
        return platform is None or not self.platform or self.platform == platform


def wraps(*targets: Target) -> Callable[[_W], _W]:
    """Decorator: bind the function as the wrapper of ``targets`` (declared before the SPEC, listed in
    its ``targets``), e.g. ``@wraps(COMPUTE_HASH)`` or ``@wraps(V1_DUMMY_RUN, V2_DUMMY_RUN)``; returns
    the function unchanged. A target is bound once; ``binding_problems`` (run by the registry check)
    names a target of the SPEC left without a wrapper or rewrite, and a function bound to a target the
    SPEC does not list."""
    if not targets:
        raise TypeError("wraps(): no target given; expected wraps(TARGET, ...) with the Targets of the SPEC "
                        "the function wraps")
    for t in targets:
        if not isinstance(t, Target):
            raise TypeError(f"wraps({t!r}): expected Target objects (the module constants listed in SPEC.targets)")

    def bind(fn: _W) -> _W:
        if not isinstance(fn, types.FunctionType):
            raise TypeError(f"@wraps({', '.join(map(str, targets))}) on {fn!r}: expected a function "
                            "(wrapped, instance, args, kwargs)")
        for t in targets:
            if t.wrapper is not None and t.wrapper is not fn:
                raise ValueError(f"@wraps({t}) on {fn.__module__}.{fn.__name__}: the target is already bound to "
                                 f"{t.wrapper.__module__}.{t.wrapper.__name__}; expected one wrapper per target")
        for t in targets:
            object.__setattr__(t, "wrapper", fn)  # frozen: bound once, here
        before = getattr(fn, BOUND, ())
        setattr(fn, BOUND, before + tuple(t for t in targets if not any(t is b for b in before)))
        return fn

    return bind


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
    Over all the ``per_release`` entries of one function, the keys must be exactly the releases the
    spec's target of it (``Target.vllm``) and its 'applies' rows select, each once
    (``version_problems``). `vllm-overlay verify --version X --propose` prints the entry to add for a
    new release."""
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
    """What the patch does on the releases in ``vllm``, and why. A spec's rows cover each release of
    ``versions.RELEASES`` exactly once (``version_problems``)."""

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
    # report counters of which one above 0 shows the patch did nothing in that process although applied
    # (e.g. memory-headroom's headroom_not_corrected): a run with one proves nothing for the patch
    idle_by: tuple[str, ...] = ()
    # functions of the patch module that mechanisms/install.py and core call: "prepare"
    # (prepare(module_name), before the first wrap once a target module is imported),
    # "on_revert" (on_revert(), after its wrappers are removed) and "bind" (bind(context), the
    # process's context.PatchContext, before its first target is installed: a patch reads the other
    # patches through it, never through core) and "metric_families" (metric_families(reports): the
    # /metrics families the patch owns, built from the server's reports; metrics.py calls it in the
    # API server at every scrape, whatever the patch's status there) and "bucket_edges"
    # (bucket_edges(reports): the token counts of the reports' data the patch owns that must be edges
    # of the forward-size histogram, called like metric_families); a module defining one must
    # declare it
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
    # what the patch does on a vLLM release newer than the newest of versions.RELEASES (carry.py):
    # "carry": it applies there where the checks of its newest row hold against the installed sources
    # (level carried-over); "never": it is skipped there, because applied where it does not fit it could
    # corrupt outputs or memory. Every registry patch declares one, with its reason in beyond_matrix_why
    beyond_matrix: str = ""
    beyond_matrix_why: str = ""

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
        if isinstance(self.idle_by, str) or not all(isinstance(c, str) and c for c in self.idle_by):
            raise ValueError(f"PatchSpec {self.id!r}: idle_by={self.idle_by!r}: expected a tuple of counter names")
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
        if self.beyond_matrix not in BEYOND_MATRIX or bool(self.beyond_matrix) != bool(self.beyond_matrix_why.strip()):
            raise ValueError(f"PatchSpec {self.id!r}: beyond_matrix={self.beyond_matrix!r}, beyond_matrix_why="
                             f"{self.beyond_matrix_why!r}: expected 'carry' or 'never' with a one-line reason "
                             "(both empty only outside the registry)")
        if self.id in self.wraps_outside:
            raise ValueError(f"PatchSpec {self.id!r}: wraps_outside={self.wraps_outside!r} names the patch "
                             "itself; expected the ids of other patches")

    def blocking(self, pending: set[str]) -> set[str]:
        """The modules of ``pending`` (not hooked yet) that keep the patch from being applied."""
        done = {m for group in self.either_modules if any(g not in pending for g in group) for m in group}
        return pending - done

    def _by_release(self) -> dict[str, Support]:
        """Each release of versions.RELEASES -> its support row (the first row that covers it), resolved
        once per list of releases (kept on the spec; a spec is immutable)."""
        from vllm_overlay.versions import RELEASES

        cached = self.__dict__.get("_resolved")
        if cached is None or cached[0] is not RELEASES:
            by = {}
            for v in RELEASES:
                row = next((r for r in self.support if r.covers(v)), None)
                if row is not None:
                    by[v] = row
            cached = (RELEASES, by)
            object.__setattr__(self, "_resolved", cached)
        return cached[1]

    def support_for(self, version: str) -> Support | None:
        """The support row of ``version``; None for a release the matrix does not cover."""
        return self._by_release().get(version)

    def applies_on(self, version: str) -> bool:
        """True where the patch applies on ``version`` (its support row there says 'applies'): the one
        answer to that question. False on a release outside versions.RELEASES."""
        row = self.support_for(version)
        return row is not None and row.status == "applies"

    def releases(self, status: str = "applies") -> list[str]:
        """The releases of versions.RELEASES whose support row has ``status``, in release order."""
        if status not in STATUSES:
            raise ValueError(f"PatchSpec.releases(status={status!r}): expected one of {', '.join(STATUSES)}")
        if status == "applies":
            return [v for v in self._by_release() if self.applies_on(v)]
        return [v for v, row in self._by_release().items() if row.status == status]

    @property
    def vllm(self) -> str:
        """The releases it applies on, compactly (for display): '0.20.0-0.20.2, 0.22.0'."""
        from vllm_overlay.versions import compact

        return compact(self.releases()) or "none"

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


def why_from(doc: str | None) -> str:
    """A spec's ``why`` from its patch module's docstring: paragraphs 2 and 3 (the first is the title
    line), joined, whitespace normalised. The one way a patch whose why is its docstring builds it."""
    paragraphs = (doc or "").split("\n\n")
    if len(paragraphs) < 2 or not " ".join(paragraphs[1:3]).strip():
        raise ValueError(f"why_from(doc={(doc or '')[:60]!r}...): expected a module docstring of a title line and "
                         "at least one more paragraph (the why), separated by blank lines")
    return " ".join(" ".join(paragraphs[1:3]).split())


def binding_problems(spec: PatchSpec, module: types.ModuleType | None = None) -> list[str]:
    """What is wrong with how ``spec``'s targets are bound, one line each: a target with neither a
    wrapper (``@wraps``) nor a recorded rewrite; with ``module`` (the patch module), a function of it
    bound with ``@wraps`` to a Target, or a bound Target constant of it, that ``spec.targets`` does not
    list. The registry check (core.registry) raises on any; so does the installer."""
    out = []
    rewritten = {(rw.target.module, rw.target.qualname) for rw in spec.rewrites}
    for t in spec.targets:
        if t.wrapper is None and (t.module, t.qualname) not in rewritten:
            out.append(f"PatchSpec {spec.id!r}: target {t} has no wrapper and no recorded rewrite; expected the "
                       "patch module's wrapper function bound to it with @wraps(TARGET) (or a rewrite of it in "
                       "rewrites)")
    if module is None:
        return out
    listed = ", ".join(map(str, spec.targets)) or "none"
    seen: list[Target] = []
    for name, value in vars(module).items():
        if isinstance(value, types.FunctionType):
            bound = [(t, f"{module.__name__}.{name} is bound with @wraps to target {t}")
                     for t in getattr(value, BOUND, ())]
        elif isinstance(value, Target) and value.wrapper is not None:
            bound = [(value, f"{module.__name__}.{name} (target {value}) is bound to {value.wrapper_name}")]
        else:
            continue
        for t, what in bound:
            if not any(t is s for s in spec.targets) and not any(t is s for s in seen):
                seen.append(t)
                out.append(f"PatchSpec {spec.id!r}: {what}, which SPEC.targets does not list; expected a Target "
                           f"of SPEC.targets ({listed})")
    return out


def changed_functions(specs: Sequence[PatchSpec]) -> dict[tuple[str, str], list[str]]:
    """(module:qualname, release) -> ids of the patches of ``specs`` that wrap or rewrite that
    function on that release of ``versions.RELEASES`` (a release the patch applies on), in
    ``specs`` order; only the functions more than one patch changes."""
    out: dict[tuple[str, str], list[str]] = {}
    for spec in specs:
        for v in spec.releases():
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


def dependency_problems(specs: Sequence[PatchSpec]) -> list[str]:
    """What is wrong with the declared dependencies of ``specs`` (the registry), one line each: a
    ``requires`` or ``conflicts`` entry that is no patch id of the registry or names the patch itself, a
    patch both requiring and conflicting with another, a cycle of ``requires``. core skips a patch whose
    requirement does not apply (with the reason), so a requirement left undeclared would let a patch
    apply without what it reads."""
    problems: list[str] = []
    ids = [s.id for s in specs]
    by_id = {s.id: s for s in specs}
    for spec in specs:
        for field_name in ("requires", "conflicts"):
            names = getattr(spec, field_name)
            if isinstance(names, str):
                problems.append(f"PatchSpec {spec.id!r}: {field_name}={names!r}: expected a tuple of patch ids")
                continue
            for other in names:
                if other == spec.id:
                    problems.append(f"PatchSpec {spec.id!r}: {field_name} names the patch itself; expected the "
                                    "ids of other patches")
                elif other not in by_id:
                    problems.append(f"PatchSpec {spec.id!r}: {field_name} names {other!r}, which is no patch of "
                                    f"the registry; expected ids of: {', '.join(ids)}")
        for other in set(spec.requires) & set(spec.conflicts):
            problems.append(f"PatchSpec {spec.id!r}: requires and conflicts both name {other!r}; expected one")

    def cycle_from(start: str) -> list[str] | None:
        path, stack = [start], [iter(by_id[start].requires)]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                path.pop()
            elif nxt == start:
                return [*path, start]
            elif nxt in by_id and nxt not in path:
                path.append(nxt)
                stack.append(iter(by_id[nxt].requires))
        return None

    seen: set[frozenset[str]] = set()
    for spec in specs:
        cycle = cycle_from(spec.id) if not isinstance(spec.requires, str) else None
        if cycle and frozenset(cycle) not in seen:
            seen.add(frozenset(cycle))
            problems.append(f"PatchSpecs {' -> '.join(repr(c) for c in cycle)}: requires forms a cycle; expected "
                            "a patch never to require itself through others")
    return problems


def wrap_order(specs: Sequence[PatchSpec], where: str, version: str) -> list[str]:
    """The ids of ``specs`` that change ``where`` (module:qualname) on ``version``, innermost first
    (the install order)."""
    return [s.id for s in specs if s.applies_on(version) and where in s.changes(version)]


def version_problems(spec: PatchSpec) -> list[str]:
    """Where ``spec``'s version facts disagree with ``versions.RELEASES``, the one list of releases, or
    with each other; one line each, naming the spec, the fact, the release and what is accepted:

    - support rows: a row that matches no release, a release a second row covers too, a release no
      row covers (each release of RELEASES in exactly one row);
    - targets: a ``Target.vllm`` that matches no release the patch applies on, or reaches one where it
      does not (a range within the releases of its 'applies' rows); a release it applies on where
      nothing would be installed (no target, no rewrite);
    - recorded rewrites (the hash keys given to ``per_release``): over one rewritten function, the
      keys must be exactly the releases its target's range and the 'applies' rows select, each once;
      a key outside RELEASES, where the patch does not apply, outside the target's range, given twice,
      for a function no target of the spec rewrites, or a release without its key is named."""
    from vllm_overlay.versions import RELEASES, compact

    out = []
    span = f"{RELEASES[0]} to {RELEASES[-1]}"
    taken: dict[str, int] = {}
    for i, row in enumerate(spec.support):
        hit = [v for v in RELEASES if row.covers(v)]
        if not hit:
            out.append(f"{spec.id}: support[{i}] vllm={row.vllm!r} matches no release of versions.RELEASES "
                       f"({span}); expected a range that selects at least one")
        for v in hit:
            if v in taken:
                j = taken[v]
                out.append(f"{spec.id}: support[{i}] vllm={row.vllm!r} covers {v}, already covered by "
                           f"support[{j}] vllm={spec.support[j].vllm!r}; expected each release of "
                           "versions.RELEASES in exactly one row")
            else:
                taken[v] = i
    gaps = [v for v in RELEASES if v not in taken]
    if gaps:
        out.append(f"{spec.id}: no support row covers {', '.join(gaps)}; expected each release of "
                   "versions.RELEASES in exactly one row (extend a row, or add one, e.g. 'unsupported')")
    applies = spec.releases()
    where = compact(applies) or "none"
    for t in spec.targets:
        if not t.vllm:
            continue
        hit = [v for v in RELEASES if t.applies_to(v)]
        if not set(hit) & set(applies):
            out.append(f"{spec.id}: target {t} vllm={t.vllm!r} matches no release the patch applies on; "
                       f"expected a range within its 'applies' rows ({where})")
        elif set(hit) - set(applies):
            out.append(f"{spec.id}: target {t} vllm={t.vllm!r} reaches "
                       f"{', '.join(v for v in hit if v not in applies)}, where the patch does not apply; "
                       f"expected a range within its 'applies' rows ({where})")
    empty = [v for v in applies if not spec.modules(v)]
    if empty:
        out.append(f"{spec.id}: applies on {compact(empty)}, but no target or rewrite of it does there; expected "
                   "a target whose range selects each (or a row that does not say 'applies' there)")
    rewritten: dict[tuple[str, str], list[Target]] = {}
    for t in spec.targets:
        if t.wrapper is None:
            rewritten.setdefault((t.module, t.qualname), []).append(t)
    have: dict[tuple[str, str], set[str]] = {}
    for rw in spec.rewrites:
        key = (rw.target.module, rw.target.qualname)
        fact = f"{spec.id}: the rewrite of {rw.target} recorded for {rw.version!r} (a per_release hash key)"
        ts = rewritten.get(key)
        if ts is None:
            out.append(f"{fact} changes a function no target of the spec rewrites; expected a "
                       f"Target({rw.target.module!r}, {rw.target.qualname!r}) without a wrapper in its targets")
            continue
        want = [v for v in applies if any(t.applies_to(v) for t in ts)]
        expected = (f"expected exactly the releases its target's range "
                    f"({', '.join(repr(t.vllm or 'every release') for t in ts)}) and the 'applies' rows "
                    f"select: {compact(want) or 'none'}")
        if rw.version not in RELEASES:
            out.append(f"{fact}: not a release of versions.RELEASES ({span}); {expected}")
        elif rw.version not in applies:
            row = spec.support_for(rw.version)
            out.append(f"{fact}: the patch does not apply there ({row.status if row else 'no support row'}); "
                       f"{expected}")
        elif rw.version not in want:
            out.append(f"{fact}: outside its target's range; {expected}")
        elif rw.version in have.get(key, set()):
            out.append(f"{fact}: recorded twice; {expected}, each once")
        elif rw.target.vllm not in ("", f"=={rw.version}"):
            out.append(f"{fact}: its target says vllm={rw.target.vllm!r}; expected '=={rw.version}' "
                       "(what per_release writes)")
        have.setdefault(key, set()).add(rw.version)
    for key, ts in rewritten.items():
        want = [v for v in applies if any(t.applies_to(v) for t in ts)]
        missing = [v for v in want if v not in have.get(key, set())]
        if missing:
            out.append(f"{spec.id}: target {ts[0]} is rewritten but no rewrite (per_release hash key) is "
                       f"recorded for {', '.join(missing)}; expected one for each release its range and the "
                       f"'applies' rows select ({compact(want)})")
    return out
