"""Multi-query TurboQuant attention for speculative-decoding verify batches (Triton).

A verify batch holds, per request b, q_len_b = 1 + k query tokens (the last accepted token and k
draft tokens) whose keys and values vLLM has already written into the TurboQuant cache
(``do_kv_cache_update`` runs before the attention forward). Query token j of request b sits at
position seq_len_b - q_len_b + j and attends, causally, to the cached positions
``< seq_len_b - (q_len_b - 1 - j)``.

The kernel reads the packed cache exactly as vLLM 0.20.2's ``triton_turboquant_store`` writes it,
one slot per (block, position, kv head)::

    [ key: FP8 e4m3 bytes (KEY_FP8) | or MSE indices + fp16 norm ]
    [ value: 4- or 3-bit uniform codes | fp16 scale | fp16 zero (minimum) ]

Stage 1 runs one program per (request, kv head, KV split) and handles every query token of the
request and every query head of the GQA group at once: a tile of Q_MAX * GROUP query rows is
scored against BLOCK_KV cached tokens with one matrix product (the cache is read once per group,
not once per query row), with a per-row causal length. It writes each row's partial output and
log-sum-exp per split. Stage 2 combines the splits. Everything is on the device: the lengths come
from ``seq_lens`` and ``query_start_loc`` tensors, the grid depends only on the (padded) batch
size, so the launch can be captured in a CUDA graph and replayed with other lengths. Rows beyond a
request's q_len (padding) are left as zeros.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _verify_split_kernel(
    Q_ptr,  # [N, Hq, D]: the query (FP8 keys) or the rotated query q @ PiT (MSE keys), any float
    KV_ptr,  # [num_blocks, block_size, Hk, slot] uint8
    BT_ptr,  # [B, max_blocks] int32 block table
    Lens_ptr,  # [B] int32 context length including this step's tokens
    QSL_ptr,  # [B + 1] int32 query start offsets
    Cent_ptr,  # [2**MSE_BITS] float32 Lloyd-Max centroids (MSE keys only)
    Mid_ptr,  # [N, Hq, NUM_SPLITS, D + 1] float32: partial outputs and their log-sum-exp
    scale,
    stride_qn, stride_qh,
    stride_cb, stride_cp, stride_ch,
    stride_bt,
    stride_mn, stride_mh, stride_ms,
    Q_MAX: tl.constexpr,  # largest q_len handled (1 + num_speculative_tokens)
    GROUP: tl.constexpr,  # query heads per kv head
    ROWS: tl.constexpr,  # next power of two >= max(16, Q_MAX * GROUP)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    KEY_FP8: tl.constexpr,
    MSE_BITS: tl.constexpr,
    MSE_BYTES: tl.constexpr,
    KPS: tl.constexpr,
    VQB: tl.constexpr,
    VAL_DATA_BYTES: tl.constexpr,
    NORM_CORRECTION: tl.constexpr,
    FP8_E4B15: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    q_start = tl.load(QSL_ptr + b)
    q_len = tl.load(QSL_ptr + b + 1) - q_start
    ctx = tl.load(Lens_ptr + b)

    rows = tl.arange(0, ROWS)
    tok = rows // GROUP  # query token of the request
    head = kvh * GROUP + rows % GROUP  # query head
    row_ok = (rows < Q_MAX * GROUP) & (tok < q_len)
    visible_len = ctx - (q_len - 1 - tok)  # causal: positions < visible_len

    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(Q_ptr + q_rows[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    # fp32 operands: on the GPU tl.dot rounds them to TF32, which holds bf16 / fp16 queries and
    # FP8 keys exactly (10-bit mantissa), so the scores are exact products with fp32 sums
    q = q.to(tl.float32)

    # this split's share of the context, in whole BLOCK_KV tiles
    per_split = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_KV) * BLOCK_KV
    lo = split * per_split
    hi = tl.minimum(lo + per_split, ctx)

    m = tl.full([ROWS], float("-inf"), tl.float32)
    l_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    kv_r = tl.arange(0, BLOCK_KV)
    bt_row = BT_ptr + b.to(tl.int64) * stride_bt

    if not KEY_FP8:
        bit = d * MSE_BITS
        mse_byte = bit // 8
        mse_shift = bit % 8
    if VQB == 3:
        vbit = d * 3
        v_byte = vbit // 8
        v_shift = vbit % 8
    else:
        v_byte = d // 2
        v_shift = (d % 2) * 4

    for n0 in range(lo, hi, BLOCK_KV):
        pos = n0 + kv_r
        pos_ok = pos < hi
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        slot = blk * stride_cb + (pos % BLOCK_SIZE).to(tl.int64) * stride_cp + kvh.to(tl.int64) * stride_ch
        tile_ok = pos_ok[:, None] & d_ok[None, :]

        # keys -> [BLOCK_KV, BLOCK_D]
        if KEY_FP8:
            kb = tl.load(KV_ptr + slot[:, None] + d[None, :], mask=tile_ok, other=0)
            if FP8_E4B15:
                k = kb.to(tl.float8e4b15, bitcast=True).to(tl.float32)
            else:
                k = kb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            lo8 = tl.load(KV_ptr + slot[:, None] + mse_byte[None, :], mask=tile_ok, other=0).to(tl.int32)
            hi8 = tl.load(KV_ptr + slot[:, None] + mse_byte[None, :] + 1, mask=tile_ok, other=0).to(tl.int32)
            idx = ((lo8 | (hi8 << 8)) >> mse_shift[None, :]) & ((1 << MSE_BITS) - 1)
            k = tl.load(Cent_ptr + idx, mask=tile_ok, other=0.0).to(tl.float32)
            if NORM_CORRECTION:
                k = k / tl.sqrt(tl.sum(k * k, axis=1) + 1e-16)[:, None]
            n_lo = tl.load(KV_ptr + slot + MSE_BYTES, mask=pos_ok, other=0).to(tl.uint16)
            n_hi = tl.load(KV_ptr + slot + MSE_BYTES + 1, mask=pos_ok, other=0).to(tl.uint16)
            norm = (n_lo | (n_hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)
            k = k * norm[:, None]

        s = tl.dot(q, tl.trans(k)) * scale  # [ROWS, BLOCK_KV]
        see = row_ok[:, None] & pos_ok[None, :] & (pos[None, :] < visible_len[:, None])
        s = tl.where(see, s, float("-inf"))

        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet
        alpha = tl.exp(m - m_ref)
        p = tl.exp(s - m_ref[:, None])

        # values -> [BLOCK_KV, BLOCK_D]
        vbase = slot + KPS
        if VQB == 3:
            a0 = tl.load(KV_ptr + vbase[:, None] + v_byte[None, :], mask=tile_ok, other=0).to(tl.int32)
            a1 = tl.load(KV_ptr + vbase[:, None] + v_byte[None, :] + 1, mask=tile_ok, other=0).to(tl.int32)
            code = (((a0 | (a1 << 8)) >> v_shift[None, :]) & 0x7).to(tl.float32)
        else:
            a0 = tl.load(KV_ptr + vbase[:, None] + v_byte[None, :], mask=tile_ok, other=0).to(tl.int32)
            code = ((a0 >> v_shift[None, :]) & 0xF).to(tl.float32)
        sb = vbase + VAL_DATA_BYTES
        s_lo = tl.load(KV_ptr + sb, mask=pos_ok, other=0).to(tl.uint16)
        s_hi = tl.load(KV_ptr + sb + 1, mask=pos_ok, other=0).to(tl.uint16)
        z_lo = tl.load(KV_ptr + sb + 2, mask=pos_ok, other=0).to(tl.uint16)
        z_hi = tl.load(KV_ptr + sb + 3, mask=pos_ok, other=0).to(tl.uint16)
        v_scale = (s_lo | (s_hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)
        v_zero = (z_lo | (z_hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)
        v = code * v_scale[:, None] + v_zero[:, None]
        v = tl.where(tile_ok, v, 0.0)

        acc = acc * alpha[:, None] + tl.dot(p, v)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        m = m_new

    has = l_sum > 0.0
    out = acc / tl.where(has, l_sum, 1.0)[:, None]
    lse = tl.where(has, m + tl.log(tl.where(has, l_sum, 1.0)), float("-inf"))
    mid = Mid_ptr + q_rows * stride_mn + head.to(tl.int64) * stride_mh + split * stride_ms
    tl.store(mid[:, None] + d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(mid + HEAD_DIM, lse, mask=row_ok)


@triton.jit
def _verify_merge_kernel(
    Mid_ptr,  # [N, Hq, NUM_SPLITS, D + 1] float32
    Out_ptr,  # [N, Hq, D]
    QSL_ptr,
    stride_mn, stride_mh, stride_ms,
    stride_on, stride_oh,
    Q_MAX: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    q_start = tl.load(QSL_ptr + b)
    q_len = tl.load(QSL_ptr + b + 1) - q_start
    sp = tl.arange(0, SPLITS_P2)
    sp_ok = sp < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    for j in tl.static_range(Q_MAX):
        if j < q_len:
            row = (q_start + j).to(tl.int64)
            base = Mid_ptr + row * stride_mn + h * stride_mh
            lse = tl.load(base + sp * stride_ms + HEAD_DIM, mask=sp_ok, other=float("-inf"))
            top = tl.max(lse, axis=0)
            top = tl.where(top == float("-inf"), 0.0, top)
            w = tl.exp(lse - top)  # 0 for empty splits
            part = tl.load(base + sp[:, None] * stride_ms + d[None, :],
                           mask=sp_ok[:, None] & d_ok[None, :], other=0.0)
            total = tl.sum(w, axis=0)
            res = tl.sum(w[:, None] * part, axis=0) / tl.where(total > 0.0, total, 1.0)
            tl.store(Out_ptr + row * stride_on + h * stride_oh + d,
                     res.to(Out_ptr.dtype.element_ty), mask=d_ok)


def _positive(name: str, value: int) -> int:
    if value < 1:
        raise ValueError(f"tq_verify_attention: {name}={value}, expected an integer >= 1")
    return value


def tq_verify_attention(
    query: torch.Tensor,  # [N, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, Hk, slot] uint8
    block_table: torch.Tensor,  # [>= B, max_blocks] int32
    seq_lens: torch.Tensor,  # [>= B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32, on the device
    *,
    max_query_len: int,
    scale: float,
    key_fp8: bool,
    key_mse_bits: int,
    key_packed_size: int,
    value_quant_bits: int,
    norm_correction: bool,
    centroids: torch.Tensor | None = None,
    PiT: torch.Tensor | None = None,  # noqa: N803 - the Hadamard rotation, vLLM's name
    num_kv_splits: int = 32,
    fp8_e4b15: bool = False,
    block_kv: int = 16,
    num_warps: int = 4,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of every query row of a verify batch over the TurboQuant cache; [N, Hq, D].

    ``max_query_len`` (a host int: the batch's largest q_len, 1 + k) sizes the query tile; rows
    of a request with a shorter q_len, and rows that belong to no request, stay zero.
    """
    if query.dim() != 3:
        raise ValueError(f"tq_verify_attention: query of shape {tuple(query.shape)}, expected [N, Hq, D]")
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 4:
        raise ValueError(
            f"tq_verify_attention: kv_cache {kv_cache.dtype} {tuple(kv_cache.shape)}, "
            "expected uint8 [num_blocks, block_size, num_kv_heads, slot]")
    n, hq, dim = query.shape
    _, block_size, hk, _ = kv_cache.shape
    if hq % hk:
        raise ValueError(f"tq_verify_attention: {hq} query heads over {hk} kv heads, expected a multiple")
    if kv_cache.stride(3) != 1:
        raise ValueError("tq_verify_attention: kv_cache slots must be contiguous bytes (stride(3) == 1)")
    q_max = _positive("max_query_len", int(max_query_len))
    splits = _positive("num_kv_splits", int(num_kv_splits))
    if value_quant_bits not in (3, 4):
        raise ValueError(f"tq_verify_attention: value_quant_bits={value_quant_bits}, expected 3 or 4")
    if not key_fp8 and (centroids is None or PiT is None or key_mse_bits not in (2, 3, 4)):
        raise ValueError(
            f"tq_verify_attention: MSE keys (key_mse_bits={key_mse_bits}) need centroids and PiT "
            "and 2 to 4 bits")
    reqs = query_start_loc.shape[0] - 1
    if seq_lens.shape[0] < reqs or block_table.shape[0] < reqs:
        raise ValueError(
            f"tq_verify_attention: {reqs} requests in query_start_loc but seq_lens has "
            f"{seq_lens.shape[0]} and block_table {block_table.shape[0]} rows")
    group = hq // hk
    rows = max(16, triton.next_power_of_2(q_max * group))
    block_d = triton.next_power_of_2(dim)

    if key_fp8:
        qk = query if query.stride(2) == 1 else query.contiguous()
        cent = kv_cache  # unused by the FP8 path; any pointer
    else:
        qk = (query.float() @ PiT).contiguous()
        cent = centroids
    result = out if out is not None else torch.zeros(n, hq, dim, dtype=query.dtype, device=query.device)
    if reqs == 0 or n == 0:
        return result
    mid = torch.empty(n, hq, splits, dim + 1, dtype=torch.float32, device=query.device)

    _verify_split_kernel[(reqs, hk, splits)](
        qk, kv_cache, block_table, seq_lens, query_start_loc, cent, mid, float(scale),
        qk.stride(0), qk.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        block_table.stride(0),
        mid.stride(0), mid.stride(1), mid.stride(2),
        Q_MAX=q_max, GROUP=group, ROWS=rows, HEAD_DIM=dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, NUM_SPLITS=splits, BLOCK_KV=block_kv,
        KEY_FP8=1 if key_fp8 else 0, MSE_BITS=max(int(key_mse_bits), 1),
        MSE_BYTES=math.ceil(dim * key_mse_bits / 8), KPS=key_packed_size, VQB=value_quant_bits,
        VAL_DATA_BYTES=math.ceil(dim * value_quant_bits / 8),
        NORM_CORRECTION=1 if norm_correction else 0, FP8_E4B15=1 if fp8_e4b15 else 0,
        num_warps=num_warps, num_stages=1,
    )
    _verify_merge_kernel[(reqs, hq)](
        mid, result, query_start_loc,
        mid.stride(0), mid.stride(1), mid.stride(2),
        result.stride(0), result.stride(1),
        Q_MAX=q_max, HEAD_DIM=dim, BLOCK_D=block_d, NUM_SPLITS=splits,
        SPLITS_P2=triton.next_power_of_2(splits),
        num_warps=4,
    )
    return result
