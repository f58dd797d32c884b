"""What zeroing a GDN layer's output costs per forward, against allocating it uninitialised: the work
gdn-output-prealloc saved where vLLM zeroed that output every forward (its fused spec-decode path on
0.34.0, every path before), measured as CUDA time of torch.zeros minus torch.empty from the caching
allocator (as in a forward), for the 35B-A3B geometry's GDN output (32 value heads x 128, bf16, one GPU).

  python3 bench/gdn_zero_cost.py [--tokens 1,16,128,2048,4096,8192] [--layers 30] [--reps 200] [--out FILE]

Prints and writes (JSON) per token count the median and spread of both, and the difference per forward
over --layers GDN layers (the 35B geometry has 30 of its 40 layers as GDN)."""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1000.0)  # us
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,16,128,2048,4096,8192")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = {}
    for n in [int(x) for x in a.tokens.split(",")]:
        shape = (n, a.heads, a.head_dim)
        for _ in range(20):  # the caching allocator holds the block, as in a running server
            torch.zeros(shape, dtype=torch.bfloat16, device=dev)
        z = timed(lambda: torch.zeros(shape, dtype=torch.bfloat16, device=dev), a.reps)
        e = timed(lambda: torch.empty(shape, dtype=torch.bfloat16, device=dev), a.reps)
        mz, me = statistics.median(z), statistics.median(e)
        rows[n] = {"zeros_us": {"median": mz, "min": min(z), "max": max(z)},
                   "empty_us": {"median": me, "min": min(e), "max": max(e)},
                   "bytes": n * a.heads * a.head_dim * 2,
                   "zeroing_us_per_layer": mz - me, "zeroing_us_per_forward": (mz - me) * a.layers}
        print(f"{n:>6} tokens: zeros {mz:8.1f} us (min {min(z):.1f}, max {max(z):.1f}), empty {me:6.1f} us; "
              f"zeroing {mz - me:7.1f} us a layer, {(mz - me) * a.layers / 1000:6.3f} ms a forward of {a.layers} layers")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "reps": a.reps,
           "shape": f"(tokens, {a.heads}, {a.head_dim}) bf16", "layers": a.layers, "tokens": rows}
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
