"""Decide, apply and revert the registry's patches in this process.

Decisions enforced by default: the VLLM_OVERLAY / _ENABLE / _DISABLE switches, the vLLM
version range, the platform, requires / conflicts. An enabled patch that cannot apply is
skipped with one WARNING (or stops start-up under VLLM_OVERLAY_STRICT=1). A patch whose
``platforms`` exclude the installed one (e.g. a TurboQuant patch on the CPU build) is not-needed
there: recorded with its reason, no warning.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import threading
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from vllm_overlay import carry, levels, report_files, server_id, settings, versions
from vllm_overlay.context import PatchContext
from vllm_overlay.errors import OverlayError, PatchConflictError, SettingError, StrictModeError, UnknownPatchError
from vllm_overlay.mechanisms import install as installmech
from vllm_overlay.mechanisms import wrap as wrapmech
from vllm_overlay import logs
from vllm_overlay.logs import LOG
from vllm_overlay.report import STATE
from vllm_overlay.spec import (
    HOOKS,
    PatchSpec,
    binding_problems,
    dependency_problems,
    version_problems,
    wrap_order_problems,
)


def unknown_release(version: str, environ: Mapping[str, str] | None = None) -> str:
    """The one reason every patch gives on a vLLM release the support matrix does not cover and
    nothing is carried over to (carry.beyond is None there)."""
    return (
        f"{carry.not_carried(version, environ)}; the matrix checked releases {versions.RELEASES[0]} to "
        f"{versions.RELEASES[-1]} (hashes, anchors and targets); nothing is guessed: no patch applies "
        f"(a maintainer adds it with `vllm-overlay verify --version {version} --download --propose`)"
    )


@dataclass(frozen=True)
class Decision:
    spec: PatchSpec
    status: str  # "planned" | "off" | "skipped" | "upstream-merged" | "not-needed"
    reason: str
    level: str | None = None  # with VLLM_OVERLAY_REQUIRE: the patch's level on this process's cell
    below_required: bool = False  # skipped because that level is below VLLM_OVERLAY_REQUIRE
    carry: carry.Outcome | None = None  # on a release newer than the matrix: what its checks decided

    @property
    def release(self) -> str | None:
        """The matrix release whose targets and rewrites install it (the base when carried over)."""
        return self.carry.base if self.carry is not None else None


def required_level(decisions: list[Decision], inst: versions.Installed | None,
                   environ: Mapping[str, str] | None) -> list[Decision]:
    """With VLLM_OVERLAY_REQUIRE set, a planned patch whose level on this process's cell is below it
    becomes skipped (its reason names both levels and the cell)."""
    want = settings.value("VLLM_OVERLAY_REQUIRE", environ)
    if inst is not None and inst.version not in versions.RELEASES:  # carried over, or nothing applies
        out = []
        for d in decisions:
            if d.status != "planned" or d.carry is None:
                out.append(d)
            elif not want or levels.rank(levels.CARRIED) >= levels.rank(want):
                out.append(Decision(d.spec, d.status, d.reason, level=levels.CARRIED, carry=d.carry))
            else:
                out.append(Decision(d.spec, "skipped", f"VLLM_OVERLAY_REQUIRE={want}: it is {levels.CARRIED} on vLLM "
                                    f"{inst.version} {inst.platform} ({levels.MEANS[levels.CARRIED]})",
                                    level=levels.CARRIED, below_required=True, carry=d.carry))
        return out
    if not want or inst is None:
        return decisions
    runner, why = levels.expected_runner(inst.version, inst.platform, environ)
    where = f"vLLM {inst.version} {inst.platform}, runner {runner or 'V1 or V2 (the weaker counts)'}"
    out = []
    for d in decisions:
        if d.status != "planned":
            out.append(d)
            continue
        found = levels.for_process(d.spec, inst.version, inst.platform, runner)
        if levels.rank(found.level) >= levels.rank(want):
            out.append(Decision(d.spec, d.status, d.reason, level=found.level))
            continue
        out.append(Decision(d.spec, "skipped", f"VLLM_OVERLAY_REQUIRE={want}: it is {found.level} on {where} "
                            f"({why}); {levels.MEANS[found.level]}", level=found.level, below_required=True))
    return out


def registry() -> tuple[tuple[PatchSpec, ModuleType], ...]:
    from vllm_overlay.registry import PATCH_MODULES

    out = []
    for name in PATCH_MODULES:
        mod = importlib.import_module(name)
        stale = [f for f in ("install", "MODULES") if hasattr(mod, f)]
        if stale:  # what is installed comes from SPEC alone; a module's own would be silently ignored
            raise OverlayError(
                f"{name} defines {', '.join(stale)}: patches declare what they wrap and rewrite in SPEC "
                "(its targets, each bound to its wrapper with @wraps, and its rewrites); mechanisms/install.py "
                "installs it"
            )
        defined = tuple(h for h in HOOKS if callable(getattr(mod, h, None)))
        if set(defined) != set(mod.SPEC.hooks):
            raise OverlayError(
                f"{name}: SPEC.hooks={mod.SPEC.hooks!r} but the module defines {defined!r}: declare every "
                f"function of {', '.join(HOOKS)} the module defines (core and the installer call only those)"
            )
        unbound = binding_problems(mod.SPEC, mod)
        if unbound:
            raise OverlayError(f"{name}: its targets and wrappers are not bound consistently: " + "; ".join(unbound))
        out.append((mod.SPEC, mod))
    _check_specs(tuple(spec for spec, _ in out))
    return tuple(out)


_order_checked: list[tuple[PatchSpec, ...]] = [()]  # the specs last found in order (checked once)


def _check_specs(all_specs: tuple[PatchSpec, ...]) -> None:
    """Once per set of spec objects: every spec's version facts agree with versions.RELEASES
    (spec.version_problems: each problem of every spec, one line each), every ``requires`` and
    ``conflicts`` names another registry patch and no requirement is circular
    (spec.dependency_problems), the registry's install order
    agrees with every spec's ``wraps_outside``, and every function two patches change has an order
    declared (spec.wrap_order_problems); else an OverlayError."""
    last = _order_checked[0]
    if len(last) == len(all_specs) and all(a is b for a, b in zip(last, all_specs)):
        return
    problems = [p for spec in all_specs for p in version_problems(spec)]
    problems += [f"{spec.id}: beyond_matrix is not declared; expected beyond_matrix='carry' or 'never' with "
                 "beyond_matrix_why (what it does on a release newer than the matrix, and why)"
                 for spec in all_specs if not spec.beyond_matrix]
    if problems:
        raise OverlayError("the patches' version facts disagree with versions.RELEASES (the one list of "
                           "releases) or with each other: " + "; ".join(problems))
    problems = dependency_problems(all_specs)
    if problems:
        raise OverlayError("the dependencies between the registry's patches are not declared consistently: "
                           + "; ".join(problems))
    problems = wrap_order_problems(all_specs)
    if problems:
        raise OverlayError("the wrap order of the registry's patches is not declared consistently: "
                           + "; ".join(problems))
    _order_checked[0] = all_specs


def specs() -> tuple[PatchSpec, ...]:
    return tuple(spec for spec, _ in registry())


def _check_ids(name: str, ids: tuple[str, ...], known: list[str]) -> None:
    for pid in ids:
        if pid not in known:
            import difflib

            close = difflib.get_close_matches(pid, known, n=1, cutoff=0.7)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise UnknownPatchError(
                f"{name}: unknown patch id {pid!r}{hint}; known ids: {', '.join(known)}"
            )


def decide(
    environ: Mapping[str, str] | None = None,
    vllm: versions.Installed | None | str = "detect",
    read: carry.Reader | None = None,
) -> list[Decision]:
    """What would apply here and why (pure: applies nothing). Raises on bad switches. On a release
    newer than the matrix, each wanted patch's checks read the vLLM files through ``read`` (default:
    the installed vLLM's files, each read once)."""
    all_specs = specs()
    known = [s.id for s in all_specs]
    on = settings.value("VLLM_OVERLAY", environ)
    if not on:  # off: the other settings are neither read nor judged
        return [Decision(spec, "off", "VLLM_OVERLAY=0 turns every patch off") for spec in all_specs]
    enable = settings.value("VLLM_OVERLAY_ENABLE", environ)
    disable = settings.value("VLLM_OVERLAY_DISABLE", environ)
    _check_ids("VLLM_OVERLAY_ENABLE", enable, known)
    _check_ids("VLLM_OVERLAY_DISABLE", disable, known)
    inst = carry.installed(environ) if vllm == "detect" else vllm
    assert not isinstance(inst, str)
    beyond = carry.beyond(inst.version, environ) if inst is not None else None
    if beyond is not None:
        if read is None:
            from vllm_overlay.sources import installed_reader

            read = installed_reader()
        read = carry.cached(read)

    wanted: dict[str, str] = {}  # id -> why it is wanted
    out: dict[str, Decision] = {}
    for spec in all_specs:
        if not on:
            out[spec.id] = Decision(spec, "off", "VLLM_OVERLAY=0 turns every patch off")
            continue
        if spec.id in disable:
            out[spec.id] = Decision(spec, "off", "disabled by VLLM_OVERLAY_DISABLE")
            continue
        if spec.disabled_by and not settings.value(spec.disabled_by, environ):
            raw = settings.resolve(spec.disabled_by, environ).raw
            out[spec.id] = Decision(spec, "off", f"{spec.disabled_by}={raw} turns it off")
            continue
        if spec.id in enable:
            wanted[spec.id] = "enabled by VLLM_OVERLAY_ENABLE"
        elif spec.enabled_by and settings.value(spec.enabled_by, environ):
            wanted[spec.id] = f"on because {spec.enabled_by} is set"
        elif spec.default and not spec.enabled_by:
            wanted[spec.id] = "on by default"
        else:
            how = f"set {spec.enabled_by}" if spec.enabled_by else f"VLLM_OVERLAY_ENABLE={spec.id}"
            out[spec.id] = Decision(spec, "off", f"off by default ({how} to turn it on)")

    for spec in all_specs:
        if spec.id not in wanted:
            continue
        for other in spec.conflicts:
            if other in wanted:
                raise PatchConflictError(
                    f"patches {spec.id!r} and {other!r} conflict and are both enabled; "
                    f"turn one off with VLLM_OVERLAY_DISABLE"
                )

    for spec in all_specs:
        if spec.id not in wanted:
            continue
        why = wanted[spec.id]
        if spec.enabled_by and spec.id in enable and not settings.value(spec.enabled_by, environ):
            out[spec.id] = Decision(spec, "skipped", f"enabled, but {spec.enabled_by} is 0 (nothing to do)")
        elif inst is None:
            out[spec.id] = Decision(spec, "skipped", "vLLM is not installed in this environment")
        elif beyond is not None and inst.platform not in spec.platforms:
            out[spec.id] = Decision(
                spec, "not-needed", f"platform {inst.platform}: the patch concerns {', '.join(spec.platforms)} only"
            )
        elif beyond is not None:
            assert read is not None
            got = carry.check(spec, beyond, inst.platform, read)
            if got.status == "planned" and not spec.modules(got.base, inst.platform):
                got = carry.Outcome(got.base, "skipped", f"vLLM {inst.version}: its {got.base} support row applies, "
                                    "but the spec records no target or rewrite for it on this platform",
                                    got.checks, got.failed, got.seconds)
            out[spec.id] = Decision(spec, got.status, got.reason if got.status != "planned" else f"{why}; {got.reason}",
                                    carry=got)
        elif inst.version not in versions.RELEASES:
            out[spec.id] = Decision(spec, "skipped", unknown_release(inst.version, environ))
        elif (row := spec.support_for(inst.version)) is not None and row.status in ("upstream-merged", "not-needed"):
            out[spec.id] = Decision(spec, row.status, f"vLLM {inst.version}: {row.reason}")
        elif inst.platform not in spec.platforms:
            # what it patches exists only there (e.g. TurboQuant on CUDA): nothing to do, no warning
            out[spec.id] = Decision(
                spec, "not-needed", f"platform {inst.platform}: the patch concerns {', '.join(spec.platforms)} only"
            )
        elif not spec.applies_on(inst.version):  # unsupported there
            why_not = row.reason if row else "no support row covers it"
            out[spec.id] = Decision(spec, "skipped", f"unsupported on vLLM {inst.version}: {why_not}")
        elif not spec.modules(inst.version, inst.platform):
            out[spec.id] = Decision(
                spec, "skipped", f"the support matrix says it applies on vLLM {inst.version}, but the "
                "spec records no target or rewrite for it (a data error: run `vllm-overlay verify`)"
            )
        else:
            out[spec.id] = Decision(spec, "planned", why)

    out = {d.spec.id: d for d in required_level([out[s.id] for s in all_specs], inst, environ)}
    # requires: a patch whose requirement will not apply is skipped (iterate to a fixed point)
    changed = True
    while changed:
        changed = False
        for spec in all_specs:
            d = out[spec.id]
            if d.status != "planned":
                continue
            for req in spec.requires:
                if out[req].status != "planned":
                    out[spec.id] = Decision(
                        spec, "skipped", f"requires {req!r}, which is {out[req].status}: {out[req].reason}",
                        carry=d.carry,
                    )
                    changed = True
                    break
    return [out[s.id] for s in all_specs]


