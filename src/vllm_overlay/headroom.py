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
    """One dummy forward: ``num_reqs`` requests sharing ``tokens`` tokens the way vLLM's
    ``_dummy_run`` splits them (equal parts, the remainder on the last), each with ``seq_len``
    tokens of context including its own."""

    name: str
    tokens: int
    num_reqs: int

    @property
    def largest_request(self) -> int:
        return self.tokens // self.num_reqs + self.tokens % self.num_reqs

    @property
    def seq_len(self) -> int:
        return self.largest_request


def forward_shapes(tokens: int, max_num_seqs: int, max_model_len: int,
                   state_slots: int) -> tuple[list[Shape], list[str]]:
    """The prefill-shaped forwards of ``tokens`` tokens to measure, and why any was left out.

    First the fewest requests that fit in max_model_len (one long prefill when tokens <=
    max_model_len); then, when different, vLLM's own profiling split into min(tokens,
    max_num_seqs) requests, whose many short prefills pad more GDN chunks. Every request needs
    its own recurrent-state slot (a KV block) in the temporary cache the forwards run on, which
    has ``state_slots`` blocks (vLLM's minimal profiling cache: one per CUDA graph batch size up
    to max_num_seqs, one block without CUDA graphs): the split is cut to that many requests, and
    a shape whose largest request exceeds max_model_len or that needs more slots is left out."""
    for name, v in (("tokens", tokens), ("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len),
                    ("state_slots", state_slots)):
        if v < 1:
            raise ValueError(f"forward_shapes: {name}={v}: expected a positive integer")
    shapes: list[Shape] = []
    left_out: list[str] = []
    n = min(max_num_seqs, cdiv(tokens, max_model_len))
    while n < min(tokens, max_num_seqs) and Shape("", tokens, n).largest_request > max_model_len:
        n += 1
    long = Shape("longest prefill" if n == 1 else f"{n} prefills of up to max_model_len", tokens, n)
    if long.largest_request > max_model_len:
        left_out.append(f"{long.name}: a request of {long.largest_request} tokens exceeds max_model_len "
                        f"{max_model_len} with max_num_seqs {max_num_seqs}")
    elif long.num_reqs > state_slots:
        left_out.append(f"{long.name}: {long.num_reqs} requests need more state slots than the "
                        f"temporary cache's {state_slots}")
    else:
        shapes.append(long)
    full = min(tokens, max_num_seqs)
    r = min(full, state_slots)
    split = Shape(f"{r} prefills (vLLM's profiling split)" if r == full
                  else f"{r} prefills (vLLM's profiling split of {full}, cut to the state slots)", tokens, r)
    if r == long.num_reqs and full != long.num_reqs:
        left_out.append(f"{full} prefills (vLLM's profiling split): the temporary cache has "
                        f"{state_slots} state slot(s)")
    elif split.num_reqs != long.num_reqs:
        if split.largest_request > max_model_len:
            left_out.append(f"{split.name}: a request of {split.largest_request} tokens exceeds max_model_len "
                            f"{max_model_len}")
        else:
            shapes.append(split)
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

    def line(self) -> str:
        """The one log line (identifiers whole; sizes in GiB with bytes where they decide)."""
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
