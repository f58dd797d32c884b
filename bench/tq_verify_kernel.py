"""The TurboQuant verify kernel on the GPU: accuracy against fp32 attention and step timing.

  export PYTHONPATH=$PWD/src:/tmp/site; python bench/tq_verify_kernel.py --out $OUT/tq-verify-kernel.json

vllm-overlay's multi-query GQA TurboQuant kernel (``vllm_overlay.kernels.tq_verify``, what the
turboquant-spec-decode patch runs for speculative-decoding verify batches) on a cache written by
vLLM 0.20.2's own ``triton_turboquant_store`` (turboquant_k8v4, as TurboQuantAttentionImpl._store_kv
calls it). Shapes: the Qwen3.6-35B-A3B attention (16 query heads over 2 KV heads, head_dim 256),
bf16, block size 16, shuffled block table; each request's context already holds its q_len new
tokens (vLLM stores K/V before the attention forward), query token j of a request sees the
positions < seq_len - (q_len - 1 - j).

Accuracy (q_len 2, 3, 4; ragged contexts up to 32768): relative error ||out - ref|| / ||ref|| and
cosine against fp32 softmax attention on the unquantized bf16 K/V (the quantization error, to
compare with the single-query kernel's ~0.11 for k8v4), and max abs error against fp32 attention on
the dequantized cache (the kernel's own error). Also: vLLM's single-query TurboQuant kernel run
once per query row (what vLLM 0.20.2 does for a short continuation chunk) on the same cache, and
the kernel captured in a CUDA graph and replayed after the lengths changed in place.

Timing (median of --reps single-launch CUDA-graph replays, CUDA events): the verify step's
attention for 1 and 16 requests x contexts 2048 and 32768 x q_len 4: this kernel; vLLM's
single-query TurboQuant kernel over the q_len x requests rows; FlashAttention 2 (vLLM's
vllm_flash_attn, paged bf16 cache) = the bf16 KV path. Results are written after every step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from typing import Any, Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
if SRC not in sys.path:
    sys.path.insert(0, SRC)

PRESET = "turboquant_k8v4"
HQ, HK, DIM, BLOCK = 16, 2, 256, 16
KV_SPLITS = 32  # vLLM 0.20.2's tq_max_kv_splits_for_cuda_graph
ACCURACY_LENS = [32768, 20011, 2048, 517]  # ragged, none a block multiple but 32768 and 2048
# a smoke test of this script without a GPU: TQ_VERIFY_BENCH_DEVICE=cpu TRITON_INTERPRET=1 with
# --smoke (small contexts, no CUDA graphs, no timing)
DEVICE = os.environ.get("TQ_VERIFY_BENCH_DEVICE", "cuda")


class Batch:
    """Random bf16 K/V and queries for one verify batch, in a TurboQuant and a bf16 paged cache."""

    def __init__(self, lens: list[int], q_len: int, seed: int = 0, bf16_cache: bool = True) -> None:
        from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
        from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
        from vllm.v1.attention.backends.turboquant_attn import _build_hadamard
        from vllm.v1.attention.ops.triton_turboquant_store import triton_turboquant_store

        dev = torch.device(DEVICE)
        gen = torch.Generator(device=dev).manual_seed(seed)
        self.lens, self.q_len, self.scale = lens, q_len, 1.0 / math.sqrt(DIM)
        self.cfg = cfg = TurboQuantConfig.from_cache_dtype(PRESET, DIM)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, device=dev).to(torch.bfloat16)

        b = len(lens)
        self.q = randn(b * q_len, HQ, DIM)
        self.ks = [randn(n, HK, DIM) for n in lens]
        self.vs = [randn(n, HK, DIM) for n in lens]
        nb = [math.ceil(n / BLOCK) for n in lens]
        num_blocks = sum(nb) + 1
        perm = torch.randperm(num_blocks, generator=gen, device=dev).to(torch.int32)
        self.block_table = torch.zeros(b, max(nb), dtype=torch.int32, device=dev)
        slots, used = [], 0
        for i, (n, k) in enumerate(zip(lens, nb)):
            self.block_table[i, :k] = perm[used:used + k]
            used += k
            pos = torch.arange(n, device=dev)
            slots.append(self.block_table[i, pos // BLOCK].long() * BLOCK + pos % BLOCK)
        slot_mapping = torch.cat(slots)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(0, (b + 1) * q_len, q_len, dtype=torch.int32, device=dev)

        self.centroids = get_centroids(DIM, cfg.centroid_bits).to(device=dev, dtype=torch.float32)
        self.hadamard = _build_hadamard(DIM, str(dev))
        ordered = self.centroids.sort().values
        midpoints = (ordered[:-1] + ordered[1:]) / 2
        self.kv_cache = torch.zeros(num_blocks, BLOCK, HK, cfg.slot_size_aligned, dtype=torch.uint8,
                                    device=dev)
        k_all, v_all = torch.cat(self.ks), torch.cat(self.vs)
        triton_turboquant_store(k_all, v_all, self.kv_cache, slot_mapping, self.hadamard, midpoints,
                                mse_bits=cfg.key_mse_bits, key_packed_size=cfg.key_packed_size,
                                value_quant_bits=cfg.effective_value_quant_bits, key_fp8=cfg.key_fp8)
        self.k_cache = self.v_cache = None
        if bf16_cache:
            self.k_cache = torch.zeros(num_blocks, BLOCK, HK, DIM, dtype=torch.bfloat16, device=dev)
            self.v_cache = torch.zeros_like(self.k_cache)
            self.k_cache.view(-1, HK, DIM)[slot_mapping] = k_all
            self.v_cache.view(-1, HK, DIM)[slot_mapping] = v_all
        # per query row, for vLLM's single-query kernel: the request's table, a causal length
        j = torch.arange(q_len, device=dev, dtype=torch.int32)
        self.row_lens = (self.seq_lens[:, None] - (q_len - 1 - j)[None, :]).reshape(-1).contiguous()
        self.row_table = self.block_table.repeat_interleave(q_len, dim=0).contiguous()
        self.cu_q = self.query_start_loc

    # ---- the three attentions ------------------------------------------------------------------
    def ours(self, splits: int | None = None, block_kv: int = 16, num_warps: int = 4) -> torch.Tensor:
        from vllm.v1.attention.ops.triton_turboquant_decode import _use_fp8_e4b15

        from vllm_overlay.kernels.tq_verify import tq_verify_attention
        from vllm_overlay.patches.turboquant_spec_decode import kv_splits

        cfg = self.cfg
        b = len(self.lens)
        return tq_verify_attention(
            self.q, self.kv_cache, self.block_table, self.seq_lens, self.query_start_loc,
            max_query_len=self.q_len, scale=self.scale, key_fp8=cfg.key_fp8,
            key_mse_bits=cfg.key_mse_bits, key_packed_size=cfg.key_packed_size,
            value_quant_bits=cfg.effective_value_quant_bits, norm_correction=cfg.norm_correction,
            centroids=self.centroids, PiT=self.hadamard,
            num_kv_splits=splits or kv_splits(b, HK), fp8_e4b15=bool(_use_fp8_e4b15(0)),
            block_kv=block_kv, num_warps=num_warps)

    def vllm_rows(self) -> torch.Tensor:
        from vllm.v1.attention.ops.triton_turboquant_decode import triton_turboquant_decode_attention

        cfg = self.cfg
        return triton_turboquant_decode_attention(
            query=self.q, kv_cache=self.kv_cache, block_table=self.row_table, seq_lens=self.row_lens,
            Pi=self.hadamard, centroids=self.centroids, scale=self.scale, mse_bits=cfg.key_mse_bits,
            key_packed_size=cfg.key_packed_size, value_quant_bits=cfg.effective_value_quant_bits,
            key_fp8=cfg.key_fp8, norm_correction=cfg.norm_correction, PiT=self.hadamard,
            max_num_kv_splits=KV_SPLITS)

    def fa_bf16(self) -> torch.Tensor:
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(
            q=self.q, k=self.k_cache, v=self.v_cache, max_seqlen_q=self.q_len, cu_seqlens_q=self.cu_q,
            max_seqlen_k=max(self.lens), seqused_k=self.seq_lens, softmax_scale=self.scale, causal=True,
            block_table=self.block_table, fa_version=2)

    # ---- references ----------------------------------------------------------------------------
    def reference(self, dequantized: bool) -> torch.Tensor:
        import tq_reference as ref  # bench/tq_reference.py, next to this script

        outs = []
        prec = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")  # a true fp32 reference: no TF32
        try:
            for i, n in enumerate(self.lens):
                qi = self.q[i * self.q_len:(i + 1) * self.q_len]
                if dequantized:
                    pos = torch.arange(n, device=self.q.device)
                    slots = self.kv_cache[self.block_table[i, pos // BLOCK].long(), pos % BLOCK]
                    k, v = ref.unpack(slots, DIM, key_fp8=True, key_mse_bits=0, value_bits=4)
                else:
                    k, v = self.ks[i], self.vs[i]
                outs.append(ref.verify_attention(qi, k, v, self.scale))
        finally:
            torch.set_float32_matmul_precision(prec)
        return torch.cat(outs)


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    out, ref = out.float(), ref.float()
    d = out.shape[-1]
    rows = torch.nn.functional.cosine_similarity(out.reshape(-1, d), ref.reshape(-1, d), dim=1)
    return {"rel_err": ((out - ref).norm() / ref.norm()).item(),
            "max_abs_err": (out - ref).abs().max().item(),
            "cosine": torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item(),
            "min_row_cosine": rows.min().item(),
            "finite": bool(torch.isfinite(out).all().item())}


def accuracy(q_len: int, lens: list[int] = ACCURACY_LENS) -> dict[str, Any]:
    batch = Batch(lens, q_len, seed=q_len)
    ours = batch.ours()
    if ours.is_cuda:
        torch.cuda.synchronize()
    raw, deq = batch.reference(False), batch.reference(True)
    entry: dict[str, Any] = {"q_len": q_len, "seq_lens": lens, "num_kv_heads": HK, "num_q_heads": HQ,
                             "head_dim": DIM, "block_size": BLOCK,
                             "vs_bf16_kv": compare(ours, raw), "vs_dequantized_cache": compare(ours, deq)}
    try:
        entry["vllm_single_query_per_row_vs_ours"] = compare(batch.vllm_rows(), ours)
        entry["vllm_single_query_per_row_vs_bf16_kv"] = compare(batch.vllm_rows(), raw)
    except Exception as exc:  # noqa: BLE001 - recorded, the rest still runs
        entry["vllm_single_query_per_row_error"] = f"{type(exc).__name__}: {exc}"[:400]
    try:
        entry["fa_bf16_vs_bf16_kv"] = compare(batch.fa_bf16(), raw)  # the floor: a bf16 cache
    except Exception as exc:  # noqa: BLE001
        entry["fa_bf16_error"] = f"{type(exc).__name__}: {exc}"[:400]
    if batch.q.is_cuda:
        entry["cuda_graph_replay"] = graph_replay(batch)
    return entry


def graph_replay(batch: Batch) -> dict[str, Any]:
    """Capture the kernel once, change the lengths in place (as vLLM does before a replay), replay:
    the result must equal an eager launch on the new lengths."""
    splits = 8
    static_out = batch.ours(splits)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = batch.ours(splits)
    shorter = torch.clamp(batch.seq_lens - 301, min=batch.q_len)
    batch.seq_lens.copy_(shorter)
    graph.replay()
    torch.cuda.synchronize()
    eager = batch.ours(splits)
    torch.cuda.synchronize()
    diff = (static_out.float() - eager.float()).abs().max().item()
    batch.seq_lens.copy_(torch.tensor(batch.lens, dtype=torch.int32, device=batch.seq_lens.device))
    return {"max_abs_diff_replay_vs_eager": diff, "seq_lens_replayed": shorter.tolist()}


def time_graph(fn: Callable[[], Any], reps: int) -> dict[str, float]:
    """Median of single CUDA-graph replays of fn (as the verify step runs under full graphs)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    return {"median_us": statistics.median(times), "min_us": min(times), "max_us": max(times), "n": reps}


