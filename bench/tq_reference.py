"""Torch reference for the TurboQuant verify kernel (vllm_overlay.kernels.tq_verify): pack a paged
cache, unpack it, attend. Used by bench/tq_verify_kernel.py and tests/interpreted/.

Pure torch (CPU or GPU), no Triton and no vLLM. ``pack_k8v4`` writes the bytes vLLM 0.20.2's
``triton_turboquant_store`` writes for ``turboquant_k8v4`` (FP8 e4m3 key bytes, then 4-bit value
codes two per byte low nibble first, then the fp16 scale and fp16 minimum, little-endian);
``pack_codes`` writes a slot from given codes for the MSE-key presets (a little-endian bit stream of
key indices, the fp16 key norm, then the value codes, scale and minimum). ``unpack`` inverts both,
``verify_attention`` is the fp32 softmax reference with the verify batch's causal rule.
"""

from __future__ import annotations

import math

import torch


def layout(head_dim: int, *, key_fp8: bool, key_mse_bits: int, value_bits: int) -> dict[str, int]:
    """Byte offsets of one slot, as vLLM 0.20.2's TurboQuantConfig computes them."""
    mse_bytes = head_dim if key_fp8 else math.ceil(head_dim * key_mse_bits / 8)
    kps = head_dim if key_fp8 else mse_bytes + 2
    val_bytes = math.ceil(head_dim * value_bits / 8)
    slot = kps + val_bytes + 4
    return {"mse_bytes": mse_bytes, "kps": kps, "val_bytes": val_bytes, "slot": slot + slot % 2}


def _bitstream(codes: torch.Tensor, bits: int, nbytes: int) -> torch.Tensor:
    """[..., D] integer codes -> [..., nbytes] uint8, code i at bit i * bits, little-endian."""
    d = codes.shape[-1]
    out = torch.zeros(*codes.shape[:-1], nbytes + 1, dtype=torch.int32, device=codes.device)
    for i in range(d):
        bit = i * bits
        byte, shift = bit // 8, bit % 8
        val = codes[..., i].to(torch.int32) << shift
        out[..., byte] |= val & 0xFF
        out[..., byte + 1] |= (val >> 8) & 0xFF
    return out[..., :nbytes].to(torch.uint8)


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """[...] -> [..., 2] uint8, the fp16 value little-endian."""
    u = x.to(torch.float16).contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.stack([u & 0xFF, u >> 8], dim=-1).to(torch.uint8)


def quantize_values(v: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uniform min/max codes per row, as the store kernel computes them: (codes, scale, minimum)."""
    v = v.float()
    lo = v.amin(dim=-1)
    levels = (1 << bits) - 1
    scale = ((v.amax(dim=-1) - lo) / levels).clamp_min(1e-8)
    codes = ((v - lo[..., None]) / scale[..., None] + 0.5).to(torch.int32).clamp(0, levels)
    return codes, scale, lo


def _slot_bytes(key_part: torch.Tensor, vcodes: torch.Tensor, vscale: torch.Tensor, vmin: torch.Tensor,
                lay: dict[str, int], value_bits: int) -> torch.Tensor:
    n = key_part.shape[0]
    slot = torch.zeros(n, key_part.shape[1], lay["slot"], dtype=torch.uint8, device=key_part.device)
    slot[..., : key_part.shape[-1]] = key_part
    at = lay["kps"]
    slot[..., at: at + lay["val_bytes"]] = _bitstream(vcodes, value_bits, lay["val_bytes"])
    at += lay["val_bytes"]
    slot[..., at: at + 2] = _f16_bytes(vscale)
    slot[..., at + 2: at + 4] = _f16_bytes(vmin)
    return slot


def pack_k8v4(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[n, Hk, D] keys and values -> [n, Hk, slot] uint8 slots of turboquant_k8v4."""
    lay = layout(k.shape[-1], key_fp8=True, key_mse_bits=0, value_bits=4)
    kb = k.to(torch.float8_e4m3fn).view(torch.uint8)
    codes, scale, lo = quantize_values(v, 4)
    return _slot_bytes(kb, codes, scale, lo, lay, 4)


def pack_codes(key_idx: torch.Tensor, key_norm: torch.Tensor, vcodes: torch.Tensor, vscale: torch.Tensor,
               vmin: torch.Tensor, *, key_mse_bits: int, value_bits: int) -> torch.Tensor:
    """Slots of an MSE-key preset from given codes: [n, Hk, D] indices, [n, Hk] norms, values."""
    d = key_idx.shape[-1]
    lay = layout(d, key_fp8=False, key_mse_bits=key_mse_bits, value_bits=value_bits)
    key_part = torch.cat([_bitstream(key_idx, key_mse_bits, lay["mse_bytes"]), _f16_bytes(key_norm)], -1)
    return _slot_bytes(key_part, vcodes, vscale, vmin, lay, value_bits)


def _read_bits(raw: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    padded = torch.cat([raw.to(torch.int32), torch.zeros_like(raw[..., :1], dtype=torch.int32)], -1)
    idx = torch.arange(d, device=raw.device) * bits
    word = padded[..., idx // 8] | (padded[..., idx // 8 + 1] << 8)
    return (word >> (idx % 8)) & ((1 << bits) - 1)


def _f16_read(two: torch.Tensor) -> torch.Tensor:
    u = two[..., 0].to(torch.int32) | (two[..., 1].to(torch.int32) << 8)
    return torch.where(u >= 0x8000, u - 0x10000, u).to(torch.int16).view(torch.float16).float()


def unpack(slots: torch.Tensor, head_dim: int, *, key_fp8: bool, key_mse_bits: int, value_bits: int,
           centroids: torch.Tensor | None = None, norm_correction: bool = False,
           Pi: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: N803
    """[n, Hk, slot] -> fp32 K, V [n, Hk, D] (MSE keys rotated back with Pi when given)."""
    lay = layout(head_dim, key_fp8=key_fp8, key_mse_bits=key_mse_bits, value_bits=value_bits)
    if key_fp8:
        k = slots[..., :head_dim].contiguous().view(torch.float8_e4m3fn).float()
    else:
        assert centroids is not None
        idx = _read_bits(slots[..., : lay["mse_bytes"]], key_mse_bits, head_dim)
        c = centroids.float()[idx.long()]
        if norm_correction:
            c = c / torch.sqrt((c * c).sum(-1, keepdim=True) + 1e-16)
        norm = _f16_read(slots[..., lay["mse_bytes"]: lay["mse_bytes"] + 2])
        k = c * norm[..., None]
        if Pi is not None:
            k = k @ Pi.float()
    at = lay["kps"]
    codes = _read_bits(slots[..., at: at + lay["val_bytes"]], value_bits, head_dim).float()
    at += lay["val_bytes"]
    scale, lowest = _f16_read(slots[..., at: at + 2]), _f16_read(slots[..., at + 2: at + 4])
    v = codes * scale[..., None] + lowest[..., None]
    return k, v


def verify_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 attention of one request's q_len query rows [q_len, Hq, D] over its whole context
    [ctx, Hk, D]: row j sees positions < ctx - (q_len - 1 - j)."""
    q_len, hq, _ = q.shape
    ctx, hk, _ = k.shape
    group = hq // hk
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("jhd,nhd->hjn", q.float(), kf) * scale
    visible = torch.arange(ctx)[None, :] < (ctx - (q_len - 1 - torch.arange(q_len)))[:, None]
    scores = scores.masked_fill(~visible.to(scores.device)[None], float("-inf"))
    return torch.einsum("hjn,nhd->jhd", scores.softmax(-1), vf)
