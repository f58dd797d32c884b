"""Accuracy of vLLM 0.20.2's TurboQuant KV-cache kernels on random data (no engine boot).

  export PYTHONPATH=/tmp/site; python bench/tq_kernel.py [--presets ...] [--head-dims 128 256]
      [--seq-lens 512 4096] [--batch 4] [--out bench/results/tq-kernel-h200.json]

For each preset x head_dim x seq_len: random bf16 Q/K/V (fixed seed, torch.Generator on the GPU),
GQA with 16 query heads over 2 KV heads (the Qwen3.6-35B-A3B attention shape). K/V of every
request are written into a paged TurboQuant cache (num_blocks, block_size, num_kv_heads,
slot_size_aligned) uint8 by `triton_turboquant_store`, with the arguments and buffers the backend
uses (TurboQuantAttentionImpl._store_kv / _ensure_on_device: Hadamard Pi = PiT, Lloyd-Max
centroids of the layer, their midpoints). Then one query token per request attends over its whole
cached sequence through `triton_turboquant_decode_attention`, called as
TurboQuantAttentionImpl._decode_attention calls it (preallocated mid_o/output/lse buffers of the
layer's shapes, 32 KV splits). Requests have ragged lengths and a shuffled block table.

Measured against an fp32 attention over the unquantized bf16 K/V (scale 1/sqrt(head_dim)):
relative error ||out - ref||_F / ||ref||_F, max abs error, cosine (whole output, and the worst
(request, head) row). The floor is the same attention done in bf16 on the unquantized bf16 K/V with
a bf16 output, i.e. what an unquantized bf16 cache gives. Preset/head_dim combinations the kernels
refuse are recorded as "unsupported: <reason>".
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import re
import time
from types import SimpleNamespace
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
PRESETS = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
DEFAULT_OUT = os.path.join(HERE, "results", "tq-kernel-h200.json")
# vLLM 0.20.2 default of attention_config.tq_max_kv_splits_for_cuda_graph (vllm/config/attention.py)
KV_SPLITS = 32
RAGGED_STEP = 37  # request i holds seq_len - i * RAGGED_STEP tokens (not a block multiple)


def vllm_version() -> str | None:
    """Installed vLLM version, read without importing vllm (no CUDA import on CPU machines)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        return None
    for loc in spec.submodule_search_locations or []:
        path = os.path.join(loc, "_version.py")
        if os.path.exists(path):
            with open(path) as f:
                m = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", f.read())
            if m:
                return m.group(1)
    try:
        from importlib.metadata import version

        return version("vllm")
    except ImportError:  # PackageNotFoundError included
        return None


def _tq_layer(preset: str, head_dim: int, num_q_heads: int, max_num_seqs: int,
              device: torch.device) -> SimpleNamespace:
    """What the Attention layer and the backend's _ensure_on_device hold for one TQ layer."""
    from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
    from vllm.v1.attention.backends.turboquant_attn import _build_hadamard

    cfg = TurboQuantConfig.from_cache_dtype(preset, head_dim)
    # Attention._init_turboquant_buffers: float32 Lloyd-Max centroids (cached tensor: copy it)
    centroids = get_centroids(head_dim, cfg.centroid_bits).to(device=device, dtype=torch.float32)
    # _ensure_on_device: the same orthonormal Hadamard matrix serves as Pi and PiT (symmetric);
    # midpoints between sorted centroids are the store kernel's bucket boundaries
    hadamard = _build_hadamard(head_dim, str(device))
    ordered = centroids.sort().values
    midpoints = (ordered[:-1] + ordered[1:]) / 2
    f32: dict[str, Any] = {"dtype": torch.float32, "device": device}
    return SimpleNamespace(
        cfg=cfg, centroids=centroids, Pi=hadamard, PiT=hadamard, midpoints=midpoints,
        # the layer's preallocated decode buffers (max_num_seqs rows, sliced by the launcher)
        _tq_mid_o_buf=torch.empty(max_num_seqs, num_q_heads, KV_SPLITS, head_dim + 1, **f32),
        _tq_output_buf=torch.empty(max_num_seqs, num_q_heads, head_dim, **f32),
        _tq_lse_buf=torch.empty(max_num_seqs, num_q_heads, **f32),
    )


