"""Decisions, apply / revert in this process against the real installed vLLM modules, and the
documented outcome of every misconfiguration (named error, loud skip, strict abort)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import types

import pytest

from vllm_overlay import core, versions
from vllm_overlay.errors import PatchConflictError, StrictModeError, UnknownPatchError
from vllm_overlay.patches import gdn_output_prealloc as gdn
from vllm_overlay.report import STATE


def _w(wrapped, instance, args, kwargs):  # type: ignore[no-untyped-def]
    """A pass-through wrapper for the specs built here (never installed)."""
    return wrapped(*args, **kwargs)


TARGET_MODULES = (
    "vllm.config.vllm",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.core.sched.scheduler",
    gdn.MOD_032,
)


@pytest.fixture
def overlay(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("VLLM_OVERLAY_REPORT_DIR", str(tmp_path / "reports"))
    for m in TARGET_MODULES:  # imported first, so hooks fire at once, inside the test
        importlib.import_module(m)
    core.revert()
    STATE.reset()
    yield tmp_path / "reports"
    core.revert()
    STATE.reset()


def originals() -> dict[str, object]:
    out = {}
    for spec in core.specs():
        for t in spec.targets:
            if not t.applies_to("0.32.0"):
                continue
            mod = importlib.import_module(t.module)
            owner = mod
            *path, name = t.qualname.split(".")
            for p in path:
                if isinstance(owner, types.ModuleType) and not hasattr(owner, p):  # a submodule the patch imports
                    importlib.import_module(f"{owner.__name__}.{p}")
                owner = getattr(owner, p)
            out[str(t)] = vars(owner)[name] if isinstance(owner, type) and name in vars(owner) else getattr(owner, name)
    return out


def by_id(decisions):  # type: ignore[no-untyped-def]
    return {d.spec.id: d for d in decisions}


def test_default_plan_on_installed_vllm() -> None:
    d = by_id(core.decide({}))
    assert d["forward-telemetry"].status == "planned"
    assert d["gdn-output-prealloc"].status == "planned"
    assert d["compile-cache-key"].status == "planned"
    assert d["profile-run-cap"].status == "off" and "VLLM_OVERLAY_PROFILE_RUN_CAP" in d["profile-run-cap"].reason
    assert d["prefill-chunk-clamp"].status == "off"


def test_switches() -> None:
    d = by_id(core.decide({"VLLM_OVERLAY": "0"}))
    assert all(x.status == "off" and "VLLM_OVERLAY=0" in x.reason for x in d.values())
    d = by_id(core.decide({"VLLM_OVERLAY_DISABLE": "forward-telemetry"}))
    assert d["forward-telemetry"].status == "off" and "VLLM_OVERLAY_DISABLE" in d["forward-telemetry"].reason
    d = by_id(core.decide({"VLLM_OVERLAY_PROFILE_RUN_CAP": "4096"}))
    assert d["profile-run-cap"].status == "planned"
    d = by_id(core.decide({"VLLM_OVERLAY_ENABLE": "profile-run-cap"}))
    assert d["profile-run-cap"].status == "skipped" and "is 0" in d["profile-run-cap"].reason
    d = by_id(core.decide({"VLLM_OVERLAY_DISABLE": "compile-cache-key"}))
    assert d["gdn-output-prealloc"].status == "skipped"
    assert "requires 'compile-cache-key'" in d["gdn-output-prealloc"].reason


def test_the_gdn_buffer_requires_forward_telemetry() -> None:
    """Its floor (budget.largest_forward) reads the runner limit forward-telemetry records: without it the
    buffer is skipped, the requirement named, not applied on a floor read from elsewhere."""
    assert gdn.SPEC.requires == ("compile-cache-key", "forward-telemetry")
    d = by_id(core.decide({"VLLM_OVERLAY_DISABLE": "forward-telemetry"}))
    assert d["gdn-output-prealloc"].status == "skipped"
    assert "requires 'forward-telemetry', which is off: disabled by VLLM_OVERLAY_DISABLE" in d["gdn-output-prealloc"].reason


@pytest.mark.parametrize("change, said", [
    ({"requires": ("no-such-patch",)}, "requires names 'no-such-patch', which is no patch of the registry; expected ids of: "),
    ({"conflicts": ("gdn-output-prealloc",)}, "conflicts names the patch itself"),
    ({"requires": ("forward-telemetry",), "conflicts": ("forward-telemetry",)},
     "requires and conflicts both name 'forward-telemetry'; expected one"),
])
def test_dependencies_name_registry_patches(monkeypatch: pytest.MonkeyPatch, change: dict, said: str) -> None:  # type: ignore[type-arg]
    from vllm_overlay.errors import OverlayError

    monkeypatch.setattr(gdn, "SPEC", dataclasses.replace(gdn.SPEC, **change))
    core._order_checked[0] = ()
    with pytest.raises(OverlayError, match="the dependencies between the registry's patches") as err:
        core.registry()
    assert f"PatchSpec 'gdn-output-prealloc': {said}" in str(err.value)
    core._order_checked[0] = ()


def test_a_cycle_of_requires_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_overlay.errors import OverlayError
    from vllm_overlay.patches import forward_telemetry as ft

    monkeypatch.setattr(ft, "SPEC", dataclasses.replace(ft.SPEC, requires=("gdn-output-prealloc",)))
    core._order_checked[0] = ()
    with pytest.raises(OverlayError, match="'forward-telemetry' -> 'gdn-output-prealloc' -> 'forward-telemetry': "
                                           "requires forms a cycle"):
        core.registry()
    core._order_checked[0] = ()


def test_core_binds_the_context_the_patches_read(overlay) -> None:  # type: ignore[no-untyped-def]
    """compile-cache-key and profile-run-cap read the other patches through the PatchContext core binds
    (hook "bind"), never through core."""
    from vllm_overlay.context import UNBOUND
    from vllm_overlay.patches import compile_cache_key as cck

    cck.bind(UNBOUND)
    core.register()
    ctx = cck._context[0]
    assert ctx is not UNBOUND and ctx.specs == core.specs()
    assert "gdn-output-prealloc" in ctx.traced_code_ids() and "compile-cache-key" in ctx.applied_ids()
    assert ctx.traced_settings() == cck.SPEC.settings and cck.overlay_factor() != ""
    core.revert()
    assert ctx.traced_code_ids() == [] and cck.overlay_factor() == ""


def test_unknown_id_lists_known_ids() -> None:
    with pytest.raises(UnknownPatchError) as err:
        core.decide({"VLLM_OVERLAY_DISABLE": "gdn-prealloc"})
    msg = str(err.value)
    assert "VLLM_OVERLAY_DISABLE" in msg and "'gdn-prealloc'" in msg and "gdn-output-prealloc" in msg


def test_conflicting_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    specs = list(core.specs())
    specs[0] = dataclasses.replace(specs[0], conflicts=(specs[1].id,))
    monkeypatch.setattr(core, "specs", lambda: tuple(specs))
    with pytest.raises(PatchConflictError) as err:
        core.decide({})
    assert specs[0].id in str(err.value) and specs[1].id in str(err.value)


NEWER = f"0.{int(versions.RELEASES[-1].split('.')[1]) + 10}.0"  # newer than the matrix, whatever it holds


@pytest.mark.parametrize("version,env,said", [
    ("0.19.0", {}, "vLLM 0.19.0 is not in the support matrix, and only a release newer than its newest"),
    ("0.32.1", {}, "vLLM 0.32.1 is not in the support matrix, and only a release newer than its newest"),
    ("0.21.0", {}, "vLLM 0.21.0 is left out of the support matrix: published on the package index as a source"),
    (NEWER, {"VLLM_OVERLAY_CARRY_OVER": "0"}, f"VLLM_OVERLAY_CARRY_OVER=0: vLLM {NEWER} is newer than the support"),
])
def test_release_not_in_the_matrix_skips_every_patch(version: str, env: dict[str, str], said: str) -> None:
    """Nothing is guessed: a version the support matrix does not list, and that nothing is carried over
    to (older than its newest, left out by name, or carry-over off), gets no patch at all."""
    d = by_id(core.decide(env, vllm=versions.Installed("vllm", version, "cuda")))
    for pid in ("forward-telemetry", "compile-cache-key", "gdn-output-prealloc", "hybrid-turboquant"):
        assert d[pid].status == "skipped" and d[pid].reason == core.unknown_release(version, env)
    assert core.unknown_release(version, env).startswith(said)


def test_matrix_decides_per_release() -> None:
    d = by_id(core.decide({}, vllm=versions.Installed("vllm", "0.25.0", "cuda")))
    assert d["forward-telemetry"].status == "planned" and d["gdn-output-prealloc"].status == "planned"
    assert d["hybrid-turboquant"].status == "upstream-merged" and "39931" in d["hybrid-turboquant"].reason
    d = by_id(core.decide({}, vllm=versions.Installed("vllm", "0.20.0", "cuda")))
    assert d["hybrid-turboquant"].status == "planned"


def test_unknown_release_is_one_loud_line(overlay, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(versions, "installed_vllm", lambda: versions.Installed("vllm", "0.19.0", "cuda"))
    before = originals()
    caplog.set_level("INFO", logger="vllm_overlay")
    core.register()
    err = caplog.text
    lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name.startswith("vllm_overlay")]
    assert len(lines) == 1 and "vLLM 0.19.0 is not in the support matrix" in lines[0], err
    assert all(before[k] is v for k, v in originals().items())
    assert {p["status"] for p in STATE.patches.values()} <= {"skipped", "off"}


def test_unknown_release_strict_refuses_to_start(overlay, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(versions, "installed_vllm", lambda: versions.Installed("vllm", "0.21.0", "cuda"))
    monkeypatch.setenv("VLLM_OVERLAY_STRICT", "1")
    with pytest.raises(StrictModeError) as err:
        core.register()
    assert "vLLM 0.21.0 is left out of the support matrix" in str(err.value)


def test_apply_then_revert_restores_every_target(overlay) -> None:  # type: ignore[no-untyped-def]
    before = originals()
    core.register()
    during = originals()
    changed = [k for k in before if before[k] is not during[k]]
    # every distinct target of the default-on patches on 0.32.0 was replaced: 10 on the V1 runner,
    # the GDN layer, the scheduler, fused_moe.get_moe_configs and MultiProcessCollector.__init__
    # (GPUModelRunner._dummy_run is wrapped by two patches and counts once), 5 on Model Runner V2
    # (__init__, execute_model, _dummy_run, prepare_inputs, capture_model), the worker's
    # execute_model (the runner patches' first-forward check), and memory-headroom's
    # CPUWorker.determine_available_memory, GPUModelRunner.profile_run and initialize_kv_cache on
    # both runners (not the CUDA Worker's determine_available_memory, a target for the CUDA build
    # only), and
    # rank-reports' EngineCore.__init__, step, step_with_batch_queue and
    # WorkerWrapperBase.initialize_from_config
    assert len(changed) == 25, changed
    assert "vllm.v1.engine.core:EngineCore.step_with_batch_queue" in changed
    assert "vllm.v1.worker.gpu_model_runner:GPUModelRunner.initialize_kv_cache" in changed
    assert "vllm.v1.worker.gpu_worker:Worker.determine_available_memory" not in changed
    report = json.load(open(STATE.report_path()))
    assert report["patches"]["gdn-output-prealloc"]["status"] == "applied"
    assert report["patches"]["forward-telemetry"]["status"] == "applied"
    core.register()  # idempotent: nothing changes
    assert originals() == during and STATE.register_calls == 2
    core.revert()
    after = originals()
    assert all(before[k] is after[k] for k in before), [k for k in before if before[k] is not after[k]]
    rewritten = vars(importlib.import_module(gdn.MOD_032).QwenGatedDeltaNetAttention)["forward_cpu"]
    assert not hasattr(rewritten, "__vllm_overlay__")


def _drift(monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tuple(dataclasses.replace(rw, sha256="0" * 64) for rw in gdn.SPEC.rewrites)
    monkeypatch.setattr(gdn, "SPEC", dataclasses.replace(gdn.SPEC, rewrites=bad))


def test_drifted_anchor_is_a_loud_skip(overlay, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    _drift(monkeypatch)
    before = originals()
    with caplog.at_level(logging.WARNING, logger="vllm_overlay"):
        core.register()
    rec = STATE.patches["gdn-output-prealloc"]
    assert rec["status"] == "failed" and "pristine source hash mismatch" in rec["reason"]
    assert any("gdn-output-prealloc skipped" in r.getMessage() for r in caplog.records)
    # a failed patch leaves nothing behind; the others still applied
    after = originals()
    gdn_targets = [k for k in before if "gdn" in k or "_model_forward" in k]
    assert all(before[k] is after[k] for k in gdn_targets if "_dummy_run" not in k)
    assert STATE.patches["forward-telemetry"]["status"] == "applied"


def test_drifted_anchor_strict_aborts(overlay, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    _drift(monkeypatch)
    monkeypatch.setenv("VLLM_OVERLAY_STRICT", "1")
    with pytest.raises(StrictModeError) as err:
        core.register()
    assert "gdn-output-prealloc" in str(err.value) and "hash mismatch" in str(err.value)


def test_bad_setting_stops_register(overlay, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from vllm_overlay.errors import SettingError

    monkeypatch.setenv("VLLM_OVERLAY_PROFILE_RUN_CAP", "4k")
    with pytest.raises(SettingError):
        core.register()


def test_import_has_no_side_effects() -> None:
    import subprocess
    import sys

    code = ("import sys, vllm_overlay; import vllm_overlay.core, vllm_overlay.settings; "
            "print(sorted(m for m in sys.modules if m.startswith('vllm') and not m.startswith('vllm_overlay')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_install_that_installs_nothing_is_not_applied(overlay, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    real = core.installmech.install

    def install(spec, module, module_name, version, platform=None):  # type: ignore[no-untyped-def]
        return [] if spec.id == "compile-cache-key" else real(spec, module, module_name, version, platform)

    monkeypatch.setattr(core.installmech, "install", install)
    core.register()
    rec = STATE.patches["compile-cache-key"]
    assert rec["status"] == "failed" and "installed nothing" in rec["reason"]
    assert "compile-cache-key" not in core.active_ids()


def test_a_target_for_one_platform_is_pending_only_there() -> None:
    """A module only one vLLM build imports (the CPU worker's) must not leave a patch armed on the
    other: Target.platform limits where it is installed; verify still checks it everywhere."""
    from vllm_overlay.spec import PatchSpec, Support, Target

    spec = PatchSpec(id="p", title="t", why="w", upstream="u", mechanism="wrap", default=True, retire_when="r",
                     support=(Support(">=0.20.0", "applies", "x"),),
                     targets=(Target("m.cuda_mod", "A.f", wrapper=_w, platform="cuda"),
                              Target("m.cpu_mod", "B.f", wrapper=_w, platform="cpu"),
                              Target("m.both", "C.f", wrapper=_w)))
    assert spec.modules("0.32.0", "cuda") == ["m.both", "m.cuda_mod"]
    assert spec.modules("0.32.0", "cpu") == ["m.both", "m.cpu_mod"]
    assert spec.modules("0.32.0") == ["m.both", "m.cpu_mod", "m.cuda_mod"]
    with pytest.raises(ValueError, match="Target.platform='rocm'"):
        Target("m", "A.f", wrapper=_w, platform="rocm")


def test_disabled_by_turns_a_default_on_patch_off_with_its_setting_named() -> None:
    from vllm_overlay.spec import PatchSpec, Support, Target

    kw = dict(id="p", title="t", why="w", upstream="u", mechanism="wrap", retire_when="r",
              support=(Support(">=0.20.0", "applies", "x"),), targets=(Target("m", "A.f", wrapper=_w),))
    with pytest.raises(ValueError, match="disabled_by turns off a default-on patch"):
        PatchSpec(default=False, disabled_by="VLLM_OVERLAY_STRICT", **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="exclusive"):
        PatchSpec(default=True, disabled_by="VLLM_OVERLAY_STRICT", enabled_by="VLLM_OVERLAY_STRICT", **kw)  # type: ignore[arg-type]
    spec = PatchSpec(default=True, disabled_by="VLLM_OVERLAY_TEST_GUARD", **kw)  # type: ignore[arg-type]
    assert spec.default_text() == "on (off when `VLLM_OVERLAY_TEST_GUARD`=0)"
