"""profile-run-cap sizes vLLM's locked workspaces for max_num_batched_tokens, not for the cap.

On the H200 (vLLM 0.20.2) a capped profiling forward left the fused-MoE workspace at the cap's
size; vLLM locks workspaces at the end of CUDA graph capture, and the first forward above the cap
died (bench/results/tq-tiny-cap4096-before-workspace-fix.json). The CPU build never captures CUDA
graphs (its worker does not call capture_model), so here a small stand-in runner takes the place of
GPUModelRunner, wrapped exactly as the patch wraps the real one. The GPU runs after the fix are in
bench/results/ (cap 4096, band forwards served).
"""

from __future__ import annotations

from typing import Any

import pytest
import wrapt

from vllm_overlay.patches import profile_run_cap as prc


class StandInRunner:
    """Stands in for GPUModelRunner: records dummy forwards; capture_model 'locks' the workspace."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.fail_at: int | None = None
        self.fail_with: Exception | None = None

    def _dummy_run(self, num_tokens: int, **kwargs: Any) -> None:
        if self.fail_at is not None and num_tokens >= self.fail_at:
            raise self.fail_with or MemoryError(f"CUDA out of memory at {num_tokens} tokens")
        self.events.append(("forward", num_tokens, bool(kwargs.get("is_profile"))))

    def capture_model(self) -> int:
        self.events.append(("capture+lock",))
        return 0


@pytest.fixture()
def runner_cls():  # type: ignore[no-untyped-def]
    cls = type("Runner", (StandInRunner,), {})
    cls._dummy_run = wrapt.FunctionWrapper(StandInRunner._dummy_run, prc._dummy_run)
    cls.capture_model = wrapt.FunctionWrapper(StandInRunner.capture_model, prc._capture_model)
    return cls


def test_full_size_forward_before_the_workspace_is_locked(runner_cls, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("VLLM_OVERLAY_PROFILE_RUN_CAP", "4096")
    r = runner_cls()
    with caplog.at_level("WARNING", logger="vllm_overlay"):
        r._dummy_run(8192, is_profile=True)
        r.capture_model()
    assert r.events == [("forward", 4096, True), ("forward", 8192, False), ("capture+lock",)]
    assert any("one un-profiled dummy forward of 8192 tokens" in m for m in caplog.messages)
    r.capture_model()  # once per capped profile: a second capture adds nothing
    assert r.events[-2:] == [("capture+lock",), ("capture+lock",)]


def test_no_extra_forward_when_the_cap_did_not_fire(runner_cls, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("VLLM_OVERLAY_PROFILE_RUN_CAP", "16384")
    r = runner_cls()
    r._dummy_run(8192, is_profile=True)
    r.capture_model()
    assert r.events == [("forward", 8192, True), ("capture+lock",)]


def _capped_and_failing(runner_cls, monkeypatch, fail_with=None):  # type: ignore[no-untyped-def]
    """Cap 4096, a profiling forward of 8192 done; the pre-capture forward of 8192 will fail (with
    ``fail_with`` where given)."""
    monkeypatch.setenv("VLLM_OVERLAY_PROFILE_RUN_CAP", "4096")
    r = runner_cls()
    r.fail_at = 8192
    r.fail_with = fail_with  # None: the stand-in's out-of-memory error
    r._dummy_run(8192, is_profile=True)
    return r


def test_a_full_size_forward_that_does_not_fit_fails_at_boot_naming_the_cap(runner_cls, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    r = _capped_and_failing(runner_cls, monkeypatch)
    with pytest.raises(RuntimeError, match="VLLM_OVERLAY_PROFILE_RUN_CAP=4096.*unset the cap or lower gpu_memory_utilization"):
        r.capture_model()
    assert ("capture+lock",) not in r.events


def test_a_buffer_below_the_forward_is_not_blamed_on_memory(runner_cls, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """On the H200 the legacy 4096-row buffer died here with setStorage (redgreen-...-red-runtime.json)."""
    r = _capped_and_failing(runner_cls, monkeypatch, RuntimeError(
        "setStorage: sizes [8192, 32, 128] ... out of bounds for storage of size 33554432"))
    with pytest.raises(RuntimeError, match="setStorage.*fails here at boot instead of under traffic") as err:
        r.capture_model()
    assert "gpu_memory_utilization" not in str(err.value)


def test_our_capacity_error_passes_through_unchanged(runner_cls, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from vllm_overlay.errors import CapacityError

    r = _capped_and_failing(runner_cls, monkeypatch, CapacityError(
        "a dummy forward of 8192 tokens exceeds the GDN output buffer of 4096 rows"))
    with pytest.raises(CapacityError, match="exceeds the GDN output buffer"):
        r.capture_model()


@pytest.mark.parametrize("headroom", [False, True], ids=["headroom-off", "headroom-live"])
def test_eager_runner_says_the_precapture_forward_will_not_run(runner_cls, monkeypatch, caplog, headroom) -> None:  # type: ignore[no-untyped-def]
    """With enforce_eager (and on the CPU worker) vLLM never calls capture_model: the promised
    full-size forward cannot run, which is counted every time and said once."""
    from types import SimpleNamespace

    from vllm_overlay.report import STATE

    monkeypatch.setenv("VLLM_OVERLAY_PROFILE_RUN_CAP", "4096")
    monkeypatch.setattr(prc, "_no_capture_warned", False)
    monkeypatch.setattr(prc, "_headroom_live", lambda: headroom)
    STATE.reset()
    r = runner_cls()
    r.model_config = SimpleNamespace(enforce_eager=True)
    with caplog.at_level("WARNING", logger="vllm_overlay"):
        r._dummy_run(8192, is_profile=True)
        r._dummy_run(8192, is_profile=True)
    assert STATE.counters["precapture_forward_skipped"] == 2
    lines = [rec.getMessage() for rec in caplog.records if "will NOT run" in rec.getMessage()]
    assert len(lines) == 1 and "enforce_eager" in lines[0]
    # what sizes the workspaces instead depends on whether memory-headroom is live in this process
    assert ("memory-headroom's measuring forward of 8192 tokens" in lines[0]) == headroom
    assert ("the first forward above the cap (4096)" in lines[0]) != headroom
    assert any("will NOT run" in e for e in STATE.events)
    assert r not in prc._capped
    STATE.reset()
