"""turboquant-spec-decode: speculative-decoding verify batches run as decode on a TurboQuant KV
cache, so TurboQuant + MTP boots and serves right under full CUDA graphs (vLLM 0.20.0-0.33.0).

In every release of the matrix the TurboQuant backend declares ``supports_spec_as_decode=False``
and sets ``is_prefill = max_query_len > 1``, so a verify batch (1 + k query tokens per request: the
last accepted token and k drafts) is a "prefill": ``_prefill_attention`` runs a Python loop over the
requests with host-side lengths. Its builder declares ``AttentionCGSupport.UNIFORM_BATCH``, so with
speculative decoding the model runner (V1; Model Runner V2, vLLM's default from 0.29.0, alike)
captures full CUDA graphs for uniform batches of 1 + k tokens per request, with that loop inside.
On 0.20.0-0.20.2 the loop reads ``query_start_loc.tolist()``: the host copy inside the capture
kills the server at boot ("Cannot copy between CPU and CUDA tensors during CUDA graph capture").
On 0.22.0-0.33.0 it reads the CPU copies ``query_start_loc_cpu`` and ``seq_lens_cpu_upper_bound``:
the capture succeeds, with the capture batch's lengths, where every dummy request has seq_len ==
q_len (both runners), so the graph records FlashAttention over each request's own 1 + k new tokens.
Replayed for real verify batches, those tokens never attend to their cached context in the
full-attention layers: wrong logits, silently (read from the sources, not run). Outside a graph
the loop goes wrong too once drafts are rejected: with async scheduling (the default with MTP)
``seq_lens_cpu_upper_bound`` assumes every draft of the previous step was accepted.

This patch wraps two methods. ``TurboQuantMetadataBuilder.build`` decides, from the CPU copy of
the query lengths (no device sync), whether the batch is a uniform verify batch: every request has
the same q_len = 1 + k with 1 <= k <= num_speculative_tokens (padding requests of q_len 0, as a
padded CUDA-graph batch has them, are allowed). Such a batch is marked on its metadata.
``TurboQuantAttentionImpl.forward`` sends a marked batch to vllm-overlay's multi-query GQA
TurboQuant kernel (``vllm_overlay.kernels.tq_verify``): one launch for the whole batch, lengths
read on the device, causal within each request's query tokens, capturable and replayable with
other lengths. Every other batch (decode with q_len 1, prefill, mixed, q_len above
1 + num_speculative_tokens) takes vLLM's own path, with one change from 0.22.0: when such a batch
holds rows that can be verify rows and async scheduling is on, its ``seq_lens_cpu`` gets the exact
lengths (one host copy) in place of vLLM's upper bound, which assumes every draft was accepted
(``_exact_seq_lens``). Without a speculative config the patch stands aside (nothing is marked).
(turboquant-prefill-continuation keeps such batches off the backend's no-cache fast path.)

The backend's source, by sha256 of turboquant_attn.py: 0.20.0-0.20.2; 0.22.0-0.23.0 (the CPU
copies); 0.24.0-0.25.1 (+ a workspace reservation); 0.26.0 (the cache becomes head-major,
(num_blocks, kv heads, block_size, slot), and forward transposes it to (blocks, positions, heads,
slot) before every kernel: so does this patch's forward wrapper from 0.26.0); 0.27.0-0.27.1 (a
type annotation); 0.28.0 (an SoA slot layout with FlyDSL decode, only on ROCm gfx950: the kernel
here does not read it, so the wrapper then stands aside with a warning); 0.29.0-0.30.0 (the
KVCacheLayout LBNHC); 0.31.0-0.32.0 (get_supported_kernel_block_sizes' signature); 0.33.0 (FlyDSL
eligibility). The wrapped signatures are the same in all; the file's prefill loop is the same from
0.22.0 (but for the SoA branch). The store kernel writes the same slot in every release, in two file versions
(0.20.0-0.25.1; 0.26.0-0.33.0 casts keys to fp32 before FP8 and takes the strided cache), each
checked byte for byte under Triton's interpreter (tests/interpreted/check_tq_verify_kernel.py).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from vllm_overlay.report import LOG, STATE
from vllm_overlay.spec import PatchSpec, Proof, Support, Target, why_from, wraps

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
TQ_STORE = "v1/attention/ops/triton_turboquant_store.py"
V1_RUNNER = "v1/worker/gpu_model_runner.py"
V2_DUMMY = "v1/worker/gpu/input_batch.py"
HEAD_MAJOR_FROM = "0.26.0"  # forward transposes kv_cache (num_blocks, heads, positions, slot) from here on
_FORWARD_ARGS = ("layer", "query", "key", "value", "kv_cache", "attn_metadata", "output",
                 "output_scale", "output_block_scale")
_FORWARD_PARAMS = ("layer", "query", "kv_cache", "attn_metadata", "output")

_TRANSPOSE = "kv_cache = kv_cache.transpose(1, 2)"  # vLLM's forward and store, head-major cache

# what every supported release shares: verify batches are prefills of a backend whose builder
# allows full graphs for uniform batches; both runners capture them with seq_len == q_len; the
# store kernel writes the k8v4 slot [FP8 key | 4-bit values | fp16 scale | fp16 zero]
_BACKEND = (
    Proof(TQ_ATTN, "self._init_reorder_batch_threshold(1, supports_spec_as_decode=False)"),
    Proof(TQ_ATTN, "is_prefill=(cam.max_query_len > 1),"),
    Proof(TQ_ATTN, "_cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH"),
    Proof(TQ_ATTN, "attn_metadata = self.build(0, common_attn_metadata)"),
    Proof(TQ_ATTN, "def _ensure_on_device(self, layer, device):"),
    Proof(V2_DUMMY, "# seq_len equals to query_len"),
    Proof(TQ_STORE, "tl.store(KV_cache_ptr + slot_base + d_offs, k_bytes, mask=d_mask)"),
    Proof(TQ_STORE, "val_cache_offset = KPS"),
    Proof(TQ_STORE, "sc_offset = val_cache_offset + VAL_DATA_BYTES"),
    Proof("v1/attention/ops/triton_turboquant_decode.py", "def _use_fp8_e4b15(device: int = 0) -> int:"),
)
_COMMON = _BACKEND + (Proof(V1_RUNNER, "seq_lens = max_query_len  # type: ignore[assignment]"),)  # up to 0.33.0
# 0.22.0 on: the prefill loop's host lengths come from CPU copies (no capture error: wrong replays)
_CPU_COPIES = (
    Proof(TQ_ATTN, "qsl = attn_metadata.query_start_loc_cpu.tolist()"),
    Proof(TQ_ATTN, "seq_lens_cpu=cam.seq_lens_cpu_upper_bound,"),
    Proof(TQ_ATTN, "if q_len == seq_len:"),
    # what _exact_seq_lens replaces is what the loop and the mixed path read
    Proof(TQ_ATTN, "seq_lens_list = attn_metadata.seq_lens_cpu.tolist()"),
    Proof(TQ_ATTN, "seq_lens_cpu=attn_metadata.seq_lens_cpu[num_decodes:]"),
)

BUILD_METADATA = Target(MODULE, BUILD, params=("common_attn_metadata",))
FORWARD_SLOT_MAJOR = Target(MODULE, FORWARD, f"<{HEAD_MAJOR_FROM}", params=_FORWARD_PARAMS)
FORWARD_HEAD_MAJOR = Target(MODULE, FORWARD, f">={HEAD_MAJOR_FROM}", params=_FORWARD_PARAMS)

SPEC = PatchSpec(
    id="turboquant-spec-decode",
    title="Speculative-decoding verify batches as decode on a TurboQuant KV cache",
    why=why_from(__doc__),
    upstream=("https://github.com/vllm-project/vllm/blob/v0.33.0/"
              "vllm/v1/attention/backends/turboquant_attn.py"),
    targets=(BUILD_METADATA, FORWARD_SLOT_MAJOR, FORWARD_HEAD_MAJOR),
    mechanism="wrap",
    support=(
        Support(">=0.20.0,<=0.20.2", "applies",
                "verify batches are prefills (supports_spec_as_decode=False) captured in full CUDA graphs "
                "(UNIFORM_BATCH); the prefill loop copies query_start_loc to the host inside the capture: "
                "the server dies at boot; block-major cache; the store kernel's slots checked byte for "
                "byte under Triton's interpreter",
                _COMMON + (Proof(TQ_ATTN, "qsl = query_start_loc.tolist()"),
                           Proof(TQ_ATTN, "query_start_loc_cpu", present=False),
                           Proof(TQ_ATTN, _TRANSPOSE, present=False))),
        Support(">=0.22.0,<=0.25.1", "applies",
                "verify batches are prefills captured in full CUDA graphs, as on 0.20.x; the prefill loop "
                "reads CPU copies, so the capture succeeds with the dummy batch's seq_len == q_len: the "
                "graph runs FlashAttention over each request's own 1 + k tokens, and replayed verify "
                "batches never see their cached context (wrong logits, silently; read from the sources, "
                "not run); block-major cache, the store kernel of 0.20.2",
                _COMMON + _CPU_COPIES + (Proof(TQ_ATTN, _TRANSPOSE, present=False),)),
        Support(">=0.26.0,<=0.27.1", "applies",
                "as on 0.22.0-0.25.1 (the same prefill loop); the cache is head-major and the forward "
                "wrapper transposes it as vLLM's forward does; the store kernel's slots checked byte for "
                "byte (0.26.0's)",
                _COMMON + _CPU_COPIES + (Proof(TQ_ATTN, _TRANSPOSE),
                                         Proof(TQ_ATTN, "_soa_store", present=False))),
        Support(">=0.28.0,<=0.33.0", "applies",
                "as on 0.26.0-0.27.1; Model Runner V2, vLLM's default from 0.29.0, captures verify "
                "batches the same way; physical cache layout LBNHC from 0.29.0 (0.33.0's store kernel "
                "checked); an SoA cache (FlyDSL, ROCm gfx950 only) is left to vLLM with a warning",
                _COMMON + _CPU_COPIES + (Proof(TQ_ATTN, _TRANSPOSE),
                                         Proof(TQ_ATTN, "self._soa_store = self._use_flydsl"))),
        Support("==0.34.0", "applies",
                "as on 0.28.0-0.33.0 on Model Runner V2, the only runner left (V1 removed): the backend's "
                "UNIFORM_BATCH graph support, supports_spec_as_decode=False, is_prefill=(max_query_len > 1) "
                "and the prefill loop are unchanged, V2's dummy verify batch still has seq_len == q_len, and "
                "the store and decode kernels are 0.33.0's byte for byte",
                _BACKEND + _CPU_COPIES + (Proof(TQ_ATTN, _TRANSPOSE),
                                          Proof(TQ_ATTN, "self._soa_store = self._use_flydsl"),
                                          Proof("platforms/interface.py", "Model Runner V1 has been removed"))),
    ),
    default=True,
    retire_when=("vLLM's TurboQuant backend runs verify batches as decode under full CUDA graphs "
                 "(supports_spec_as_decode=True with a multi-query kernel); 0.33.0 does not yet."),
    shown_by=("tq_verify_as_decode_batches", "tq_exact_seq_lens_batches"),
    platforms=("cuda",),
    beyond_matrix="carry",
    beyond_matrix_why=("its proofs pin the TurboQuant backend's verify path, cache layout and store kernel that its "
                       "wrapper relies on; where they hold it is the wrap proven on the newest release, and without "
                       "it verify batches are silently wrong under full CUDA graphs"),
)

_FIRST = threading.Event()
_SOA = threading.Event()
_EXACT = threading.Event()


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


@wraps(BUILD_METADATA)
def _build(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    meta = wrapped(*args, **kwargs)
    k = _num_speculative_tokens(instance)
    if not k:
        return meta
    cam = kwargs.get("common_attn_metadata", args[1] if len(args) > 1 else None)
    q_len = None
    lens = None
    if cam is not None and 1 < int(cam.max_query_len) <= 1 + k:
        lens = _query_lens(cam)
        q_len = verify_query_len(lens, k)
    setattr(meta, MARK, q_len)
    if q_len:
        STATE.count("tq_verify_as_decode_batches")
    elif cam is not None:
        _exact_seq_lens(instance, cam, meta, k, lens)
    return meta


def _query_lens(cam: Any) -> list[int]:
    starts = cam.query_start_loc_cpu  # a CPU tensor: no device sync
    return (starts[1:] - starts[:-1]).tolist()


def _exact_seq_lens(builder: Any, cam: Any, meta: Any, k: int, lens: list[int] | None) -> None:
    """0.22.0+: a batch left to vLLM's prefill path reads ``seq_lens_cpu``, which the builder fills
    from ``seq_lens_cpu_upper_bound``: exact for prefill rows, but with async scheduling it assumes
    that every draft of a request's previous step was accepted (vLLM's own docstring: "not safe for
    kernels that need exact per-row context lengths on decode rows"). Verify rows of a mixed or
    prefill batch would then attend past their real context, to rejected drafts' slots. When such
    a batch holds a row that can be a verify row (2 <= q_len <= 1 + k), the exact lengths are
    copied to the host instead: one device sync for that step, outside any CUDA graph (these
    batches are not captured). Uniform verify batches do not need it: the kernel reads the device
    lengths."""
    if getattr(meta, "seq_lens_cpu", None) is None or not getattr(meta, "is_prefill", False):
        return  # 0.20.x (no CPU copy: vLLM reads the device lengths) or a decode batch
    sched = getattr(builder.vllm_config, "scheduler_config", None)
    if getattr(sched, "async_scheduling", None) is False:
        return  # without async scheduling the upper bound is exact (None, unresolved: copy anyway)
    if not any(2 <= n <= 1 + k for n in (lens if lens is not None else _query_lens(cam))):
        return  # lens: the query lengths _build already read, when it did
    import torch

    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return
    meta.seq_lens_cpu = cam.seq_lens.to("cpu")
    STATE.count("tq_exact_seq_lens_batches")
    if not _EXACT.is_set():
        _EXACT.set()
        msg = ("turboquant-spec-decode: a prefill or mixed batch with verify rows reads the exact "
               "sequence lengths (one host copy for such a step), not vLLM's upper bound that assumes "
               "every draft was accepted (counted in tq_exact_seq_lens_batches)")
        LOG.info(msg)
        STATE.event(msg)


@wraps(FORWARD_SLOT_MAJOR)
def _forward(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """TurboQuantAttentionImpl.forward up to 0.25.1: kv_cache is (num_blocks, block_size, heads, slot)."""
    return _route(wrapped, instance, args, kwargs, head_major=False)


@wraps(FORWARD_HEAD_MAJOR)
def _forward_head_major(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """TurboQuantAttentionImpl.forward from 0.26.0: kv_cache is (num_blocks, heads, block_size, slot),
    which vLLM's forward transposes to (num_blocks, block_size, heads, slot) for its kernels."""
    return _route(wrapped, instance, args, kwargs, head_major=True)