# ---- applying -----------------------------------------------------------------------------


@dataclass
class Active:
    spec: PatchSpec
    module: ModuleType
    pending: set[str] = field(default_factory=set)
    installed: list[wrapmech.Installed] = field(default_factory=list)
    live: bool = True
    release: str | None = None  # the matrix release whose targets it installs (carried over); None: vLLM's own


_LOCK = threading.RLock()
_ACTIVE: dict[str, Active] = {}  # kept across fork: the child's memory holds the same patches


def _renew_lock_after_fork() -> None:
    global _LOCK
    _LOCK = threading.RLock()


os.register_at_fork(after_in_child=_renew_lock_after_fork)


def active_ids() -> list[str]:
    return [pid for pid, a in _ACTIVE.items() if a.live and STATE.patches.get(pid, {}).get("status") == "applied"]


def traced_code_digest_parts() -> list[str]:
    """Ids of live patches that change traced code (for the compile-cache key)."""
    return sorted(pid for pid, a in _ACTIVE.items() if a.live and a.spec.changes_traced_code)


def context() -> PatchContext:
    """What a patch that declares the hook ``bind`` is handed: this process's live patches, read when
    asked (the patches never import core)."""
    return PatchContext(applied_ids=active_ids, traced_code_ids=traced_code_digest_parts, specs=specs())


