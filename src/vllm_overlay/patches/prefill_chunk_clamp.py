"""prefill-chunk-clamp: bound one request's prefill chunk per scheduler step."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from vllm_overlay import settings
from vllm_overlay.mechanisms.wrap import Installed, wrap
from vllm_overlay.report import LOG, STATE
from vllm_overlay.spec import PatchSpec, Target

MODULE = "vllm.v1.core.sched.scheduler"
QUALNAME = "Scheduler.__init__"

SPEC = PatchSpec(
    id="prefill-chunk-clamp",
    title="Clamp one request's prefill chunk (long_prefill_token_threshold)",
    why=(
        "Sets vLLM's long_prefill_token_threshold in the scheduler so that no single request "
        "prefills more than VLLM_OVERLAY_PREFILL_CHUNK_CLAMP tokens in one step, which keeps "
        "decode latency smooth under long prompts. It does NOT bound a forward's total: several "
        "co-scheduled requests still push one forward up to max_num_batched_tokens, which is "
        "exactly the band where the GDN crash lived. If the user already set a smaller "
        "threshold, theirs is kept."
    ),
    upstream="https://github.com/vllm-project/vllm/blob/v0.20.2/vllm/v1/core/sched/scheduler.py",
    targets=(Target(MODULE, QUALNAME),),
    mechanism="wrap",
    vllm=">=0.20.2,<=0.32.0",
    default=False,
    enabled_by="VLLM_OVERLAY_PREFILL_CHUNK_CLAMP",
    retire_when="Users pass --long-prefill-token-threshold themselves.",
    settings=("VLLM_OVERLAY_PREFILL_CHUNK_CLAMP",),
)


def MODULES(version: str) -> list[str]:  # noqa: N802 - part of the patch interface
    return [MODULE]


def _init(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    clamp = int(settings.value("VLLM_OVERLAY_PREFILL_CHUNK_CLAMP"))
    sched = instance.scheduler_config
    current = int(getattr(sched, "long_prefill_token_threshold", 0) or 0)
    if clamp > 0 and (current == 0 or clamp < current):
        sched.long_prefill_token_threshold = clamp
        msg = (f"prefill-chunk-clamp: long_prefill_token_threshold {current} -> {clamp} "
               f"(max_num_batched_tokens {sched.max_num_batched_tokens} still bounds the forward)")
    else:
        msg = f"prefill-chunk-clamp: kept the user's long_prefill_token_threshold {current} (<= {clamp})"
    LOG.info(msg)
    STATE.event(msg)
    return result


def install(module_name: str, module: ModuleType) -> list[Installed]:
    return [wrap(MODULE, QUALNAME, _init)]
