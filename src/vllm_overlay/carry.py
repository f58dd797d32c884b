"""A vLLM release newer than the support matrix: each patch carries over where it still fits.

On a release newer than the newest of ``versions.RELEASES`` (the *base*), each wanted patch runs the
checks of its support row of the base against the installed vLLM's files, read as files (no vLLM
module is imported for it): the row's proofs (text present or absent in a file) and, where the row
applies, the pristine sha256 and anchors of each rewrite recorded for the base. Where all hold, the
patch does what the row says: it applies (installing the targets and rewrites of the base, at the
support level ``carried-over``) or stays upstream-merged / not-needed; where one fails it is
skipped, naming the check and the file. A patch whose spec says ``beyond_matrix='never'`` is
skipped there. ``VLLM_OVERLAY_CARRY_OVER=0`` turns this off (every patch skipped, one line).

Releases older than the matrix, and those named in ``versions.LEFT_OUT``, are never carried over:
their reason is known. Nothing here imports vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from packaging.version import Version

from vllm_overlay import settings, versions
from vllm_overlay.errors import AnchorError
from vllm_overlay.spec import PatchSpec

Reader = Callable[[str], str]


@dataclass(frozen=True)
class Beyond:
    """The installed release, newer than the matrix, and the matrix release whose rows it carries."""

    version: str
    base: str  # the newest release of the matrix (VLLM_OVERLAY_TEST_NEWEST_RELEASE in tests)


@dataclass(frozen=True)
class Outcome:
    """What the checks of one patch's base row decided on the installed release."""

    base: str
    status: str  # "planned" (applies) | "upstream-merged" | "not-needed" | "skipped"
    reason: str
    checks: int  # how many checks ran
    failed: tuple[str, ...]  # one line per check that failed, naming it and the file
    seconds: float  # the time its checks took (files read once per process: the first reader pays)


def installed(environ: Mapping[str, str] | None = None) -> versions.Installed | None:
    """The installed vLLM as the overlay meets it: VLLM_OVERLAY_TEST_VLLM_VERSION (test only) presents
    it as another release; its files stay what they are."""
    inst = versions.installed_vllm()
    presented = settings.value("VLLM_OVERLAY_TEST_VLLM_VERSION", environ)
    if inst is None or not presented:
        return inst
    return versions.Installed(inst.distribution, presented, inst.platform)


def newer_than_matrix(version: str) -> bool:
    return version not in versions.RELEASES and Version(version) > Version(versions.RELEASES[-1])


def beyond(version: str, environ: Mapping[str, str] | None = None) -> Beyond | None:
    """The carry-over on ``version``, or None: a release of the matrix, one older than its newest,
    one left out by name, or VLLM_OVERLAY_CARRY_OVER=0."""
    if not newer_than_matrix(version) or version in versions.LEFT_OUT:
        return None
    if not settings.value("VLLM_OVERLAY_CARRY_OVER", environ):
        return None
    return Beyond(version, settings.value("VLLM_OVERLAY_TEST_NEWEST_RELEASE", environ) or versions.RELEASES[-1])


def not_carried(version: str, environ: Mapping[str, str] | None = None) -> str:
    """Why nothing carries over to ``version``, a release outside the matrix (for the one skip line)."""
    if version in versions.LEFT_OUT:
        return f"vLLM {version} is left out of the support matrix: {versions.LEFT_OUT[version]}"
    if newer_than_matrix(version):
        return (f"VLLM_OVERLAY_CARRY_OVER=0: vLLM {version} is newer than the support matrix (newest "
                f"{versions.RELEASES[-1]}) and nothing is carried over to it (1, the default, applies each patch "
                "whose checks hold in the installed files)")
    return (f"vLLM {version} is not in the support matrix, and only a release newer than its newest "
            f"({versions.RELEASES[-1]}) is met with carry-over checks")


def cached(read: Reader) -> Reader:
    """``read`` with each file read once."""
    texts: dict[str, str | BaseException] = {}

    def once(path: str) -> str:
        if path not in texts:
            try:
                texts[path] = read(path)
            except (OSError, KeyError) as exc:
                texts[path] = exc
        got = texts[path]
        if isinstance(got, BaseException):
            raise got
        return got

    return once


def _short(text: str, limit: int = 80) -> str:
    one = " ".join(text.split())
    return repr(one if len(one) <= limit else one[: limit - 3] + "...")


