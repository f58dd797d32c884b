"""turboquant-spec-decode: speculative-decoding verify batches run as decode on a TurboQuant KV
cache (vLLM 0.20.x), so TurboQuant + MTP boots and serves under full CUDA graphs.

vLLM 0.20.2's TurboQuant backend declares ``supports_spec_as_decode=False`` and its metadata sets
``is_prefill = max_query_len > 1``. A verify batch (1 + k query tokens per request: the last
accepted token and k drafts) is therefore a "prefill": ``_prefill_attention`` runs a Python loop
over the requests that reads ``query_start_loc.tolist()``. With speculative decoding the model
runner captures full CUDA graphs for uniform batches of 1 + k tokens per request, and that host
copy inside a capture kills the server at boot ("Cannot copy between CPU and CUDA tensors during
CUDA graph capture"). vLLM 0.33 reads CPU copies of ``query_start_loc`` and ``seq_lens`` there
instead: that avoids the error, but (read from its source, not run) the loop then slices its
per-row lengths on the host (``_arange_cache[cached_len + 1 : seq_len + 1]``), so a captured graph
would replay the capture's lengths; the backend still declares ``supports_spec_as_decode=False``.

This patch wraps two methods. ``TurboQuantMetadataBuilder.build`` decides, from the CPU copy of
the query lengths (no device sync), whether the batch is a uniform verify batch: every request has
the same q_len = 1 + k with 1 <= k <= num_speculative_tokens (padding requests of q_len 0, as a
padded CUDA-graph batch has them, are allowed). Such a batch is marked on its metadata.
``TurboQuantAttentionImpl.forward`` sends a marked batch to vllm-overlay's multi-query GQA
TurboQuant kernel (``vllm_overlay.kernels.tq_verify``): one launch for the whole batch, lengths
read on the device, causal within each request's query tokens, capturable and replayable with
other lengths. Every other batch (decode with q_len 1, prefill, mixed, q_len above
1 + num_speculative_tokens) takes vLLM's own path unchanged. Without a speculative config the
patch stands aside (nothing is marked).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from vllm_overlay.report import LOG, STATE
from vllm_overlay.spec import PatchSpec, Proof, Support, Target

MODULE = "vllm.v1.attention.backends.turboquant_attn"
BUILD = "TurboQuantMetadataBuilder.build"
FORWARD = "TurboQuantAttentionImpl.forward"
MARK = "vllm_overlay_verify_q_len"  # attribute set on TurboQuantMetadata
# KV splits per (request, kv head): aim at ~4 programs per SM of an H200 (132 SMs) when few requests
# run, at most MAX_KV_SPLITS. The kernel's split buffer is its own (allocated per call, from the
# graph pool under capture), so vLLM's tq_max_kv_splits_for_cuda_graph (32, sized for its own
# preallocated buffers) does not bound it; rows x splits stays ~constant: the buffer stays small.
SPLIT_TARGET_PROGRAMS = 512
MAX_KV_SPLITS = 128

TQ_ATTN = "v1/attention/backends/turboquant_attn.py"
_FORWARD_ARGS = ("layer", "query", "key", "value", "kv_cache", "attn_metadata", "output",
                 "output_scale", "output_block_scale")

SPEC = PatchSpec(
    id="turboquant-spec-decode",
    title="Speculative-decoding verify batches as decode on a TurboQuant KV cache (vLLM 0.20.x)",
    why=" ".join(" ".join(__doc__.split("\n\n")[1:3]).split()),
    upstream=("https://github.com/vllm-project/vllm/blob/v0.20.2/"
              "vllm/v1/attention/backends/turboquant_attn.py"),
    targets=(
        Target(MODULE, BUILD, wrapper="_build", params=("common_attn_metadata",)),
        Target(MODULE, FORWARD, wrapper="_forward",
               params=("layer", "query", "kv_cache", "attn_metadata", "output")),
    ),
    mechanism="wrap",
    support=(
        Support(">=0.20.0,<=0.20.2", "applies",
                "the TurboQuant backend (same source in 0.20.0-0.20.2) runs verify batches as prefills "
                "and its prefill loop copies query_start_loc to the host inside CUDA graph capture; "
                "the overlay's kernel reads the slot layout of this release's store kernel (checked "
                "against 0.20.2's, byte for byte, under Triton's interpreter)",
                (Proof(TQ_ATTN, "supports_spec_as_decode=False"),
                 Proof(TQ_ATTN, "qsl = query_start_loc.tolist()"),
                 Proof(TQ_ATTN, "query_start_loc_cpu", present=False),
                 Proof(TQ_ATTN, "def _ensure_on_device"),
                 Proof("v1/attention/ops/triton_turboquant_decode.py", "def _use_fp8_e4b15("))),
        Support(">=0.22.0,<=0.33.0", "unsupported",
                "not checked on this release: its TurboQuant backend changed (the prefill loop reads "
                "query_start_loc_cpu, so 0.20.x's capture error is gone, but verify batches still run "
                "as prefills: supports_spec_as_decode=False); the wrappers and the kernel's slot "
                "layout were checked against 0.20.2 only",
                (Proof(TQ_ATTN, "qsl = attn_metadata.query_start_loc_cpu.tolist()"),
                 Proof(TQ_ATTN, "supports_spec_as_decode=False"))),
    ),
    default=True,
    retire_when=("vLLM's TurboQuant backend runs verify batches as decode under full CUDA graphs "
                 "(supports_spec_as_decode=True with a multi-query kernel); 0.33.0 does not yet."),
    platforms=("cuda",),
)

_FIRST = threading.Event()


# ---- the dispatch decision (pure) ---------------------------------------------------------------


def verify_query_len(query_lens: Sequence[int], num_speculative_tokens: int | None) -> int | None:
    """The q_len with which a batch runs as a verify-as-decode batch, or None for vLLM's own path.

    A verify batch: every request with a query has the same q_len = 1 + k, 1 <= k <=
    num_speculative_tokens; requests with q_len 0 are padding. ``query_lens`` are per request.
    """
    if num_speculative_tokens is None or num_speculative_tokens < 1:
        return None
    seen = 0
    for n in query_lens:
        if n < 0:
            raise ValueError(f"verify_query_len: query_lens has {n}, expected lengths >= 0")
        if n == 0:
            continue
        if seen and n != seen:
            return None
        seen = n
    return seen if 2 <= seen <= 1 + num_speculative_tokens else None


def kv_splits(num_requests: int, num_kv_heads: int, max_splits: int = MAX_KV_SPLITS) -> int:
    """KV splits per (request, kv head): enough programs to fill the GPU, at most ``max_splits``.

    A host int fixed per captured batch size (each CUDA graph keeps a constant grid), rounded down
    to a power of two so that the batch sizes of a capture compile a handful of kernel variants.
    """
    if num_requests < 0 or num_kv_heads < 1 or max_splits < 1:
        raise ValueError(f"kv_splits: num_requests={num_requests}, num_kv_heads={num_kv_heads}, "
                         f"max_splits={max_splits}; expected >= 0, >= 1, >= 1")
    want = -(-SPLIT_TARGET_PROGRAMS // max(1, num_requests * num_kv_heads))
    return max(1, min(max_splits, 1 << (want.bit_length() - 1)))


def _num_speculative_tokens(builder: Any) -> int | None:
    cached = builder.__dict__.get("_vllm_overlay_spec_tokens", -1)
    if cached != -1:
        return cached
    spec = getattr(builder.vllm_config, "speculative_config", None)
    k = getattr(spec, "num_speculative_tokens", None) if spec is not None else None
    k = int(k) if k else None
    builder.__dict__["_vllm_overlay_spec_tokens"] = k
    msg = (f"turboquant-spec-decode: verify batches of q_len 2..{1 + k} run as decode on the "
           "TurboQuant cache (vllm-overlay multi-query kernel)" if k else
           "turboquant-spec-decode: no speculative decoding configured: TurboQuant batches take "
           "vLLM's path")
    LOG.info(msg)
    STATE.event(msg)
    return k


# ---- wrappers -----------------------------------------------------------------------------------


def _build(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    meta = wrapped(*args, **kwargs)
    k = _num_speculative_tokens(instance)
    if not k:
        return meta
    cam = kwargs.get("common_attn_metadata", args[1] if len(args) > 1 else None)
    q_len = None
    if cam is not None and 1 < int(cam.max_query_len) <= 1 + k:
        starts = cam.query_start_loc_cpu  # a CPU tensor: no device sync
        q_len = verify_query_len((starts[1:] - starts[:-1]).tolist(), k)
    setattr(meta, MARK, q_len)
    if q_len:
        STATE.count("tq_verify_as_decode_batches")
    return meta


def _forward(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    bound = dict(zip(_FORWARD_ARGS, args))
    bound.update(kwargs)
    meta = bound.get("attn_metadata")
    q_len = getattr(meta, MARK, None) if meta is not None else None
    if not q_len:
        return wrapped(*args, **kwargs)
    return verify_forward(instance, bound, meta, q_len)


def verify_forward(impl: Any, bound: dict[str, Any], meta: Any, q_len: int) -> Any:
    """TurboQuantAttentionImpl.forward for a marked verify batch (K/V already in the cache)."""
    import torch

    from vllm.v1.attention.ops.triton_turboquant_decode import _use_fp8_e4b15

    from vllm_overlay.kernels.tq_verify import tq_verify_attention

    layer, query, kv_cache = bound["layer"], bound["query"], bound["kv_cache"]
    output = bound.get("output")
    if output is None:
        output = torch.zeros(query.shape[0], impl.num_heads * impl.head_size, dtype=query.dtype,
                             device=query.device)
    n = int(meta.num_actual_tokens)
    if n <= 0:
        return output.fill_(0)
    q = query[:n].view(n, impl.num_heads, impl.head_size)
    impl._ensure_on_device(layer, q.device)
    cfg = impl.tq_config
    reqs = meta.query_start_loc.shape[0] - 1
    out = tq_verify_attention(
        q, kv_cache, meta.block_table, meta.seq_lens, meta.query_start_loc,
        max_query_len=q_len, scale=impl.scale, key_fp8=cfg.key_fp8, key_mse_bits=cfg.key_mse_bits,
        key_packed_size=cfg.key_packed_size, value_quant_bits=cfg.effective_value_quant_bits,
        norm_correction=cfg.norm_correction, centroids=layer._tq_centroids, PiT=layer._tq_PiT,
        num_kv_splits=kv_splits(reqs, kv_cache.shape[2]),
        fp8_e4b15=bool(_use_fp8_e4b15(q.device.index or 0)),
    )
    if output.ndim == 3:
        output[:n] = out.to(output.dtype)
    else:
        output[:n] = out.reshape(n, -1).to(output.dtype)
    if not _FIRST.is_set():
        _FIRST.set()
        msg = (f"turboquant-spec-decode: first verify batch sent to the multi-query kernel ({reqs} "
               f"requests x q_len {q_len}, {kv_cache.shape[2]} kv heads; a warm-up or capture counts)")
        LOG.info(msg)
        STATE.event(msg)
    return output