def _undo_all(active: Active) -> list[str]:
    """Undo every change of ``active`` (last first); returns one line per change that could not be
    undone (those stay in ``active.installed`` so a later revert() tries again)."""
    errors: list[str] = []
    kept: list[wrapmech.Installed] = []
    for inst in reversed(active.installed):
        try:
            inst.undo()
        except Exception as exc:  # noqa: BLE001 - every other change is still undone
            errors.append(f"{inst.where}: {type(exc).__name__}: {exc}")
            kept.append(inst)
    active.installed[:] = list(reversed(kept))
    return errors


def _fail(active: Active, exc: BaseException, strict: bool) -> None:
    spec = active.spec
    msg = f"{type(exc).__name__}: {exc}"
    active.live = False
    undo_errors = _undo_all(active)
    STATE.set_patch(spec.id, "failed", reason=msg, traceback=traceback.format_exc(limit=6),
                    undo_errors=undo_errors)
    for line in undo_errors:
        text = f"{spec.id}: could not take its change off after the failure: {line}"
        STATE.event(text)
        LOG.error("patch %s", text)
    STATE.write()
    if strict:
        raise StrictModeError(
            f"VLLM_OVERLAY_STRICT=1: patch {spec.id!r} could not apply: {msg}"
        ) from exc
    LOG.warning("patch %s skipped: could not apply: %s", spec.id, msg)