def check(spec: PatchSpec, where: Beyond, platform: str, read: Reader) -> Outcome:
    """The checks of ``spec``'s support row of ``where.base`` against ``read`` (the installed files)."""
    from vllm_overlay.mechanisms import rewrite

    t0 = time.perf_counter()
    base, version = where.base, where.version
    row = spec.support_for(base)

    def done(status: str, reason: str, checks: int = 0, failed: Sequence[str] = ()) -> Outcome:
        return Outcome(base, status, reason, checks, tuple(failed), time.perf_counter() - t0)

    if row is None:
        return done("skipped", f"vLLM {version} is newer than the support matrix and no support row of the patch "
                    f"covers {base}, its newest release")
    if row.status == "unsupported":
        return done("skipped", f"vLLM {version} is newer than the support matrix, and the patch is unsupported on "
                    f"{base}, its newest release: {row.reason}")
    if row.status == "applies" and spec.beyond_matrix != "carry":
        why = spec.beyond_matrix_why or "its spec declares no beyond_matrix choice"
        return done("skipped", f"vLLM {version} is newer than the support matrix and the patch never applies "
                    f"beyond it: {why}")
    failed: list[str] = []
    checks = 0
    for proof in row.proof:
        checks += 1
        try:
            text = read(proof.path)
        except (OSError, KeyError) as exc:
            failed.append(f"proof vllm/{proof.path}: cannot read it ({type(exc).__name__})")
            continue
        if (proof.text in text) != proof.present:
            failed.append(f"proof vllm/{proof.path} {'lacks' if proof.present else 'contains'} {_short(proof.text)}")
    if row.status == "applies":
        for line in _target_checks(spec, base, platform, read):
            checks += 1
            if line:
                failed.append(line)
        for rw in spec.rewrites_for(base):
            if not rw.target.on_platform(platform):
                continue
            checks += 1
            try:
                new = rewrite.check_text(rw, read(rw.path))
            except (OSError, KeyError) as exc:
                failed.append(f"rewrite {rw.target.qualname} in vllm/{rw.path}: cannot read it ({type(exc).__name__})")
                continue
            except (AnchorError, SyntaxError) as exc:
                failed.append(f"rewrite {rw.target.qualname} in vllm/{rw.path}: {exc}")
                continue
            left = [g for g in rw.gone if g in new]
            if left:
                failed.append(f"rewrite {rw.target.qualname} in vllm/{rw.path}: still contains {_short(left[0])} "
                              "after its edits")
    if failed:
        return done("skipped", f"vLLM {version} is newer than the support matrix and {len(failed)} of the {checks} "
                    f"check(s) of its {base} support row fail in the installed files: " + "; ".join(failed),
                    checks, failed)
    held = (f"the {checks} check(s) of its {base} support row hold in the installed files" if checks else
            f"its {base} support row records nothing to check here (its targets are found when installed)")
    if row.status == "applies":
        return done("planned", f"carried over from {base} to vLLM {version}, newer than the support matrix: {held}",
                    checks)
    return done(row.status, f"vLLM {version}, newer than the support matrix: as on {base} ({held}): {row.reason}",
                checks)


def _target_checks(spec: PatchSpec, base: str, platform: str, read: Reader) -> list[str]:
    """One entry per wrapped vLLM target of ``base`` on ``platform``: "" where its module's file exists
    and defines a function of its name (text only: no parse, so a start-up can afford it), else the
    failure. A module of an ``either_modules`` group may be missing where another of the group is
    there (vLLM builds one of its model runners)."""
    from vllm_overlay.sources import module_path

    def path_of(module: str) -> str | None:
        try:
            return module_path(module, read)
        except KeyError:
            return None

    out: list[str] = []
    for t in spec.wrap_targets(base, platform):
        if t.module != "vllm" and not t.module.startswith("vllm."):
            continue  # not in vLLM (prometheus_client): the row's proofs show vLLM uses it
        path = path_of(t.module)
        if path is None:
            group = next((g for g in spec.either_modules if t.module in g), ())
            if any(m != t.module and path_of(m) for m in group):
                continue  # vLLM builds the other module of the group
            out.append(f"target {t}: no file for module {t.module}")
            continue
        name = t.qualname.split(".")[-1]
        if f"def {name}(" not in read(path):
            out.append(f"target {t}: vllm/{path} defines no {name}()")
        else:
            out.append("")
    return out


def summary(decisions: Sequence[Any], where: Beyond) -> str:
    """The one line a process logs (WARNING) and `plan` / `doctor` print, from core's decisions: the
    release, the counts, each patch skipped with its first failing check (or why), what the checks
    cost. Patches not wanted (off) ran no check and are not counted."""
    checked = [d for d in decisions if d.carry is not None]
    carried = [d.spec.id for d in checked if d.status == "planned"]
    below = [d.spec.id for d in checked if d.below_required]
    same = [f"{d.spec.id} {d.status}" for d in checked if d.status in ("upstream-merged", "not-needed")]
    skipped = [f"{d.spec.id} ({d.carry.failed[0] if d.carry.failed else _cause(d.reason)})" for d in checked
               if d.status == "skipped" and not d.below_required]
    parts = [f"{len(carried)} patch(es) carried over at level carried-over"
             + (f" ({', '.join(carried)})" if carried else "")]
    if below:
        parts.append(f"{len(below)} left out by VLLM_OVERLAY_REQUIRE ({', '.join(below)})")
    if same:
        parts.append(f"{len(same)} as on {where.base} ({', '.join(same)})")
    parts.append(f"{len(skipped)} skipped" + (f": {'; '.join(skipped)}" if skipped else ""))
    seconds = sum(d.carry.seconds for d in checked)
    return (f"vLLM {where.version} is newer than the support matrix (newest release {where.base}); the checks of "
            f"each wanted patch's {where.base} support row against the installed files: " + ", ".join(parts)
            + f"; checks took {seconds:.3f} s (VLLM_OVERLAY_CARRY_OVER=0 skips every patch here)")


def _cause(reason: str) -> str:
    if "never applies beyond" in reason:
        return "never beyond the matrix"
    if "unsupported on" in reason:
        return "unsupported on the newest release"
    if reason.startswith("requires "):
        return reason.split(":")[0]
    return reason


def report(decisions: Sequence[Any], where: Beyond) -> dict[str, Any]:
    """The report's record of the carry-over (STATE.carry), from core's decisions."""
    checked = [d for d in decisions if d.carry is not None]
    return {"version": where.version, "base": where.base,
            "seconds": round(sum(d.carry.seconds for d in checked), 6),
            "patches": {d.spec.id: {"status": d.status, "checks": d.carry.checks, "failed": list(d.carry.failed)}
                        for d in checked}}
