"""profile-run-cap: bound the token count of vLLM's memory-profiling forward, nothing else."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from vllm_overlay import settings
from vllm_overlay.mechanisms.wrap import Installed, wrap
from vllm_overlay.patches._runner import RUNNER, RUNNER_MODULE, dummy_tokens
from vllm_overlay.report import LOG, STATE
from vllm_overlay.spec import PatchSpec, Target

SPEC = PatchSpec(
    id="profile-run-cap",
    title="Cap the memory-profiling dummy forward (never a buffer size)",
    why=(
        "vLLM profiles activation memory with one dummy forward of max_num_batched_tokens tokens. "
        "The reference patch tree capped it to survive a boot crash that its own undersized GDN "
        "buffer caused; with this overlay's buffer sizing that crash does not happen, so the cap "
        "is NOT needed for it. It remains useful only to shorten or shrink profiling on purpose. "
        "It caps the profiling forward alone: every buffer still follows the token-budget "
        "resolver. When it fires it says that activations above the cap were not profiled, so "
        "the KV cache may be sized larger than the largest forward leaves room for."
    ),
    upstream="https://github.com/vllm-project/vllm/blob/v0.20.2/vllm/v1/worker/gpu_model_runner.py (profile_run)",
    targets=(Target(RUNNER_MODULE, f"{RUNNER}._dummy_run"),),
    mechanism="wrap",
    vllm=">=0.20.2,<=0.32.0",
    default=False,
    enabled_by="VLLM_OVERLAY_PROFILE_RUN_CAP",
    retire_when="Never needed for the GDN crash; retire once no user sets the cap.",
    settings=("VLLM_OVERLAY_PROFILE_RUN_CAP",),
)


def MODULES(version: str) -> list[str]:  # noqa: N802 - part of the patch interface
    return [RUNNER_MODULE]


def _dummy_run(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if not kwargs.get("is_profile"):
        return wrapped(*args, **kwargs)
    cap = int(settings.value("VLLM_OVERLAY_PROFILE_RUN_CAP"))
    n = dummy_tokens(args, kwargs)
    if cap <= 0 or n <= cap:
        return wrapped(*args, **kwargs)
    msg = (
        f"profile-run-cap: profiling forward capped from {n} to {cap} tokens "
        f"(VLLM_OVERLAY_PROFILE_RUN_CAP); activations of forwards in ({cap}, {n}] were NOT "
        "profiled and may not fit in the memory left after the KV cache"
    )
    LOG.warning(msg)
    STATE.event(msg)
    if "num_tokens" in kwargs:
        kwargs = {**kwargs, "num_tokens": cap}
    else:
        args = (cap, *args[1:])
    return wrapped(*args, **kwargs)


def install(module_name: str, module: ModuleType) -> list[Installed]:
    return [wrap(RUNNER_MODULE, f"{RUNNER}._dummy_run", _dummy_run)]
