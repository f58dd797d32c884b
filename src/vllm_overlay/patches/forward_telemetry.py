"""forward-telemetry: record the scheduled-token count of every model forward in the worker."""

from __future__ import annotations

from typing import Any

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


def _note_runner(runner: Any) -> None:
    if STATE.engine_config:
        return
    STATE.worker_rank = worker_rank()
    STATE.tp_rank = tp_rank()
    try:
        STATE.engine_config = {
            "max_num_batched_tokens": int(runner.scheduler_config.max_num_batched_tokens),
            "max_num_seqs": int(runner.scheduler_config.max_num_seqs),
            "max_model_len": int(runner.model_config.max_model_len),
            "model": str(runner.model_config.model),
        }
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
    STATE.dummy_forwards.record(n)
    if kwargs.get("is_profile"):
        STATE.profile_forward_tokens.append(n)
    STATE.dirty = True
    return wrapped(*args, **kwargs)


def _init(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    _note_runner(instance)
    STATE.write()  # the live limits are visible to the harness before any traffic
    return result

