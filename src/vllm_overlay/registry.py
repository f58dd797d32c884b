"""The registry: one module per patch, in the order they install (a later one wraps outside
earlier ones, so a patch listed later sees calls first). Where two patches change one vLLM
function, the later one's spec names the earlier one in ``wraps_outside``; ``core.registry()``
refuses an order that contradicts the specs or leaves such a pair undeclared."""

PATCH_MODULES: tuple[str, ...] = (
    "vllm_overlay.patches.forward_telemetry",
    "vllm_overlay.patches.compile_cache_key",
    "vllm_overlay.patches.gdn_output_prealloc",
    "vllm_overlay.patches.profile_run_cap",
    "vllm_overlay.patches.memory_headroom",
    "vllm_overlay.patches.prefill_chunk_clamp",
    "vllm_overlay.patches.hybrid_turboquant",
    "vllm_overlay.patches.turboquant_spec_decode",
    "vllm_overlay.patches.turboquant_prefill_continuation",
    "vllm_overlay.patches.turboquant_v1_kv_shape",
    "vllm_overlay.patches.moe_configs",
    "vllm_overlay.patches.decode_gemv",
    "vllm_overlay.patches.moe_decode",
    "vllm_overlay.patches.rank_reports",
    "vllm_overlay.patches.prometheus_metrics",
)