def _make_hook(active: Active, module_name: str, strict: bool) -> Any:
    def hook(module: ModuleType) -> None:
        with _LOCK:
            if not active.live or module_name not in active.pending:
                return
            t0 = time.perf_counter()
            try:
                with wrapmech.installing(active.spec.id):
                    installed = installmech.install(active.spec, active.module, module_name,
                                                    active.release or STATE.vllm_version or "", STATE.platform,
                                                    **({"check_params": True} if active.release else {}))
            except Exception as exc:  # noqa: BLE001
                _fail(active, exc, strict)
                return
            if not installed:  # no evidence of anything applied: never report it "applied"
                _fail(active, RuntimeError(f"install() for module {module_name} installed nothing"), strict)
                return
            active.installed.extend(installed)
            active.pending.discard(module_name)
            STATE.hook_apply_s += time.perf_counter() - t0
            copies = [c for i in installed for c in i.cached_copies]
            if copies:
                STATE.event(f"{active.spec.id}: cached copies bypass the patch: {', '.join(copies)}")
                LOG.warning("patch %s: cached copies bypass it: %s", active.spec.id, ", ".join(copies))
            status = "applied" if not active.spec.blocking(active.pending) else "armed"
            was = STATE.patches.get(active.spec.id, {}).get("status")
            STATE.set_patch(
                active.spec.id, status,
                targets=sorted({i.where for i in active.installed}),
                pending_modules=sorted(active.pending),
            )
            if status == "applied":
                STATE.write()
                if was != "applied" and STATE.load_apply_s is not None and not any(
                        a.spec.blocking(a.pending) for a in _ACTIVE.values() if a.live):
                    STATE.log_summary()  # the last armed patch applied: the final word for this process

    return hook


