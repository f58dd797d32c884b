"""memory-headroom's measurement: prefill-shaped dummy forwards of max_num_batched_tokens tokens on
vLLM's own minimal profiling KV cache, before the real KV cache exists, and with speculative
decoding on the V1 runner its rejection sampler at the real draft count; their peak without that
temporary cache. Both model runners: V1 (``_dummy_run(force_attention, profile_seq_lens)``) and
Model Runner V2 of the releases whose ``_dummy_run`` can give GDN layers real metadata
(``_dummy_run(is_profile=True, valid_dummy_state_slots=True, context_len)``, vLLM 0.32.0+)."""

from __future__ import annotations

from typing import Any

from vllm_overlay import headroom
from vllm_overlay.errors import OverlayError
from vllm_overlay.patches import _runner
from vllm_overlay.patches._memory_meters import CudaMeter, RssMeter

V2_MODULE_UTILS = "vllm.v1.worker.gpu.cudagraph_utils"  # Model Runner V2's profiling KV cache helpers


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
    v2 = _runner.kind(runner) == "V2"
    if cpu or v2:  # V2: min(max_num_reqs, max_cudagraph_capture_size) blocks, one state slot each
        cc.max_cudagraph_capture_size = max(saved or 0, rows)
    elif saved is None:
        cc.max_cudagraph_capture_size = 0
    try:
        with set_current_vllm_config(runner.vllm_config):
            if v2:
                import importlib

                importlib.import_module(V2_MODULE_UTILS)._init_minimal_kv_cache_for_profiling(runner)
            else:
                runner._init_minimal_kv_cache_for_profiling()
    finally:
        cc.max_cudagraph_capture_size = saved


def _drop_temp_kv(runner: Any, keys: dict[Any, set[Any]], keys_initialized: bool) -> None:
    """Undo _init_temp_kv as vLLM undoes it after CUDA graph profiling, and put the graph
    dispatcher's keys back as they were (the real initialize_kv_cache sets them again). Model
    Runner V2: its own teardown (the KV cache, attention groups, graph manager and Mamba state it
    built; the real initialize_kv_cache builds them again)."""
    if _runner.kind(runner) == "V2":
        import importlib

        importlib.import_module(V2_MODULE_UTILS)._teardown_profiling_state(runner)
        return
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


def _forward_v2(runner: Any, shape: headroom.Shape) -> None:
    """One eager dummy forward of Model Runner V2 with attention metadata for every layer: its
    ``_dummy_run`` splits ``shape.tokens`` over ``runner.max_num_reqs`` requests (set for the call);
    ``is_profile`` makes it eager and routes the tokens to experts, ``valid_dummy_state_slots``
    gives the GDN layers real metadata on their own state slots (1 .. requests) instead of their
    warm-up path, and ``context_len`` (cached context, vLLM clamps it to max_model_len - the
    query) puts each request at ``shape.seq_len`` tokens. Inside ``_runner.measuring()``, so the
    cap of vLLM's own profiling forward leaves it whole."""
    saved = runner.max_num_reqs
    context = (shape.seq_len - shape.largest_request) if shape.seq_len else 0
    runner.max_num_reqs = shape.num_reqs
    try:
        with _runner.measuring():
            out = runner._dummy_run(shape.tokens, skip_attn=False, is_profile=True, skip_eplb=True,
                                    context_len=max(0, context), valid_dummy_state_slots=True)
    finally:
        runner.max_num_reqs = saved
    del out


def v2_shapes(tokens: int, max_num_seqs: int, max_model_len: int) -> tuple[list[headroom.Shape], list[str]]:
    """Model Runner V2's forwards: those of headroom.forward_shapes with one request fewer than
    max_num_seqs (its dummy state slots are 1 .. requests, and vLLM's profiling cache has
    max_num_seqs blocks, block 0 included), without the mixed batch (V2's _dummy_run has none; the
    split's prefills take the same chunked GDN path per request)."""
    left_out: list[str] = []
    if max_num_seqs < 2:
        return [], [f"every forward: Model Runner V2's dummy state slots need max_num_seqs >= 2 (it is "
                    f"{max_num_seqs})"]
    shapes, left_out = headroom.forward_shapes(tokens, max_num_seqs - 1, max_model_len)
    for s in [s for s in shapes if s.mixed]:
        shapes.remove(s)
        left_out.append(f"{s.name}: Model Runner V2's _dummy_run has no mixed batch (its split's prefills "
                        "take the same per-request GDN path)")
    return shapes, left_out


