"""One-row GEMV for the unquantized linear layers of a decode step (Triton).

At one decode stream every dense projection of a hybrid model is ``y = x @ W.T`` with x one row:
the step reads each weight once and does two flops per weight, so the floor is the weight bytes
over the memory bandwidth. cuBLAS picks tensor-core GEMM tiles for these shapes (``nvjet_*_8x64``
and friends, some with a split-K reduction kernel after them) that reach a fraction of that
bandwidth on the small projections (2048 x 4096 output projections at about 1.3 TB/s on an H200).

Here each program owns BLOCK_N rows of W (output columns) and walks the whole K in BLOCK_K
tiles, multiplying in fp32 and keeping a [BLOCK_N, BLOCK_K] fp32 accumulator that is summed
once at the end; the output is rounded to the output dtype once. No atomics, no split-K: a
result depends only on the config, so it is the same from run to run. The weights are streamed
with ``evict_first`` (read once per step), the row of x is kept (read by every program).

It differs from cuBLAS only in the order of the fp32 additions: each output is the same sum,
rounded once to bf16, so outputs differ from F.linear by at most a rounding step where the fp32
sums round to neighbouring bf16 values (``bench/decode_gemv_h200.py`` counts how many).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_overlay.gemv_table import Config, heuristic  # noqa: F401 (the kernel's configs, kept importable here)


@triton.jit
def _gemv_kernel(
    x_ptr,  # [K] the input row (contiguous)
    w_ptr,  # [N, K] weight, K contiguous (row stride stride_wn)
    b_ptr,  # [N] bias, or any pointer when HAS_BIAS is False
    o_ptr,  # [N] output row
    N,
    K,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no masks
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    x_ptrs = x_ptr + rk
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            x = tl.load(x_ptrs, eviction_policy="evict_last")
        else:
            mk = (k0 + rk) < K
            w = tl.load(w_ptrs, mask=(rn[:, None] < N) & mk[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=mk, other=0.0, eviction_policy="evict_last")
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    tl.store(o_ptr + rn, out.to(o_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=rn < N)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: Config,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for x of exactly one row (shape [..., K] with one row in all)."""
    k = x.shape[-1]
    n = weight.shape[0]
    x1 = x.reshape(k)
    if x1.stride(0) != 1:
        x1 = x1.contiguous()
    if out is None:
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    even = n % cfg.block_n == 0 and k % cfg.block_k == 0
    grid = (triton.cdiv(n, cfg.block_n),)
    _gemv_kernel[grid](
        x1, weight, bias if bias is not None else x1, out, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, EVEN=even, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