def on_any(decisions: list[Decision]) -> bool:
    return any(d.status != "off" for d in decisions)


def register() -> None:
    """Apply the registry in this process. Re-entrant and idempotent."""
    t0 = time.perf_counter()
    with _LOCK:
        STATE.register_calls += 1
        if STATE.registered:
            LOG.debug("register() called again in pid %d: already applied, nothing to do", STATE.pid)
            return
        logs.setup()
        settings.validate_all()
        if settings.off() and (ignored := settings.ignored_when_off()):
            LOG.warning("VLLM_OVERLAY=0: the overlay is off (no patch applies); its other settings were "
                        "ignored, not checked: %s", ", ".join(ignored))
        try:
            _prepare_reports()
        except SettingError:
            if not settings.off():
                raise
        strict = settings.value("VLLM_OVERLAY_STRICT")
        inst = carry.installed()
        STATE.vllm_version = inst.version if inst else None
        STATE.platform = inst.platform if inst else None
        decisions = decide(vllm=inst)
        modules = {s.id: m for s, m in registry()}
        STATE.registered = True
        beyond = carry.beyond(inst.version) if inst is not None else None
        if beyond is not None and on_any(decisions):  # one line per process: the release and the counts
            STATE.carried_from = beyond.base
            STATE.carry = carry.report(decisions, beyond)
            LOG.warning("%s", carry.summary(decisions, beyond))
        if inst is not None and inst.version not in versions.RELEASES and beyond is None and on_any(decisions):
            line = unknown_release(inst.version)
            for d in decisions:
                STATE.set_patch(d.spec.id, d.status, reason=d.reason)
            if strict:
                raise StrictModeError(f"VLLM_OVERLAY_STRICT=1 refuses to start: {line}")
            LOG.warning("every patch skipped: %s", line)  # one line, not one per patch
            decisions = []
        below = [d for d in decisions if d.below_required]
        if below and beyond is None:  # asked for by the operator: one line per process, never a StrictModeError
            assert inst is not None
            runner, why = levels.expected_runner(inst.version, inst.platform)
            LOG.warning("VLLM_OVERLAY_REQUIRE=%s: %d patch(es) below it skipped on vLLM %s %s, runner %s (%s): %s",
                        settings.value("VLLM_OVERLAY_REQUIRE"), len(below), inst.version, inst.platform,
                        runner or "V1 or V2, the weaker counts", why,
                        ", ".join(f"{d.spec.id} is {d.level}" for d in below))
        for d in decisions:
            if d.below_required:
                STATE.set_patch(d.spec.id, d.status, reason=d.reason, level=d.level)
                continue
            if d.status != "planned":
                STATE.set_patch(d.spec.id, d.status, reason=d.reason)
                if d.status == "off" and d.spec.disabled_by and d.reason.startswith(d.spec.disabled_by):
                    # a safety patch turned off by its own setting: said in every process, once
                    LOG.warning("patch %s off: %s (%s)", d.spec.id, d.reason,
                                settings.BY_NAME[d.spec.disabled_by].accepted)
                if d.status == "skipped":  # wanted, but cannot apply here
                    if strict:
                        raise StrictModeError(
                            f"VLLM_OVERLAY_STRICT=1: patch {d.spec.id!r} cannot apply: {d.reason}"
                        )
                    if d.carry is None:
                        LOG.warning("patch %s skipped: %s", d.spec.id, d.reason)
                    else:  # named in the carry-over's one WARNING line
                        LOG.info("patch %s skipped: %s", d.spec.id, d.reason)
                continue
            module = modules[d.spec.id]
            if "bind" in d.spec.hooks:
                module.bind(context())
            active = Active(d.spec, module, pending=set(d.spec.modules(d.release or inst.version, inst.platform)),
                            release=d.release)
            _ACTIVE[d.spec.id] = active
            STATE.set_patch(d.spec.id, "armed", reason=d.reason, pending_modules=sorted(active.pending),
                            **({"level": d.level} if d.level else {}),
                            **({"carried_from": d.release} if d.release else {}))
            for module_name in sorted(active.pending):
                try:
                    wrapmech.when_imported(module_name, _make_hook(active, module_name, strict))
                except OverlayError:
                    raise
                except Exception as exc:  # noqa: BLE001 - importing the target failed
                    _fail(active, exc, strict)
                    break
        STATE.load_apply_s = time.perf_counter() - t0
        STATE.write()
        STATE.log_summary()