def _route(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *,
           head_major: bool) -> Any:
    bound = dict(zip(_FORWARD_ARGS, args))
    bound.update(kwargs)
    meta = bound.get("attn_metadata")
    q_len = getattr(meta, MARK, None) if meta is not None else None
    if not q_len:
        return wrapped(*args, **kwargs)
    if getattr(instance, "_soa_store", False):
        _soa_warning()
        return wrapped(*args, **kwargs)
    return verify_forward(instance, bound, meta, q_len, head_major=head_major)


def _soa_warning() -> None:
    STATE.count("tq_verify_soa_left_to_vllm")
    if _SOA.is_set():
        return
    _SOA.set()
    msg = ("turboquant-spec-decode: this TurboQuant cache uses the SoA slot layout (FlyDSL, ROCm gfx950), "
           "which the overlay's verify kernel does not read: verify batches take vLLM's prefill path, "
           "whose full CUDA graphs replay the capture's lengths; serve TurboQuant without speculative "
           "decoding on this device")
    LOG.warning(msg)
    STATE.event(msg)


def verify_forward(impl: Any, bound: dict[str, Any], meta: Any, q_len: int, *,
                   head_major: bool = False) -> Any:
    """TurboQuantAttentionImpl.forward for a marked verify batch (K/V already in the cache)."""
    import torch

    from vllm.v1.attention.ops.triton_turboquant_decode import _use_fp8_e4b15

    from vllm_overlay.kernels.tq_verify import tq_verify_attention

    layer, query, kv_cache = bound["layer"], bound["query"], bound["kv_cache"]
    if head_major:  # as vLLM's forward does from 0.26.0: the kernels index (block, position, head)
        kv_cache = kv_cache.transpose(1, 2)
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

