"""forward-telemetry: record the scheduled-token count of every model forward in the worker."""

from __future__ import annotations

import weakref
from typing import Any

from vllm_overlay import budget, report, settings
from vllm_overlay.patches import _runner
from vllm_overlay.patches._runner import (
    RUNNER_CLASS,
    RUNNER_MODULES,
    V1_MODULE,
    V1_RELEASES,
    V2_MODULE,
    WORKER,
    WORKER_MODULE,
    dummy_tokens,
    tp_rank,
    worker_rank,
)
from vllm_overlay.report import STATE
from vllm_overlay.spec import PatchSpec, Proof, Support, Target, wraps
from vllm_overlay.telemetry import TELEMETRY

V1_INIT = Target(V1_MODULE, f"{RUNNER_CLASS}.__init__", V1_RELEASES)
V1_EXECUTE = Target(V1_MODULE, f"{RUNNER_CLASS}.execute_model", V1_RELEASES, params=("scheduler_output",))
V1_DUMMY_RUN = Target(V1_MODULE, f"{RUNNER_CLASS}._dummy_run", V1_RELEASES, params=("num_tokens", "is_profile"))
V2_INIT = Target(V2_MODULE, f"{RUNNER_CLASS}.__init__")
V2_EXECUTE = Target(V2_MODULE, f"{RUNNER_CLASS}.execute_model", params=("scheduler_output", "dummy_run"))
V2_DUMMY_RUN = Target(V2_MODULE, f"{RUNNER_CLASS}._dummy_run", params=("num_tokens", "is_profile"))
WORKER_EXECUTE = Target(WORKER_MODULE, f"{WORKER}.execute_model", params=("scheduler_output",))

SPEC = PatchSpec(
    id="forward-telemetry",
    hooks=("on_revert",),
    title="Forward-size telemetry in the worker",
    why=(
        "The bug this project exists for only happens when one forward lands in a narrow band of "
        "sizes that ordinary benchmarks never reach. Nobody can tell whether a test exercised the "
        "band unless every forward's scheduled-token count is recorded. This patch counts them "
        "(exact counts per size, power-of-two buckets, min and max) in the worker's JSON report, "
        "and separately the dummy forwards vLLM runs for profiling, warm-up and graph capture. It "
        "hooks both of vLLM's model runners (V1 and Model Runner V2); the report names the one the "
        "worker built."
    ),
    upstream="https://github.com/vllm-project/vllm/blob/v0.20.2/vllm/v1/worker/gpu_model_runner.py",
    targets=(V1_INIT, V1_EXECUTE, V1_DUMMY_RUN, V2_INIT, V2_EXECUTE, V2_DUMMY_RUN, WORKER_EXECUTE),
    mechanism="wrap",
    support=(
        Support(">=0.20.0,<=0.33.0", "applies",
                "the overlay's own per-forward counts. V1 runner: __init__, execute_model and _dummy_run "
                "exist with the parameters it reads. Model Runner V2 (vllm/v1/worker/gpu/model_runner.py): "
                "__init__, execute_model(scheduler_output, ..., dummy_run) and _dummy_run(num_tokens, "
                "is_profile) exist; its start-up warm-up requests, named _warmup_{i}_, are counted as dummy "
                "forwards; its graph-capture forwards are not counted (the graph manager runs them, not "
                "_dummy_run)",
                (Proof("v1/worker/gpu/warmup.py", 'f"_warmup_{i}_"'),)),
        Support("==0.34.0", "applies",
                "the overlay's own per-forward counts, on Model Runner V2 only (vLLM 0.34.0 removed the V1 "
                "runner: VLLM_USE_V2_MODEL_RUNNER other than 1 is refused). __init__, execute_model("
                "scheduler_output, ..., dummy_run) and _dummy_run(num_tokens, is_profile) exist; every warm-up "
                "step (_warmup_{i}_, and the _v2_mixed_warmup_* steps, among them the extensible KV cache's "
                "sizing step of max_num_batched_tokens tokens) is counted as a dummy forward, never as traffic",
                (Proof("v1/worker/gpu/warmup.py", 'f"_warmup_{i}_"'),
                 Proof("v1/worker/gpu/warmup.py", 'req_id_prefix: str = "_v2_mixed_warmup"'),
                 Proof("v1/worker/gpu/warmup.py", 'f"{req_id_prefix}_prefill_{i}_"'),
                 Proof("v1/worker/gpu/warmup.py", 'f"_context_warmup_{i}_"'),
                 Proof("platforms/interface.py", "Model Runner V1 has been removed"))),
    ),
    default=True,
    retire_when="vLLM exports per-forward scheduled-token counts itself (a metric or a hook).",
    settings=("VLLM_OVERLAY_REPORT_DIR", "VLLM_OVERLAY_STRICT"),
    either_modules=(RUNNER_MODULES,),
    beyond_matrix="carry",
    beyond_matrix_why=("it only counts forwards in the overlay's report; a hook that no longer fits fails or goes "
                       "unfired loudly, and nothing vLLM computes changes"),
)


