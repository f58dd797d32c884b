"""The arithmetic of memory-headroom, pure (no vLLM, no torch): how much memory a measured forward
needs beyond what vLLM's profiling reserved, and what taking it from the KV cache leaves.

All sizes are bytes, in one meter per platform: on CUDA the caching allocator's allocated bytes
(``torch.cuda.max_memory_allocated``), on the CPU build the process's resident set (VmRSS / VmHWM).

- ``baseline``: in use when vLLM's profiling forward began (CUDA), or the resident set vLLM
  counted as consumed when no profiling forward ran (CPU worker, eager);
- ``reserved``: the absolute peak vLLM's KV sizing covers: the allocator peak when its profiling
  forward returned (CUDA), or the resident set it subtracted from the requested memory (CPU);
- ``measured``: the absolute peak of the forward of ``tokens`` tokens with real attention metadata,
  with the temporary KV cache it ran on taken out, plus any non-torch memory that forward added.

Profiled peak = reserved - baseline, measured peak = measured - baseline; the shortfall
(measured - reserved, never negative) is taken from the KV cache.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

GIB = float(1 << 30)
MIB = float(1 << 20)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Shape:
    """One dummy forward of ``tokens`` tokens over ``num_reqs`` requests.

    Split as vLLM's ``_dummy_run`` splits it: equal parts with the remainder on the last request, or,
    with ``mixed`` (its ``create_mixed_batch``), ``num_reqs - 1`` one-token decodes followed by one
    prefill of the rest. ``context`` is every request's sequence length (cached context plus its
    own tokens) passed as ``profile_seq_lens``; None: vLLM's own (each request's tokens, a mixed
    batch's prefill its tokens plus one)."""

    name: str
    tokens: int
    num_reqs: int
    context: int | None = None
    mixed: bool = False

    @property
    def largest_request(self) -> int:
        if self.mixed:
            return self.tokens - (self.num_reqs - 1)
        return self.tokens // self.num_reqs + self.tokens % self.num_reqs

    @property
    def seq_len(self) -> int | None:
        """``profile_seq_lens`` for the forward (None for a mixed batch: vLLM sets its own)."""
        if self.mixed:
            return self.context
        return self.context if self.context is not None else self.largest_request


TAIL_TOKENS = 129  # the shortest chunk vLLM's TurboQuant backend prefills over its dequantized cache:
# it decodes chunks of up to _CONTINUATION_DECODE_THRESHOLD = 128 tokens (0.20.0-0.33.0)