def _prepare_reports() -> None:
    """The server id and tree (set before vLLM starts the engine core: its processes inherit them),
    the report directory (created, checked: a refused default stops start-up) and its pruning; in a
    server's main process with a hand-set id, one WARNING when another live server uses that id."""
    sid = server_id.ensure()
    server_id.ensure_tree()
    res = settings.resolve("VLLM_OVERLAY_REPORT_DIR")
    try:
        report_files.prepare(res.value, default=not res.is_set)
    except ValueError:
        raise SettingError(settings.check(res) or f"VLLM_OVERLAY_REPORT_DIR={res.value}: refused") from None
    except OSError as exc:  # cannot create it: the report writer says so once, with backoff
        LOG.debug("report directory %s not created: %s", res.value, exc)
        return
    report_files.prune(res.value)  # dead processes' old files
    if not server_id.is_auto(sid) and multiprocessing.parent_process() is None:
        from vllm_overlay import reports

        try:
            found = reports.scan_server(res.value, sid, settings.value("VLLM_OVERLAY_SERVER_TREE"))
        except Exception as exc:  # noqa: BLE001 - a check, never a reason not to start
            LOG.debug("could not check the server id's other users: %s", exc)
            return
        if (line := reports.shared_line(sid, found)) is not None:
            LOG.warning("%s", line)


def revert() -> list[str]:
    """Take every applied patch off in this process and forget the registration.

    Removes every change it can; a change it cannot undo (someone else replaced the attribute
    since) is reported (ERROR line, report event, patch status "revert-failed") and returned, one
    line each. Whatever happens, the process can register() again afterwards.
    """
    problems: list[str] = []
    with _LOCK:
        try:
            for pid in reversed(list(_ACTIVE)):
                active = _ACTIVE[pid]
                active.live = False
                errors = _undo_all(active)
                if "on_revert" in active.spec.hooks:
                    try:
                        active.module.on_revert()
                    except Exception as exc:  # noqa: BLE001
                        errors.append(f"on_revert: {type(exc).__name__}: {exc}")
                if errors:
                    STATE.set_patch(pid, "revert-failed", reason="; ".join(errors))
                    for line in errors:
                        problems.append(f"{pid}: {line}")
                        STATE.event(f"revert: {pid}: {line}")
                        LOG.error("revert: patch %s: could not take off: %s", pid, line)
                elif STATE.patches.get(pid, {}).get("status") != "failed":
                    STATE.set_patch(pid, "reverted")
        finally:
            _ACTIVE.clear()
            if STATE.registered:
                STATE.write()
            STATE.registered = False
    return problems
