"""Routed experts for a forward of one to four tokens in two Triton launches (unquantized weights).

At one decode stream a Qwen3-Next / Qwen3.5 MoE layer routes each token to top_k of E experts
(8 of 256 on the 35B-A3B geometry): the step must read 8 experts' gate/up and down weights, 6.3 MB
a layer in bf16 on that geometry, and does two flops per weight. vLLM's ``fused_experts`` runs it as
its batched GEMM path: ``moe_align_block_size`` sorts the (token, expert) pairs into blocks of
BLOCK_SIZE_M rows (one real row in 16 or more at one token), one grouped GEMM for gate/up, the SiLU
and mul kernel, one grouped GEMM for down with the routing weight, and a sum over top_k: five
launches, and tensor-core tiles mostly of padding.

Here a token's pairs are read straight from ``topk_ids``:

- ``up``: one program per (token, slot) and BLOCK_N rows of the intermediate size; it reads those
  rows of the expert's gate and up halves of ``w13`` ([E, 2 * I, H], K contiguous) along the whole
  hidden size, rounds both sums to the activation dtype (as vLLM's GEMM writes them), and stores
  ``silu(gate) * up`` rounded once more (as vLLM's SiLU-and-mul does);
- ``down``: one program per token and BLOCK_N rows of the hidden size; for each slot it reads those
  rows of the expert's ``w2`` ([E, H, I]), multiplies the sum by the slot's routing weight in fp32
  and rounds it to the activation dtype (as vLLM's second GEMM writes its per-slot rows), and adds
  the slots in fp32, rounded once at the end (as vLLM's sum over top_k does for top_k > 4).

So each output is vLLM's value computed with the fp32 additions of each dot product in another order:
an element can differ by a rounding step. No atomics, no split-K: a result depends only on the config.
Weights are streamed with ``evict_first``; activations are kept.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_overlay.moe_decode_table import MAX_TOKENS, Config, heuristic  # noqa: F401 (kept importable here)


@triton.jit
def _up_kernel(
    x_ptr,  # [M, H] activations
    w_ptr,  # [E, 2 * I, H] gate rows then up rows, H contiguous
    ids_ptr,  # [M * TOP_K] expert of each (token, slot)
    o_ptr,  # [M * TOP_K, I] silu(gate) * up
    H,
    I,
    stride_xm,
    stride_we,
    stride_wn,
    stride_om,
    TOP_K: tl.constexpr,
    EVEN: tl.constexpr,  # I % BLOCK_N == 0 and H % BLOCK_K == 0: no masks
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    tok = pair // TOP_K
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    g_ptrs = w_ptr + expert * stride_we + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    u_ptrs = g_ptrs + I * stride_wn
    x_ptrs = x_ptr + tok * stride_xm + rk
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        if EVEN:
            x = tl.load(x_ptrs, eviction_policy="evict_last").to(tl.float32)
            g = tl.load(g_ptrs, eviction_policy="evict_first")
            u = tl.load(u_ptrs, eviction_policy="evict_first")
        else:
            mk = (k0 + rk) < H
            mw = (rn[:, None] < I) & mk[None, :]
            x = tl.load(x_ptrs, mask=mk, other=0.0, eviction_policy="evict_last").to(tl.float32)
            g = tl.load(g_ptrs, mask=mw, other=0.0, eviction_policy="evict_first")
            u = tl.load(u_ptrs, mask=mw, other=0.0, eviction_policy="evict_first")
        acc_g += g.to(tl.float32) * x[None, :]
        acc_u += u.to(tl.float32) * x[None, :]
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    dtype = o_ptr.dtype.element_ty
    gate = tl.sum(acc_g, axis=1).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    up = tl.sum(acc_u, axis=1).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(o_ptr + pair * stride_om + rn, act.to(dtype, fp_downcast_rounding="rtne"), mask=rn < I)


@triton.jit
def _down_kernel(
    a_ptr,  # [M * TOP_K, I] the up kernel's output
    w_ptr,  # [E, H, I] down projection, I contiguous
    ids_ptr,  # [M * TOP_K]
    wts_ptr,  # [M * TOP_K] routing weights
    o_ptr,  # [M, H]
    H,
    I,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    TOP_K: tl.constexpr,
    EVEN: tl.constexpr,  # H % BLOCK_N == 0 and I % BLOCK_K == 0
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tok = tl.program_id(0)
    pid_n = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    dtype = o_ptr.dtype.element_ty
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):  # unrolled: the slots' weight loads can be in flight together
        pair = tok * TOP_K + slot
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        weight = tl.load(wts_ptr + pair).to(tl.float32)
        w_ptrs = w_ptr + expert * stride_we + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
        a_ptrs = a_ptr + pair * stride_am + rk
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            if EVEN:
                a = tl.load(a_ptrs, eviction_policy="evict_last").to(tl.float32)
                w = tl.load(w_ptrs, eviction_policy="evict_first")
            else:
                mk = (k0 + rk) < I
                a = tl.load(a_ptrs, mask=mk, other=0.0, eviction_policy="evict_last").to(tl.float32)
                w = tl.load(w_ptrs, mask=(rn[:, None] < H) & mk[None, :], other=0.0, eviction_policy="evict_first")
            acc += w.to(tl.float32) * a[None, :]
            w_ptrs += BLOCK_K
            a_ptrs += BLOCK_K
        part = tl.sum(acc, axis=1) * weight
        total += part.to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    tl.store(o_ptr + tok * stride_om + rn, total.to(dtype, fp_downcast_rounding="rtne"), mask=rn < H)


def routed_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, up: Config, down: Config,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``sum over slots of weight * down(silu(gate) * up)`` for x of 1 to MAX_TOKENS rows ([M, H]),
    w13 [E, 2 * I, H], w2 [E, H, I] (last dimension contiguous), topk_ids / topk_weights [M, top_k]."""
    m, h = x.shape
    e, two_i, h13 = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    if not 1 <= m <= MAX_TOKENS:
        raise ValueError(f"routed_experts: {m} rows; the kernel takes 1 to {MAX_TOKENS}")
    if h13 != h or w2.shape != (e, h, inter) or two_i != 2 * inter:
        raise ValueError(f"routed_experts: shapes x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} "
                         "do not fit x [M, H], w13 [E, 2 * I, H], w2 [E, H, I]")
    if x.stride(1) != 1:
        x = x.contiguous()
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    wts = topk_weights.reshape(-1)
    if not wts.is_contiguous():
        wts = wts.contiguous()
    act = torch.empty((m * top_k, inter), dtype=x.dtype, device=x.device)
    _up_kernel[(m * top_k, triton.cdiv(inter, up.block_n))](
        x, w13, ids, act, h, inter, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=top_k, EVEN=inter % up.block_n == 0 and h % up.block_k == 0,
        BLOCK_N=up.block_n, BLOCK_K=up.block_k, num_warps=up.num_warps, num_stages=up.num_stages,
    )
    if out is None:
        out = torch.empty((m, h), dtype=x.dtype, device=x.device)
    _down_kernel[(m, triton.cdiv(h, down.block_n))](
        act, w2, ids, wts, out, h, inter, act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        TOP_K=top_k, EVEN=h % down.block_n == 0 and inter % down.block_k == 0,
        BLOCK_N=down.block_n, BLOCK_K=down.block_k, num_warps=down.num_warps, num_stages=down.num_stages,
    )
    return out