def spec_sampler_shape(runner: Any, tokens: int) -> tuple[int, int] | None:
    """(requests, drafts per request) of the largest verify step of speculative decoding on the V1
    runner: num_speculative_tokens drafts per request, as many requests as max_num_seqs and
    max_num_batched_tokens allow (each takes 1 + drafts tokens); None without speculative decoding."""
    spec = getattr(runner, "speculative_config", None)
    k = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0
    if k < 1 or getattr(runner, "rejection_sampler", None) is None:
        return None
    n = min(int(runner.scheduler_config.max_num_seqs), max(1, tokens // (k + 1)))
    return n, k


class _Recorder:
    """Stands in for the V1 runner's rejection sampler during its ``_dummy_sampler_run``: vLLM
    calls it with one draft per request (``draft_token_ids = [[0] for _ in range(num_reqs)]``) and
    drops what it returns; it records each call's sampling metadata and whether draft
    probabilities were passed, and runs nothing (the calls are replayed at the real draft count
    once vLLM's one-draft logits are freed)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, bool, Any, int]] = []

    def __call__(self, metadata: Any, draft_probs: Any, logits: Any, sampling_metadata: Any,
                 *args: Any, **kwargs: Any) -> None:
        self.calls.append((sampling_metadata, draft_probs is not None, logits.dtype, int(logits.shape[-1])))


def _spec_sampler(runner: Any, n: int, k: int) -> dict[str, Any]:
    """vLLM's own dummy sampler run of the V1 runner (the sampler over ``n`` requests), then its
    rejection sampler called as that run calls it, but with ``k`` drafts per request: logits of
    n x (k + 1) rows (and draft probabilities of n x k rows where vLLM passes them)."""
    import torch
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    real = runner.rejection_sampler
    rec = _Recorder()
    hidden = torch.zeros(n, int(runner.model_config.get_hidden_size()), dtype=runner.dtype, device=runner.device)
    runner.rejection_sampler = rec
    try:
        out = runner._dummy_sampler_run(hidden)
    finally:
        runner.rejection_sampler = real
    del out, hidden
    if not rec.calls:
        raise RuntimeError("the V1 runner's _dummy_sampler_run did not call its rejection sampler")
    meta = SpecDecodeMetadata.make_dummy([[0] * k for _ in range(n)], runner.device)
    for sampling_metadata, probs, dtype, vocab in rec.calls:
        logits = torch.randn(n * (k + 1), vocab, device=runner.device, dtype=dtype)
        draft_probs = (torch.softmax(torch.rand(n * k, vocab, device=runner.device, dtype=torch.float32), dim=-1)
                       if probs else None)
        real(meta, draft_probs, logits, sampling_metadata)
        del logits, draft_probs
    return {"calls": len(rec.calls), "drafts": int(sum(meta.num_draft_tokens)), "rows": n * (k + 1)}


def measure(runner: Any, meter: CudaMeter | RssMeter, tokens: int) -> dict[str, Any]:
    """The absolute peak of prefill-shaped forwards of ``tokens`` tokens (headroom.forward_shapes),
    without the temporary KV cache they ran on, plus any non-torch memory they left behind."""
    import torch

    v2 = _runner.kind(runner) == "V2"
    if v2:
        keys, keys_initialized = {}, False
    else:
        dispatcher = runner.cudagraph_dispatcher
        keys = {mode: set(s) for mode, s in dispatcher.cudagraph_keys.items()}
        keys_initialized = dispatcher.keys_initialized
    meter.reset_peak()  # a meter that cannot measure here says so before any work
    meter.sync()
    non_torch_before = meter.non_torch()
    start = meter.current()
    out: dict[str, Any] = {"shapes": []}
    with torch.inference_mode():
        seqs, model_len = int(runner.scheduler_config.max_num_seqs), int(runner.model_config.max_model_len)
        shapes, out["left_out"] = (v2_shapes if v2 else headroom.forward_shapes)(tokens, seqs, model_len)
        sampler = None if v2 else spec_sampler_shape(runner, tokens)
        if v2 and getattr(runner, "speculator", None) is not None:
            out["left_out"].append("spec-decode sampler: Model Runner V2's profiling runs no rejection sampler "
                                   "and its dummy batches carry no drafts, so the verify step's sampler is not "
                                   "measured on V2")
        try:
            # V2: as many blocks as state slots 1 .. requests need (block 0 included)
            _init_temp_kv(runner, max((s.num_reqs + v2 for s in shapes), default=1))
            kv_bytes, kv_blocks, per_request = _kv_facts(runner)
            peak = 0
            for shape in shapes:
                meter.reset_peak()
                before = meter.current()
                try:
                    (_forward_v2 if v2 else _forward)(runner, shape)
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
                # a peak is never below the level the call started from (the resident-set meter's
                # VmHWM and VmRSS are kept per thread and can disagree by some pages)
                p = max(meter.peak(), before)
                peak = max(peak, p)
                out["shapes"].append({"name": shape.name, "num_reqs": shape.num_reqs, "seq_len": shape.seq_len,
                                      "mixed": shape.mixed, "before": before, "peak": p,
                                      "peak_without_kv": p - kv_bytes})
            if sampler is not None and out["shapes"]:
                n, k = sampler
                name = f"spec-decode sampler: {n} requests x {k} drafts (num_speculative_tokens)"
                meter.reset_peak()
                before = meter.current()
                try:
                    facts = _spec_sampler(runner, n, k)
                    meter.sync()
                except Exception as exc:
                    if is_oom(exc) or isinstance(exc, OverlayError):
                        raise
                    meter.sync()
                    out["left_out"].append(f"{name}: the sampler failed ({type(exc).__name__}: {str(exc)[:300]})")
                else:
                    p = max(meter.peak(), before)
                    peak = max(peak, p)
                    out["shapes"].append({"name": name, "num_reqs": n, "seq_len": None, "mixed": False,
                                          "drafts_per_request": k, **facts, "before": before, "peak": p,
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
