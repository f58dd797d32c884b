"""memory-headroom's measurement: prefill-shaped dummy forwards of max_num_batched_tokens tokens on
vLLM's own minimal profiling KV cache, before the real KV cache exists; their peak without that
temporary cache."""

from __future__ import annotations

from typing import Any

from vllm_overlay import headroom
from vllm_overlay.errors import OverlayError
from vllm_overlay.patches._memory_meters import CudaMeter, RssMeter


def is_oom(exc: BaseException) -> bool:
    return type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc).lower()


def tensors(obj: Any) -> list[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in tensors(o)]
    return []


def _kv_facts(runner: Any) -> tuple[int, int, int]:
    """(bytes, blocks, blocks per request) of the KV cache the runner holds now. Bytes are the
    distinct allocations behind its KV tensors (hybrid groups share them); blocks per request
    come from vLLM's own concurrency (num_blocks / blocks per request of max_model_len), so the
    KV tokens reported are the ones vLLM prints."""
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    cfg = runner.kv_cache_config
    storages: dict[int, int] = {}
    for t in tensors(runner.kv_caches):
        s = t.untyped_storage()
        storages[s.data_ptr()] = int(s.nbytes())
    concurrency = get_max_concurrency_for_kv_cache_config(runner.vllm_config, cfg)
    return sum(storages.values()), int(cfg.num_blocks), max(1, round(int(cfg.num_blocks) / concurrency))


def _init_temp_kv(runner: Any, rows: int) -> None:
    """vLLM's minimal profiling KV cache (the one it builds to profile CUDA graph memory: one block
    per CUDA graph batch size). Its helper reads max_cudagraph_capture_size for the block count,
    set for the call where it must change: the CPU build leaves it None, and its C++ causal-conv
    kernel wants a conv-state row per request of the forward (``rows``: the most requests of a
    measured shape). On CUDA the Triton kernels index the state rows per request, and the dummy
    forwards' block-table rows are zero, so requests share block 0 of vLLM's own cache."""
    from vllm.config import set_current_vllm_config

    cc = runner.compilation_config
    saved = cc.max_cudagraph_capture_size
    cpu = getattr(getattr(runner, "device", None), "type", None) == "cpu"
    if cpu:
        cc.max_cudagraph_capture_size = max(saved or 0, rows)
    elif saved is None:
        cc.max_cudagraph_capture_size = 0
    try:
        with set_current_vllm_config(runner.vllm_config):
            runner._init_minimal_kv_cache_for_profiling()
    finally:
        cc.max_cudagraph_capture_size = saved


def _drop_temp_kv(runner: Any, keys: dict[Any, set[Any]], keys_initialized: bool) -> None:
    """Undo _init_temp_kv as vLLM undoes it after CUDA graph profiling, and put the graph
    dispatcher's keys back as they were (the real initialize_kv_cache sets them again)."""
    dispatcher = runner.cudagraph_dispatcher
    for mode, key_set in dispatcher.cudagraph_keys.items():
        key_set.clear()
        key_set.update(keys.get(mode, ()))
    dispatcher.keys_initialized = keys_initialized
    runner.maybe_remove_all_loras(runner.lora_config)
    runner._cleanup_profiling_kv_cache()


def _forward(runner: Any, shape: headroom.Shape) -> None:
    """One eager dummy forward with attention metadata: ``shape.num_reqs`` requests as vLLM's
    _dummy_run splits ``shape.tokens`` over scheduler_config.max_num_seqs (set for the call), or its
    mixed batch (one-token decodes and one prefill), each request at ``shape.seq_len`` tokens of
    context (profile_seq_lens). With speculative decoding the GDN metadata reads each request's
    draft count from the runner's num_decode_draft_tokens; -1 marks a request without drafts, as
    the runner writes it for every real step, so the decodes of a mixed batch take the chunked
    path with the prefill, as requests without drafts do; the previous contents are put back."""
    from vllm.config import CUDAGraphMode

    sched = runner.scheduler_config
    saved = sched.max_num_seqs
    drafts = getattr(runner, "num_decode_draft_tokens", None) if runner.speculative_config else None
    saved_drafts = drafts.np.copy() if drafts is not None else None
    sched.max_num_seqs = shape.num_reqs
    try:
        if drafts is not None:
            drafts.np.fill(-1)
            drafts.copy_to_gpu()
        out = runner._dummy_run(shape.tokens, cudagraph_runtime_mode=CUDAGraphMode.NONE, force_attention=True,
                                skip_eplb=True, create_mixed_batch=shape.mixed, profile_seq_lens=shape.seq_len)
    finally:
        sched.max_num_seqs = saved
        if drafts is not None:
            drafts.np[:] = saved_drafts
            drafts.copy_to_gpu()
    del out


def measure(runner: Any, meter: CudaMeter | RssMeter, tokens: int) -> dict[str, Any]:
    """The absolute peak of prefill-shaped forwards of ``tokens`` tokens (headroom.forward_shapes),
    without the temporary KV cache they ran on, plus any non-torch memory they left behind."""
    import torch

    dispatcher = runner.cudagraph_dispatcher
    keys = {mode: set(s) for mode, s in dispatcher.cudagraph_keys.items()}
    keys_initialized = dispatcher.keys_initialized
    meter.reset_peak()  # a meter that cannot measure here says so before any work
    meter.sync()
    non_torch_before = meter.non_torch()
    start = meter.current()
    out: dict[str, Any] = {"shapes": []}
    with torch.inference_mode():
        shapes, out["left_out"] = headroom.forward_shapes(
            tokens, int(runner.scheduler_config.max_num_seqs), int(runner.model_config.max_model_len))
        try:
            _init_temp_kv(runner, max((s.num_reqs for s in shapes), default=1))
            kv_bytes, kv_blocks, per_request = _kv_facts(runner)
            peak = 0
            for shape in shapes:
                meter.reset_peak()
                before = meter.current()
                try:
                    _forward(runner, shape)
                    meter.sync()
                except Exception as exc:
                    if is_oom(exc) or isinstance(exc, OverlayError):  # the overlay's own guard speaks
                        raise
                    # a check in a kernel that refuses this shape (not a fault: the device is
                    # synchronised next, and a fault raises there): the others are measured, and
                    # the line names the one left out
                    meter.sync()
                    out["left_out"].append(f"{shape.name}: the forward failed ({type(exc).__name__}: "
                                           f"{str(exc)[:300]})")
                    continue
                p = meter.peak()
                peak = max(peak, p)
                out["shapes"].append({"name": shape.name, "num_reqs": shape.num_reqs, "seq_len": shape.seq_len,
                                      "mixed": shape.mixed, "before": before, "peak": p,
                                      "peak_without_kv": p - kv_bytes})
        finally:
            _drop_temp_kv(runner, keys, keys_initialized)
    meter.sync()
    growth = max(0, meter.non_torch() - non_torch_before)
    # what the forwards left allocated once the temporary cache is gone (e.g. attention workspaces a
    # layer keeps): in the measured peak; with a dry run it sits on top of vLLM's own sizing
    out.update(measured=peak - kv_bytes + growth, kv_temp_bytes=kv_bytes, kv_temp_blocks=kv_blocks,
               bytes_per_block=headroom.cdiv(kv_bytes, kv_blocks), blocks_per_request=per_request,
               non_torch_growth=growth, left_allocated=meter.current() - start)
    return out
