"""forward-telemetry: record the scheduled-token count of every model forward in the worker."""

from __future__ import annotations

import weakref
from typing import Any

from vllm_overlay import budget
from vllm_overlay.patches._runner import RUNNER, RUNNER_MODULE, dummy_tokens, tp_rank, worker_rank
from vllm_overlay.report import STATE
from vllm_overlay.spec import PatchSpec, Support, Target

SPEC = PatchSpec(
    id="forward-telemetry",
    title="Forward-size telemetry in the worker",
    why=(
        "The bug this project exists for only happens when one forward lands in a narrow band of "
        "sizes that ordinary benchmarks never reach. Nobody can tell whether a test exercised the "
        "band unless every forward's scheduled-token count is recorded. This patch counts them "
        "(exact counts per size, power-of-two buckets, min and max) in the worker's JSON report, "
        "and separately the dummy forwards vLLM runs for profiling, warm-up and graph capture."
    ),
    upstream="https://github.com/vllm-project/vllm/blob/v0.20.2/vllm/v1/worker/gpu_model_runner.py",
    targets=(
        Target(RUNNER_MODULE, f"{RUNNER}.__init__", wrapper="_init"),
        Target(RUNNER_MODULE, f"{RUNNER}.execute_model", wrapper="_execute_model", params=("scheduler_output",)),
        Target(RUNNER_MODULE, f"{RUNNER}._dummy_run", wrapper="_dummy_run", params=("num_tokens", "is_profile")),
    ),
    mechanism="wrap",
    support=(
        Support(">=0.20.0,<=0.33.0", "applies",
                "the overlay's own per-forward counts; the V1 runner methods it wraps exist with the "
                "parameters it reads"),
    ),
    default=True,
    retire_when="vLLM exports per-forward scheduled-token counts itself (a metric or a hook).",
    settings=("VLLM_OVERLAY_REPORT_DIR",),
)


_noted: list[Any] = [None]  # weak reference to the runner engine_config describes


def _note_runner(runner: Any) -> None:
    """engine_config describes the live runner (a later engine in the same process replaces it)."""
    ref = _noted[0]
    if STATE.engine_config and ref is not None and ref() is runner:
        return
    try:
        _noted[0] = weakref.ref(runner)
    except TypeError:
        _noted[0] = None
    STATE.set_identity(worker_rank(), tp_rank())
    try:
        STATE.engine_config = {
            "max_num_batched_tokens": int(runner.scheduler_config.max_num_batched_tokens),
            "max_num_seqs": int(runner.scheduler_config.max_num_seqs),
            "max_model_len": int(runner.model_config.max_model_len),
            "model": str(runner.model_config.model),
            "runner_max_num_tokens": int(getattr(runner, "max_num_tokens", -1)),
            "num_speculative_tokens": int(getattr(getattr(runner, "speculative_config", None),
                                                  "num_speculative_tokens", 0) or 0),
        }
        if getattr(runner, "max_num_tokens", None) is not None:
            budget.note_runner_limit(runner.vllm_config, runner.max_num_tokens)
    except Exception:  # noqa: BLE001 - a runner without these fields: leave it empty
        STATE.engine_config = {"unknown": True}


def _execute_model(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    sched = kwargs.get("scheduler_output", args[0] if args else None)
    n = int(getattr(sched, "total_num_scheduled_tokens", 0) or 0)
    if n > 0:
        _note_runner(instance)
        STATE.record_forward(n)
    return wrapped(*args, **kwargs)


def _dummy_run(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    n = dummy_tokens(args, kwargs)
    _note_runner(instance)
    STATE.record_dummy(n, bool(kwargs.get("is_profile")))
    return wrapped(*args, **kwargs)


def _init(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    _note_runner(instance)
    STATE.write()  # the live limits are visible to the harness before any traffic
    return result

