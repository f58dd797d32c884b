"""prefill-chunk-clamp: bound one request's prefill chunk per scheduler step."""

from __future__ import annotations

from typing import Any

from vllm_overlay import settings
from vllm_overlay.report import LOG, STATE
from vllm_overlay.spec import PatchSpec, Proof, Support, Target, wraps

MODULE = "vllm.v1.core.sched.scheduler"
QUALNAME = "Scheduler.__init__"

SCHED_PATH = "v1/core/sched/scheduler.py"
ONLY_WHEN_SHARED = "if num_eligible_reqs > 1"
BOUNDS_EVERY = (
    "bounds the prefill chunk of every running or waiting request per step, a long prompt alone "
    "included; not a forward's total"
)
BOUNDS_SHARED = (
    "bounds a request's prefill chunk only while more than one request is running or waiting "
    "(vLLM applies long_prefill_token_threshold only then): a long prompt alone is not clamped; "
    "not a forward's total"
)

SCHEDULER_INIT = Target(MODULE, QUALNAME)

SPEC = PatchSpec(
    id="prefill-chunk-clamp",
    title="Clamp one request's prefill chunk (long_prefill_token_threshold)",
    why=(
        "Sets vLLM's long_prefill_token_threshold in the scheduler so that no single request "
        "prefills more than VLLM_OVERLAY_PREFILL_CHUNK_CLAMP tokens in one step, which keeps "
        "decode latency smooth under long prompts. It does NOT bound a forward's total: several "
        "co-scheduled requests still push one forward up to max_num_batched_tokens, which is "
        "exactly the band where the GDN crash lived. If the user already set a smaller "
        "threshold, theirs is kept. It acts only where vLLM itself chunks prefills (chunked "
        "prefill on, a decoder-only model, not pooling) and says so when it stands aside."
    ),
    upstream="https://github.com/vllm-project/vllm/blob/v0.20.2/vllm/v1/core/sched/scheduler.py",
    targets=(SCHEDULER_INIT,),
    mechanism="wrap",
    support=(
        Support("<0.31.0", "applies", BOUNDS_EVERY,
                (Proof(SCHED_PATH, "if 0 < self.scheduler_config.long_prefill_token_threshold < num_new_tokens"),
                 Proof(SCHED_PATH, ONLY_WHEN_SHARED, present=False))),
        Support(">=0.31.0,<=0.33.0", "applies", BOUNDS_SHARED,
                (Proof(SCHED_PATH, "if num_eligible_reqs > 1\n"),)),
        Support("==0.34.0", "applies", BOUNDS_SHARED + "; vLLM now also reads the threshold only with chunked "
                "prefill on, where the clamp stood aside already",
                (Proof(SCHED_PATH, "if self.scheduler_config.enable_chunked_prefill and num_eligible_reqs > 1"),)),
    ),
    default=False,
    enabled_by="VLLM_OVERLAY_PREFILL_CHUNK_CLAMP",
    retire_when="Users pass --long-prefill-token-threshold themselves.",
    settings=("VLLM_OVERLAY_PREFILL_CHUNK_CLAMP",),
    beyond_matrix="carry",
    beyond_matrix_why=("it only sets vLLM's long_prefill_token_threshold, which bounds how a prefill is chunked, not"
                       " what is computed"),
)


def stands_aside(scheduler: Any) -> str | None:
    """Why vLLM itself would not chunk prefills in this scheduler (so the clamp must not), or None."""
    sched = scheduler.scheduler_config
    model = getattr(getattr(scheduler, "vllm_config", None), "model_config", None)
    if not getattr(sched, "enable_chunked_prefill", True):
        return "chunked prefill is off"
    if getattr(scheduler, "is_encoder_decoder", False) or getattr(model, "is_encoder_decoder", False):
        return "an encoder-decoder model (vLLM does not chunk its prefills)"
    if getattr(model, "runner_type", None) == "pooling" or getattr(sched, "runner_type", None) == "pooling":
        return "a pooling model"
    return None


@wraps(SCHEDULER_INIT)
def _init(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    clamp = int(settings.value("VLLM_OVERLAY_PREFILL_CHUNK_CLAMP"))
    sched = instance.scheduler_config
    current = int(getattr(sched, "long_prefill_token_threshold", 0) or 0)
    why = stands_aside(instance)
    if why:
        msg = (f"prefill-chunk-clamp: stands aside: {why}; long_prefill_token_threshold left at "
               f"{current} (counter clamp_stood_aside)")
        STATE.count("clamp_stood_aside")
    elif clamp > 0 and (current == 0 or clamp < current):
        sched.long_prefill_token_threshold = clamp
        row = SPEC.support_for(STATE.vllm_version or "")
        msg = (f"prefill-chunk-clamp: long_prefill_token_threshold {current} -> {clamp} "
               f"(max_num_batched_tokens {sched.max_num_batched_tokens} still bounds the forward)"
               + (f"; on vLLM {STATE.vllm_version} it {row.reason}" if row else ""))
    else:
        msg = f"prefill-chunk-clamp: kept the user's long_prefill_token_threshold {current} (<= {clamp})"
    LOG.info(msg)
    STATE.event(msg)
    return result