def _compare(out: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    out, ref = out.float(), ref.float()
    rows = torch.nn.functional.cosine_similarity(out.reshape(-1, out.shape[-1]),
                                                 ref.reshape(-1, ref.shape[-1]), dim=1)
    return {
        "rel_err": ((out - ref).norm() / ref.norm()).item(),
        "max_abs_err": (out - ref).abs().max().item(),
        "cosine": torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item(),
        "min_row_cosine": rows.min().item(),
        "finite": bool(torch.isfinite(out).all().item()),
    }


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query row per head over (n, Hk, D) K/V; query head h reads KV head h // (Hq // Hk)."""
    group = q.shape[0] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # (n, Hq, D)
    v = v.repeat_interleave(group, dim=1)
    probs = (torch.einsum("hd,nhd->hn", q, k) * scale).softmax(dim=-1)
    return torch.einsum("hn,nhd->hd", probs, v)


def measure(preset: str, head_dim: int, seq_len: int, *, batch: int = 4, num_q_heads: int = 16,
            num_kv_heads: int = 2, block_size: int = 16, max_num_seqs: int = 16, seed: int = 0,
            device: str = "cuda") -> dict[str, Any]:
    """Store + decode one batch through the TurboQuant kernels; errors against fp32 attention."""
    dev = torch.device(device)
    lens = [seq_len - i * RAGGED_STEP for i in range(batch)]
    entry: dict[str, Any] = {"preset": preset, "head_dim": head_dim, "seq_len": seq_len,
                             "seq_lens": lens}
    if min(lens) < 1 or batch > max_num_seqs:
        raise ValueError(f"batch {batch} too large for seq_len {seq_len} / max_num_seqs {max_num_seqs}")
    gen = torch.Generator(device=dev).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32).to(torch.bfloat16)

    q = randn(batch, num_q_heads, head_dim)
    ks = [randn(n, num_kv_heads, head_dim) for n in lens]
    vs = [randn(n, num_kv_heads, head_dim) for n in lens]
    scale = 1.0 / math.sqrt(head_dim)

    # paged layout: each request gets whole blocks, scattered by a random permutation
    blocks_per_req = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(blocks_per_req) + 1
    perm = torch.randperm(num_blocks, generator=gen, device=dev).to(torch.int32)
    block_table = torch.zeros(batch, max(blocks_per_req), dtype=torch.int32, device=dev)
    slots, used = [], 0
    for i, (n, nb) in enumerate(zip(lens, blocks_per_req)):
        block_table[i, :nb] = perm[used:used + nb]
        used += nb
        pos = torch.arange(n, device=dev)
        slots.append(block_table[i, pos // block_size].long() * block_size + pos % block_size)
    slot_mapping = torch.cat(slots)  # int64, like the model runner's
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)

    try:
        from vllm.v1.attention.ops.triton_turboquant_decode import triton_turboquant_decode_attention
        from vllm.v1.attention.ops.triton_turboquant_store import triton_turboquant_store

        layer = _tq_layer(preset, head_dim, num_q_heads, max_num_seqs, dev)
        cfg = layer.cfg
        kv_cache = torch.zeros(num_blocks, block_size, num_kv_heads, cfg.slot_size_aligned,
                               dtype=torch.uint8, device=dev)
        # TurboQuantAttentionImpl._store_kv: one call for all tokens of the batch
        triton_turboquant_store(
            torch.cat(ks), torch.cat(vs), kv_cache, slot_mapping, layer.PiT, layer.midpoints,
            mse_bits=cfg.key_mse_bits, key_packed_size=cfg.key_packed_size,
            value_quant_bits=cfg.effective_value_quant_bits, key_fp8=cfg.key_fp8)
        # TurboQuantAttentionImpl._decode_attention
        out = triton_turboquant_decode_attention(
            query=q, kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens,
            Pi=layer.Pi, centroids=layer.centroids, scale=scale, mse_bits=cfg.key_mse_bits,
            key_packed_size=cfg.key_packed_size, value_quant_bits=cfg.effective_value_quant_bits,
            key_fp8=cfg.key_fp8, norm_correction=cfg.norm_correction, PiT=layer.PiT,
            mid_o_buf=layer._tq_mid_o_buf, output_buf=layer._tq_output_buf,
            lse_buf=layer._tq_lse_buf, buf_holder=layer, max_num_kv_splits=KV_SPLITS)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    except Exception as exc:  # noqa: BLE001  (a kernel or config refusing this preset/head_dim)
        reason = (str(exc).strip().splitlines() or [""])[0][:300]
        entry["status"] = f"unsupported: {type(exc).__name__}: {reason}"
        return entry

    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # a true fp32 reference: no TF32
    try:
        ref = torch.stack([_attention(q[i].float(), ks[i].float(), vs[i].float(), scale)
                           for i in range(batch)])
    finally:
        torch.set_float32_matmul_precision(precision)
    floor = torch.stack([_attention(q[i], ks[i], vs[i], scale) for i in range(batch)])  # bf16
    entry.update(status="ok", slot_size_aligned=cfg.slot_size_aligned,
                 key_fp8=cfg.key_fp8, key_mse_bits=cfg.key_mse_bits,
                 value_bits=cfg.effective_value_quant_bits, norm_correction=cfg.norm_correction,
                 tq=_compare(out, ref), bf16=_compare(floor, ref))
    return entry


def run(presets: list[str], head_dims: list[int], seq_lens: list[int], **kw: Any) -> list[dict[str, Any]]:
    return [measure(p, d, n, **kw) for p in presets for d in head_dims for n in seq_lens]


def _table(results: list[dict[str, Any]]) -> str:
    head = (f"{'preset':<20}{'D':>5}{'seq':>6}  {'rel_err':>8}{'max_abs':>9}{'cosine':>9}"
            f"  {'bf16 rel':>9}{'bf16 max':>9}{'bf16 cos':>10}")
    lines = [head, "-" * len(head)]
    for r in results:
        lead = f"{r['preset']:<20}{r['head_dim']:>5}{r['seq_len']:>6}  "
        if r["status"] != "ok":
            lines.append(lead + r["status"])
            continue
        t, b = r["tq"], r["bf16"]
        lines.append(lead + f"{t['rel_err']:>8.4f}{t['max_abs_err']:>9.4f}{t['cosine']:>9.5f}"
                     f"  {b['rel_err']:>9.5f}{b['max_abs_err']:>9.5f}{b['cosine']:>10.6f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=list(PRESETS))
    ap.add_argument("--head-dims", nargs="+", type=int, default=[128, 256])
    ap.add_argument("--seq-lens", nargs="+", type=int, default=[512, 4096])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--num-q-heads", type=int, default=16)
    ap.add_argument("--num-kv-heads", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=16, help="16, 32, 64 or 128 for TurboQuant")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="rows of the decode buffers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU and vLLM 0.20.2 (export PYTHONPATH=/tmp/site)")

    import triton

    settings = {k: v for k, v in vars(args).items() if k != "out"}
    settings.update(kv_splits=KV_SPLITS, ragged_step=RAGGED_STEP, scale="1/sqrt(head_dim)",
                    dtype="bfloat16", reference="fp32 softmax attention on the bf16 K/V, no TF32",
                    floor="bf16 attention on the bf16 K/V, bf16 output")
    results = run(args.presets, args.head_dims, args.seq_lens, batch=args.batch,
                  num_q_heads=args.num_q_heads, num_kv_heads=args.num_kv_heads,
                  block_size=args.block_size, max_num_seqs=args.max_num_seqs, seed=args.seed)
    print(_table(results))
    doc = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "gpu": torch.cuda.get_device_name(),
        "vllm": vllm_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "settings": settings,
        "results": results,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