def forward_shapes(tokens: int, max_num_seqs: int, max_model_len: int) -> tuple[list[Shape], list[str]]:
    """The forwards of ``tokens`` tokens to measure, and why any was left out.

    1. The longest prefill: the fewest requests that fit in max_model_len (one when tokens <=
       max_model_len), each at the context of max_model_len, i.e. the last chunk of the longest
       prompt a server accepts: attention workspaces that grow with the cached context (e.g.
       TurboQuant's dequantized continuation K/V, kept per layer in vLLM 0.20.x) are measured.
       Then its tail: one chunk of TAIL_TOKENS at that context, the most cached context a chunk
       can follow (a busy step gives a long prompt's chunks fewer tokens than max_num_batched_tokens).
    2. vLLM's own profiling split into min(tokens, max_num_seqs) prefills: the most requests, so
       the most GDN chunks and the most per-request recurrent states (each prefill gathers its
       state, and the chunked kernel returns a float32 final state per request).
    3. vLLM's mixed batch: min(max_num_seqs - 1, tokens // 2) one-token decodes and one prefill of
       the rest, the step of a busy server when a prompt arrives: the decodes join the prefill's
       chunked GDN path, one more chunk each.

    Requests share the temporary cache's blocks (the dummy block table's rows are zero): the
    forwards compute nothing that is kept, only their memory is read."""
    for name, v in (("tokens", tokens), ("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len)):
        if v < 1:
            raise ValueError(f"forward_shapes: {name}={v}: expected a positive integer")
    shapes: list[Shape] = []
    left_out: list[str] = []
    n = min(max_num_seqs, cdiv(tokens, max_model_len))
    while n < min(tokens, max_num_seqs) and Shape("", tokens, n).largest_request > max_model_len:
        n += 1
    long = Shape(("longest prefill" if n == 1 else f"{n} prefills of up to max_model_len")
                 + f" at context {max_model_len}", tokens, n, context=max_model_len)
    if long.largest_request > max_model_len:
        left_out.append(f"{long.name}: a request of {long.largest_request} tokens exceeds max_model_len "
                        f"{max_model_len} with max_num_seqs {max_num_seqs}")
    else:
        shapes.append(long)
        q = min(tokens, TAIL_TOKENS)
        if q < long.largest_request:
            shapes.append(Shape(f"tail chunk of {q} tokens at context {max_model_len}", q, 1, context=max_model_len))
    full = min(tokens, max_num_seqs)
    split = Shape(f"{full} prefills (vLLM's profiling split)", tokens, full)
    if full != long.num_reqs:
        if split.largest_request > max_model_len:
            left_out.append(f"{split.name}: a request of {split.largest_request} tokens exceeds max_model_len "
                            f"{max_model_len}")
        else:
            shapes.append(split)
    decodes = min(max_num_seqs - 1, tokens // 2)
    if decodes >= 1:
        mixed = Shape(f"{decodes} decodes + 1 prefill (vLLM's mixed batch)", tokens, decodes + 1, mixed=True)
        if mixed.largest_request + 1 > max_model_len:
            left_out.append(f"{mixed.name}: its prefill of {mixed.largest_request} tokens exceeds max_model_len "
                            f"{max_model_len}")
        else:
            shapes.append(mixed)
    return shapes, left_out


@dataclass(frozen=True)
class Plan:
    """What memory-headroom does to one worker's KV budget (every field in bytes unless named)."""

    tokens: int  # the forward measured: max_num_batched_tokens (the runner's max_num_tokens)
    baseline: int
    reserved: int
    measured: int
    available_before: int  # the KV cache budget vLLM computed
    bytes_per_block: int  # one KV block across every KV tensor of the model
    blocks_per_request: int  # KV blocks one request of max_model_len takes, every KV group summed
    max_model_len: int
    moved: int  # taken from the KV budget (the shortfall)
    available_after: int
    blocks_before: int
    blocks_after: int
    kv_tokens_before: int
    kv_tokens_after: int

    @property
    def profiled_peak(self) -> int:
        return self.reserved - self.baseline

    @property
    def measured_peak(self) -> int:
        return self.measured - self.baseline

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["profiled_peak"] = self.profiled_peak
        out["measured_peak"] = self.measured_peak
        return out

    def line(self, dry_run: bool = False) -> str:
        """The one log line (identifiers whole; sizes in GiB with bytes where they decide). A dry run
        (VLLM_OVERLAY_MEMORY_HEADROOM_DRY_RUN=1) says what it would move and that the KV cache stays
        as vLLM sized it."""
        if dry_run:
            what = (f"would move {self.moved / GIB:.3f} GiB ({self.moved} bytes) from the KV cache to "
                    "activations; DRY RUN (VLLM_OVERLAY_MEMORY_HEADROOM_DRY_RUN=1): nothing moved, UNSAFE"
                    if self.moved else "nothing to move (the profiled peak covers it); dry run")
            return (f"memory-headroom: profiled peak {self.profiled_peak / GIB:.3f} GiB, measured peak at "
                    f"{self.tokens} tokens {self.measured_peak / GIB:.3f} GiB; {what}; KV cache stays "
                    f"{self.available_before / GIB:.3f} GiB, {self.blocks_before} blocks, "
                    f"{self.kv_tokens_before} KV tokens (corrected: {self.available_after / GIB:.3f} GiB, "
                    f"{self.blocks_after} blocks, {self.kv_tokens_after} KV tokens)")
        what = (f"moved {self.moved / GIB:.3f} GiB ({self.moved} bytes) from the KV cache to activations"
                if self.moved else "nothing moved (the profiled peak covers it)")
        return (f"memory-headroom: profiled peak {self.profiled_peak / GIB:.3f} GiB, measured peak at "
                f"{self.tokens} tokens {self.measured_peak / GIB:.3f} GiB; {what}; KV cache "
                f"{self.available_before / GIB:.3f} -> {self.available_after / GIB:.3f} GiB, "
                f"{self.blocks_before} -> {self.blocks_after} blocks, "
                f"{self.kv_tokens_before} -> {self.kv_tokens_after} KV tokens")


def kv_tokens(blocks: int, blocks_per_request: int, max_model_len: int) -> int:
    """Tokens of context the KV cache holds, as vLLM prints it ('KV cache size: N tokens'):
    max_model_len x the requests of max_model_len that fit (blocks / blocks_per_request, where a
    hybrid model's request takes its attention blocks plus one state block per GDN group)."""
    return int(blocks / blocks_per_request * max_model_len)


def plan(*, tokens: int, baseline: int, reserved: int, measured: int, available_before: int,
         bytes_per_block: int, blocks_per_request: int, max_model_len: int) -> Plan:
    """The shortfall and what is left for the KV cache. Blocks are whole (floor), as vLLM sizes
    them from the budget."""
    for name, v in (("tokens", tokens), ("bytes_per_block", bytes_per_block),
                    ("blocks_per_request", blocks_per_request), ("max_model_len", max_model_len)):
        if v < 1:
            raise ValueError(f"headroom.plan: {name}={v}: expected a positive integer")
    moved = max(0, measured - reserved)
    after = available_before - moved
    blocks_before = max(0, available_before) // bytes_per_block
    blocks_after = max(0, after) // bytes_per_block
    return Plan(tokens=tokens, baseline=baseline, reserved=reserved, measured=measured,
                available_before=available_before, bytes_per_block=bytes_per_block,
                blocks_per_request=blocks_per_request, max_model_len=max_model_len, moved=moved,
                available_after=after, blocks_before=blocks_before, blocks_after=blocks_after,
                kv_tokens_before=kv_tokens(blocks_before, blocks_per_request, max_model_len),
                kv_tokens_after=kv_tokens(blocks_after, blocks_per_request, max_model_len))


def runtime(*, peak: int, kv_bytes: int, baseline: int, budget: int) -> dict[str, int]:
    """A peak read after the KV cache was allocated, against what was reserved for everything else.

    ``peak``: the meter's peak (absolute, the KV cache included); ``kv_bytes``: the KV cache's
    allocations; ``budget``: the absolute level the rest may reach (vLLM's reserved peak plus what
    memory-headroom moved out of the KV cache). ``runtime_peak`` is counted from ``baseline`` like
    the profiled and measured peaks; ``over_budget`` > 0 means the reservation was exceeded."""
    non_kv = peak - kv_bytes
    return {"peak": peak, "peak_non_kv": non_kv, "runtime_peak": non_kv - baseline, "over_budget": non_kv - budget}
