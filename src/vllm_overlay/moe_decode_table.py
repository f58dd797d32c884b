"""The routed-experts decode kernel's launch configs, without torch or Triton.

``kernels/moe_decode.py`` runs two launches, ``up`` (gate/up and SiLU-and-mul, one program per
(token, slot) and BLOCK_N intermediate rows) and ``down`` (down projection and the sum over slots,
one program per token and BLOCK_N hidden rows). Each takes a ``gemv_table.Config`` (BLOCK_N, BLOCK_K,
num_warps, num_stages); ``heuristic`` picks one from the shape, the rows of programs and the SM count.
"""

from __future__ import annotations

from vllm_overlay.gemv_table import Config, pow2_at_least

MAX_TOKENS = 4  # forwards of more tokens keep vLLM's fused_experts
# BLOCK_N * BLOCK_K: 2 KiB of bf16 weights per program per K tile. The tiles a search on an H100 found
# fastest at one token on the 35B-A3B geometry (bench/results/moe-decode-kernel-026-h100.json): up 1 x 1024,
# down 2 x 512 (heuristic of 4096 elements: 25.7 us a layer; the search's best: 23.2).
ELEMENTS = 1024
MAX_BLOCK_K = 1024


def heuristic(n: int, k: int, rows: int, sms: int) -> Config:
    """A launch's config: BLOCK_K up to MAX_BLOCK_K along the reduced dimension k, BLOCK_N = ELEMENTS /
    BLOCK_K, halved while the grid (rows x ceil(n / BLOCK_N) programs) has fewer than two programs per SM.
    ``rows``: tokens x top_k for ``up`` (n = the intermediate size, k = the hidden size), tokens for
    ``down`` (n = the hidden size, k = the intermediate size)."""
    block_k = min(MAX_BLOCK_K, max(128, pow2_at_least(k)))
    block_n = max(1, ELEMENTS // block_k)
    while block_n > 1 and rows * -(-n // block_n) < 2 * sms:
        block_n //= 2
    return Config(block_n, block_k, 4, 1)


__all__ = ["MAX_TOKENS", "Config", "heuristic"]
