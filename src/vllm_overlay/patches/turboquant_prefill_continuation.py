"""turboquant-prefill-continuation: a TurboQuant prefill batch in which some request has cached
context never takes the backend's no-cache fast path (vLLM 0.20.0-0.33.0, CUDA).

``TurboQuantAttentionImpl._prefill_attention`` runs one FlashAttention call over the whole batch,
each request attending only to its own new tokens (``cu_seqlens_k = query_start_loc``), when
``max_query_len == max_seq_len``, taken to mean that no request has cached tokens. It does not
mean that: the longest request can be a fresh prompt (q_len == seq_len) while another request of
the same batch continues a prompt (a chunked-prefill chunk, a prefix-cache hit) or verifies drafts
(q_len 1 + k over its cached context). Those requests then attend to none of their cached context:
wrong attention in every full-attention layer, no error. Band traffic makes such batches: several
~2-3K prompts scheduled together with max_num_batched_tokens below their sum, so one is chunked
and its next chunk shares a step with a newer, longer prompt. Upstream: issue 46460, fix PR 46461,
both open; the fast path is unchanged in 0.33.0.

This patch wraps ``_prefill_attention``. When the fast-path condition holds, it reads every
request's query and sequence length (the metadata's CPU copies from 0.22.0; on 0.20.x the device
tensors, one host copy each, as vLLM's own loop there does) and, if any request has cached
context, passes vLLM's method a copy of the metadata whose ``max_seq_len`` is one above
``max_query_len``: vLLM's per-request loop then serves the batch, which attends fresh requests
to their own tokens and continuing ones to their cached context. Batches where every request is
fresh keep the fast path; nothing else changes. Attention is outside the compiled graph (a
splitting op) and prefill batches are not captured in full CUDA graphs (the builder supports
uniform batches only), so the test runs on every such call.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

from vllm_overlay.mechanisms import wrap
from vllm_overlay.report import LOG, STATE
from vllm_overlay.spec import PatchSpec, Proof, Support, Target, why_from, wraps

MODULE = "vllm.v1.attention.backends.turboquant_attn"
METHOD = "TurboQuantAttentionImpl._prefill_attention"
TQ_ATTN = "v1/attention/backends/turboquant_attn.py"
_ARGS = ("query", "key", "value", "kv_cache", "attn_metadata", "Pi", "centroids", "PiT", "layer")
FAST_PATH = "if _HAS_FLASH_ATTN and attn_metadata.max_query_len == attn_metadata.max_seq_len:"

_COMMON = (
    Proof(TQ_ATTN, FAST_PATH),
    Proof(TQ_ATTN, "cu_seqlens_k=attn_metadata.query_start_loc,"),
    Proof(TQ_ATTN, "if q_len == seq_len:"),  # the loop serves fresh requests on their own
    Proof(TQ_ATTN, "attn_metadata: TurboQuantMetadata,"),
    Proof(TQ_ATTN, "@dataclass\nclass TurboQuantMetadata"),  # dataclasses.replace makes the copy
    Proof(TQ_ATTN, "max_seq_len: int = 0"),  # ... with this field set
)

PREFILL_ATTENTION = Target(MODULE, METHOD, params=("attn_metadata",))

SPEC = PatchSpec(
    id="turboquant-prefill-continuation",
    hooks=("on_revert",),
    title="TurboQuant prefill batches with cached context never take the no-cache fast path",
    why=why_from(__doc__),
    upstream="https://github.com/vllm-project/vllm/issues/46460",
    targets=(PREFILL_ATTENTION,),
    mechanism="wrap",
    support=(
        Support(">=0.20.0,<=0.20.2", "applies",
                "the fast path runs when max_query_len == max_seq_len, with cu_seqlens_k = "
                "query_start_loc; the per-request loop reads the device lengths (.tolist()), so the "
                "patch reads them the same way, only when the fast-path condition holds",
                _COMMON + (Proof(TQ_ATTN, "qsl = query_start_loc.tolist()"),)),
        Support(">=0.22.0,<=0.34.0", "applies",
                "the same fast path; the metadata carries CPU copies of the query starts and "
                "sequence lengths, which the patch reads (no device sync)",
                _COMMON + (Proof(TQ_ATTN, "qsl = attn_metadata.query_start_loc_cpu.tolist()"),
                           Proof(TQ_ATTN, "seq_lens_list = attn_metadata.seq_lens_cpu.tolist()"))),
    ),
    default=True,
    retire_when=("vLLM's TurboQuant fast path checks every request for cached context (PR 46461 or "
                 "equivalent merged); 0.33.0 does not."),
    shown_by=("tq_prefill_fast_path_avoided",),
    platforms=("cuda",),
    beyond_matrix="carry",
    beyond_matrix_why=("its proofs pin the fast path's condition and the metadata it reads; where they hold it only "
                       "routes a batch with cached context away from a fast path that ignores that context"),
)

_FIRST = threading.Event()


def continuation_rows(query_lens: Sequence[int], seq_lens: Sequence[int]) -> list[int]:
    """Requests with cached context: q_len > 0 and seq_len != q_len (padding rows, q_len 0, are
    skipped; a sequence length below its query length is reported too, it cannot be a fresh
    prompt either)."""
    return [i for i, (q, s) in enumerate(zip(query_lens, seq_lens)) if q > 0 and s != q]


def _lengths(meta: Any) -> tuple[list[int], list[int]] | None:
    qsl = getattr(meta, "query_start_loc_cpu", None)
    seq = getattr(meta, "seq_lens_cpu", None)
    if qsl is None or seq is None:  # 0.20.x: device tensors, a host copy (none inside a capture)
        import torch

        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return None
        qsl = meta.query_start_loc if qsl is None else qsl
        seq = meta.seq_lens if seq is None else seq
    starts = [int(x) for x in qsl.tolist()]
    return [b - a for a, b in zip(starts, starts[1:])], [int(x) for x in seq.tolist()]


@wraps(PREFILL_ATTENTION)
def _prefill_attention(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    meta = wrap.argument(_ARGS, "attn_metadata", args, kwargs)
    if meta is None or meta.max_query_len != meta.max_seq_len:
        return wrapped(*args, **kwargs)  # vLLM's own decision is already the loop
    lengths = _lengths(meta)
    rows = continuation_rows(*lengths) if lengths is not None else []
    if not rows:
        return wrapped(*args, **kwargs)  # every request fresh: the fast path is right
    safe = dataclasses.replace(meta, max_seq_len=int(meta.max_query_len) + 1)
    STATE.count("tq_prefill_fast_path_avoided")
    if not _FIRST.is_set():
        _FIRST.set()
        msg = (f"turboquant-prefill-continuation: a prefill batch of {len(lengths[0])} requests had "
               f"max_query_len == max_seq_len == {meta.max_query_len} while {len(rows)} of them have "
               "cached context: vLLM's per-request loop serves it, not the no-cache fast path (counted "
               "in tq_prefill_fast_path_avoided from here on)")
        LOG.info(msg)
        STATE.event(msg)
    args, kwargs = wrap.with_argument(_ARGS, "attn_metadata", safe, args, kwargs)
    return wrapped(*args, **kwargs)


def on_revert() -> None:
    _FIRST.clear()