# the report's ``engine_config``: the live limits of the runner this process serves (the stress
# harness plans its bands from them; /metrics shows them and takes its histogram's edges from them)
ENGINE_CONFIG = report.section("engine_config", report.Fields)
_noted: list[Any] = [None]  # weak reference to the runner engine_config describes


def _note_runner(runner: Any) -> None:
    """engine_config describes the live runner (a later engine in the same process replaces it)."""
    ref = _noted[0]
    if ENGINE_CONFIG and ref is not None and ref() is runner:
        # the hybrid page planner raises the block size after the runner is built: keep it live
        block = int(getattr(getattr(runner, "cache_config", None), "block_size", 0) or 0)
        if block and ENGINE_CONFIG.get("block_size") not in (None, block):
            ENGINE_CONFIG.note(block_size=block)
        return
    try:
        _noted[0] = weakref.ref(runner)
    except TypeError:
        _noted[0] = None
    STATE.set_identity(worker_rank(), tp_rank())
    try:
        ENGINE_CONFIG.replace({
            "max_num_batched_tokens": int(runner.scheduler_config.max_num_batched_tokens),
            "max_num_seqs": int(runner.scheduler_config.max_num_seqs),
            "max_model_len": int(runner.model_config.max_model_len),
            "model": str(runner.model_config.model),
            "runner_max_num_tokens": int(getattr(runner, "max_num_tokens", -1)),
            "num_speculative_tokens": int(getattr(getattr(runner, "speculative_config", None),
                                                  "num_speculative_tokens", 0) or 0),
            "profile_run_cap": int(settings.value("VLLM_OVERLAY_PROFILE_RUN_CAP")),
            # how the scheduler chunks prefills (the band stress plans its waves from these)
            "block_size": int(getattr(runner.cache_config, "block_size", 0) or 0),
            "mamba_cache_mode": str(getattr(runner.cache_config, "mamba_cache_mode", "none") or "none"),
            "long_prefill_token_threshold": int(getattr(runner.scheduler_config,
                                                        "long_prefill_token_threshold", 0) or 0),
        })
        if getattr(runner, "max_num_tokens", None) is not None:
            budget.note_runner_limit(runner.vllm_config, runner.max_num_tokens)
    except Exception:  # noqa: BLE001 - a runner without these fields: leave it empty
        ENGINE_CONFIG.replace({"unknown": True})


@wraps(V1_EXECUTE)
def _execute_model(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    _runner.fired(SPEC.id, instance, "execute_model")
    sched = kwargs.get("scheduler_output", args[0] if args else None)
    n = int(getattr(sched, "total_num_scheduled_tokens", 0) or 0)
    if n > 0:
        _note_runner(instance)
        TELEMETRY.record(n)
    return wrapped(*args, **kwargs)


@wraps(V2_EXECUTE)
def _execute_model_v2(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Model Runner V2: its dummy forwards come here too (dummy_run=True, counted by _dummy_run),
    and its start-up warm-up runs real steps on requests named _warmup_{i}_ (counted as dummy)."""
    _runner.fired(SPEC.id, instance, "execute_model")
    dummy = kwargs.get("dummy_run", args[2] if len(args) > 2 else False)
    if not dummy:
        sched = _runner.scheduler_output(args, kwargs)
        n = int(getattr(sched, "total_num_scheduled_tokens", 0) or 0)
        if n > 0:
            _note_runner(instance)
            if _runner.is_warmup(sched):
                TELEMETRY.record_dummy(n, False)
                STATE.count("warmup_forwards")
            else:
                TELEMETRY.record(n)
    return wrapped(*args, **kwargs)


@wraps(V1_DUMMY_RUN, V2_DUMMY_RUN)
def _dummy_run(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    _runner.fired(SPEC.id, instance, "_dummy_run")
    n = dummy_tokens(args, kwargs)
    _note_runner(instance)
    TELEMETRY.record_dummy(n, bool(kwargs.get("is_profile")))
    return wrapped(*args, **kwargs)


@wraps(V1_INIT, V2_INIT)
def _init(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    _runner.fired(SPEC.id, instance, "__init__")
    _note_runner(instance)
    STATE.write()  # the live limits are visible to the harness before any traffic
    return result


# every real forward of V1 and of V2 passes through the runner's execute_model
_worker_execute_model = wraps(WORKER_EXECUTE)(
    _runner.first_forward_check(lambda: SPEC, {"V1": ("execute_model",), "V2": ("execute_model",)}))


def on_revert() -> None:
    _runner.on_revert(SPEC.id)