def timing(streams: int, ctx: int, q_len: int, reps: int, variants: bool = False) -> dict[str, Any]:
    batch = Batch([ctx] * streams, q_len, seed=100 + streams)
    entry: dict[str, Any] = {"streams": streams, "context": ctx, "q_len": q_len}
    for name, fn in (("tq_verify_ours", batch.ours), ("tq_vllm_single_query_per_row", batch.vllm_rows),
                     ("bf16_flash_attn2", batch.fa_bf16)):
        try:
            entry[name] = time_graph(fn, reps)
        except Exception as exc:  # noqa: BLE001 - recorded, the rest still runs
            entry[name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
    if variants:  # launch settings of the same kernel, to tune the defaults (block_kv 16, 4 warps)
        from vllm_overlay.patches.turboquant_spec_decode import kv_splits

        base = kv_splits(streams, HK)
        entry["tq_verify_ours_splits"] = base
        for bkv, warps, splits in ((16, 8, base), (32, 4, base), (32, 8, base),
                                   (16, 4, max(1, base // 4)), (16, 4, base * 2)):
            key = f"tq_verify_ours_block_kv{bkv}_warps{warps}_splits{splits}"
            try:
                entry[key] = time_graph(lambda: batch.ours(splits, block_kv=bkv, num_warps=warps), reps)
            except Exception as exc:  # noqa: BLE001
                entry[key] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
    ours, fa = entry["tq_verify_ours"], entry["bf16_flash_attn2"]
    if "median_us" in ours and "median_us" in fa:
        entry["ours_over_bf16"] = ours["median_us"] / fa["median_us"]
    del batch
    torch.cuda.empty_cache()
    return entry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "tq-verify-kernel.json"))
    ap.add_argument("--q-lens", nargs="+", type=int, default=[2, 3, 4])
    ap.add_argument("--streams", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--contexts", nargs="+", type=int, default=[2048, 32768])
    ap.add_argument("--timing-q-lens", nargs="+", type=int, default=[4, 2])
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--budget-s", type=float, default=330.0, help="stop starting new measurements after this")
    ap.add_argument("--smoke", action="store_true",
                    help="small contexts, accuracy only (with TQ_VERIFY_BENCH_DEVICE=cpu)")
    args = ap.parse_args()
    if args.smoke:
        global ACCURACY_LENS
        ACCURACY_LENS = [70, 33, 18]
        args.timing_q_lens = []
    elif not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU and vLLM 0.20.2 (export PYTHONPATH=$PWD/src:/tmp/site)")
    import triton
    import vllm

    t0 = time.time()
    doc: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "vllm": vllm.__version__, "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(),
        "settings": {"preset": PRESET, "num_q_heads": HQ, "num_kv_heads": HK, "head_dim": DIM,
                     "block_size": BLOCK, "dtype": "bfloat16", "reps": args.reps,
                     "reference": "fp32 softmax attention, no TF32",
                     "timing": "median of single CUDA-graph replays, CUDA events"},
        "accuracy": [], "timing": [], "errors": [], "complete": False,
    }

    def save() -> None:
        doc["elapsed_s"] = round(time.time() - t0, 1)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)

    for q_len in args.q_lens:
        try:
            e = accuracy(q_len, ACCURACY_LENS)
            doc["accuracy"].append(e)
            a, d = e["vs_bf16_kv"], e["vs_dequantized_cache"]
            print(f"accuracy q_len {q_len}: rel_err vs bf16 K/V {a['rel_err']:.4f} cosine {a['cosine']:.5f}; "
                  f"max abs vs dequantized cache {d['max_abs_err']:.2e}; graph replay diff "
                  f"{e.get('cuda_graph_replay', {}).get('max_abs_diff_replay_vs_eager')}", flush=True)
        except Exception:  # noqa: BLE001
            doc["errors"].append({"step": f"accuracy q_len {q_len}",
                                  "traceback": traceback.format_exc()[-3000:]})
            print(doc["errors"][-1]["traceback"], flush=True)
        save()
    for q_len in args.timing_q_lens:
        for streams in args.streams:
            for ctx in args.contexts:
                if time.time() - t0 > args.budget_s:
                    doc["errors"].append({"step": f"timing {streams}x{ctx} q_len {q_len}",
                                          "traceback": "not started: --budget-s reached"})
                    continue
                try:
                    e = timing(streams, ctx, q_len, args.reps, variants=q_len == args.timing_q_lens[0])
                    doc["timing"].append(e)
                    cells = ", ".join(f"{k} {v['median_us']:.1f} us" for k, v in e.items()
                                      if isinstance(v, dict) and "median_us" in v)
                    print(f"timing {streams} x {ctx} q_len {q_len}: {cells}", flush=True)
                except Exception:  # noqa: BLE001
                    doc["errors"].append({"step": f"timing {streams}x{ctx} q_len {q_len}",
                                          "traceback": traceback.format_exc()[-3000:]})
                    print(doc["errors"][-1]["traceback"], flush=True)
                save()
    doc["complete"] = True
    save()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
