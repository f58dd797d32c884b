"""The routed-experts decode kernel against vLLM's fused_experts at 1-4 tokens: time per MoE layer
inside a CUDA graph, the weight-read floor, the fastest launch configs and how the outputs compare.

  export PYTHONPATH=$PWD/src:/tmp/site
  python3 bench/moe_decode_kernel.py [--model qwen36-35b-a3b-geometry] [--tokens 1,2,3,4]
      [--layers 8] [--reps 15] [--budget-s 150] [--out FILE.json] [--no-stock] [--device cuda]

Needs a CUDA GPU with torch and Triton; vLLM (staged, /tmp/site) for the stock side, which is left out
with a line in the file where it cannot be imported. The geometry is the model's MoE (bench/models/NAME.json:
num_experts, num_experts_per_tok, hidden_size, moe_intermediate_size), bf16 weights ~ N(0, 1/K),
seeded. --layers MoE layers of their own weights (1.6 GB a layer on the 35B geometry) each route every
token to top_k distinct experts drawn at random: one CUDA graph runs the layers in turn, so the experts'
weights come from HBM as in a decode step (one layer's experts would fit the L2); time per layer =
replay time over the layers, --reps replays (median, min, max).

Stock: vLLM's ``fused_experts(x, w13, w2, topk_weights, topk_ids)`` as its unquantized MoE method calls
it (its own fused-MoE config lookup; the file it found is recorded). Overlay:
``vllm_overlay.kernels.moe_decode.routed_experts`` with the heuristic configs, then a search per token
count: BLOCK_N x BLOCK_K tiles at 4 warps and 1 stage for the up launch (down at its heuristic), then the
same for down (up at the best), then 2, 4 or 8 warps and 1 or 3 stages around each launch's best, the previous token
count's best timed first; --budget-s bounds the search over all token counts (cut short, said in the file).

Floor: the bytes of the distinct experts a layer reads, over the copy bandwidth measured here (a
device-to-device copy of 2 GiB, read + write). Outputs, each kernel's: against the exact result (float64,
no intermediate rounding) the relative L2 error and the largest error in bf16 steps of the largest exact
value; against the same computation in torch rounded where vLLM rounds, the largest difference in steps
of its largest value and the elements equal; and the overlay against stock: elements bit-equal, largest
difference in steps of stock's largest value (an output sums eight rounded parts, so a count per element
would blow up where the sum is near zero). Per step: times 40 MoE layers (the geometry's).
The file is rewritten after every token count. --device cpu --no-stock (with TRITON_INTERPRET=1 and a small
geometry, e.g. --model tiny-moe-dense) rehearses the script on a CPU: wall-clock loops instead of CUDA graphs,
times that say nothing about a GPU.
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

from serve_measure import stat  # noqa: E402 (bench/serve_measure.py, stdlib only: median, min, max, n)

SPACE_TILES = [(bn, bk) for bn in (1, 2, 4, 8, 16, 32) for bk in (128, 256, 512, 1024) if 512 <= bn * bk <= 16384]


def steps_of_scale(y: Any, ref: Any) -> float:
    """Largest |y - ref| in bf16 steps of the largest |ref| (an output is a sum of eight experts' rounded
    parts: near-zero sums make a per-element count meaningless)."""
    scale = ref.double().abs().max().item()
    _, e = math.frexp(scale) if scale else (0.0, 0)
    return round((y.double() - ref.double()).abs().max().item() / 2.0 ** (e - 8), 3)


def errors(y: Any, ref: Any, rounded: Any) -> dict[str, float]:
    """y against the exact result (relative L2 error; largest error in bf16 steps of the largest |exact|)
    and against the same computation rounded where vLLM rounds (largest difference in steps of its largest
    value; elements equal)."""
    return {"rel_l2_vs_exact": round(((y.double() - ref).norm() / ref.norm()).item(), 6),
            "max_steps_vs_exact": steps_of_scale(y, ref),
            "max_steps_vs_rounded": steps_of_scale(y, rounded),
            "equal_to_rounded_fraction": round((y == rounded).float().mean().item(), 4)}


def as_vllm_rounds(x: Any, w13: Any, w2: Any, wts: Any, ids: Any) -> Any:
    """The routed experts in torch (fp32 products) rounded to bf16 where vLLM's fused_experts rounds: the
    gate and up sums, SiLU-and-mul, each slot's weighted down sum, the sum over slots."""
    import torch

    inter = w13.shape[1] // 2
    out = torch.zeros((x.shape[0], w2.shape[1]), dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            h = (w13[e].float() @ x[t].float()).to(x.dtype).float()
            act = (torch.nn.functional.silu(h[:inter]) * h[inter:]).to(x.dtype).float()
            out[t] += ((w2[e].float() @ act) * float(wts[t, s])).to(x.dtype).float()
    return out.to(x.dtype)


def exact(x: Any, w13: Any, w2: Any, wts: Any, ids: Any) -> Any:
    import torch

    inter = w13.shape[1] // 2
    out = torch.zeros((x.shape[0], w2.shape[1]), dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            h = w13[e].double() @ x[t].double()
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += float(wts[t, s]) * (w2[e].double() @ act)
    return out


def wall_call_times_us(calls: list[Callable[[], Any]], reps: int) -> list[float]:
    """The CPU rehearsal's timer: each pass over the calls, wall clock, over the calls."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for c in calls:
            c()
        out.append((time.perf_counter() - t0) * 1e6 / len(calls))
    return out


def copy_bandwidth(torch: Any, device: str, timer: Callable[..., list[float]]) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    n = 1 << (30 if device == "cuda" else 22)  # 2 GiB of bf16 on a GPU
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    us = statistics.median(timer([lambda: dst.copy_(src)] * 4, 9))
    del src, dst
    return 2 * 2 * n / (us * 1e-6)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen36-35b-a3b-geometry")
    ap.add_argument("--tokens", default="1,2,3,4")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-stock", action="store_true", help="leave vLLM's fused_experts out")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: rehearse the script (TRITON_INTERPRET=1, a small --model)")
    a = ap.parse_args(argv)
    tokens = [int(t) for t in a.tokens.split(",")]
    out_path = a.out or os.path.join(os.environ.get("OUT") or os.path.join(HERE, "results"),
                                     f"moe-decode-kernel-{a.model}.json")

    import torch
    import triton

    from vllm_overlay.kernels.moe_decode import MAX_TOKENS, Config, heuristic, routed_experts
    from vllm_overlay.tools.tune.gemv_cuda import graph_call_times_us

    dev = a.device
    if dev == "cpu":
        graph_call_times_us = wall_call_times_us  # noqa: F811 (the rehearsal's timer)
    if any(not 1 <= t <= MAX_TOKENS for t in tokens):
        ap.error(f"--tokens {a.tokens}: each must be 1 to {MAX_TOKENS}")
    cfg = json.load(open(os.path.join(HERE, "models", f"{a.model}.json")))
    E, K_TOP = cfg["num_experts"], cfg["num_experts_per_tok"]
    H, I = cfg["hidden_size"], cfg["moe_intermediate_size"]
    moe_layers = cfg["num_hidden_layers"]
    if dev == "cuda":
        props = torch.cuda.get_device_properties(0)
        device_name, sms = props.name, props.multi_processor_count
    else:
        device_name, sms = "cpu (rehearsal)", os.cpu_count() or 1
    res: dict[str, Any] = {
        "what": "routed experts of one MoE layer at 1-4 tokens: vLLM fused_experts vs vllm_overlay moe_decode",
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": device_name, "sms": sms, "python": platform.python_version(),
        "versions": {"torch": torch.__version__, "triton": triton.__version__},
        "geometry": {"model": a.model, "experts": E, "top_k": K_TOP, "hidden": H, "intermediate": I,
                     "moe_layers_per_step": moe_layers},
        "method": {"layers": a.layers, "reps": a.reps, "budget_s": a.budget_s},
        "tokens": {},
    }

    def save() -> None:
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path + ".tmp", "w") as f:
            json.dump(res, f, indent=1)
        os.replace(out_path + ".tmp", out_path)

    fused_experts: Callable[..., Any] | None = None
    if a.no_stock:
        res["stock_left_out"] = "--no-stock"
    else:
        try:
            import vllm
            from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts
            from vllm.platforms import current_platform

            current_platform.import_kernels()  # vLLM's CUDA ops (a serving process loads them at start-up)
            res["versions"]["vllm"] = vllm.__version__
        except Exception as exc:  # noqa: BLE001 (recorded: the stock side is left out)
            res["stock_left_out"] = f"vLLM's fused_experts could not be imported: {type(exc).__name__}: {exc}"
            print(f"moe-decode-kernel: {res['stock_left_out']}", file=sys.stderr)

    res["copy_bandwidth_gbs"] = round(copy_bandwidth(torch, dev, graph_call_times_us) / 1e9, 1)
    save()
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = [(torch.randn((E, 2 * I, H), device=dev, generator=g) / H ** 0.5).to(torch.bfloat16)
           for _ in range(a.layers)]
    w2 = [(torch.randn((E, H, I), device=dev, generator=g) / I ** 0.5).to(torch.bfloat16) for _ in range(a.layers)]
    expert_bytes = (2 * I * H + H * I) * 2
    deadline = time.monotonic() + a.budget_s
    cpu = torch.Generator().manual_seed(1)

    prev: tuple[Any, Any] | None = None
    for m in tokens:
        x = torch.randn((m, H), device=dev, generator=g).to(torch.bfloat16)
        ids = [torch.stack([torch.randperm(E, generator=cpu)[:K_TOP] for _ in range(m)]).to(torch.int32).to(dev)
               for _ in range(a.layers)]
        wts = [torch.softmax(torch.randn((m, K_TOP), generator=cpu), -1).to(dev) for _ in range(a.layers)]
        distinct = statistics.mean(len(set(i.flatten().tolist())) for i in ids)
        floor_us = distinct * expert_bytes / (res["copy_bandwidth_gbs"] * 1e9) * 1e6
        row: dict[str, Any] = {"distinct_experts_per_layer": distinct, "floor_us": round(floor_us, 2)}
        res["tokens"][str(m)] = row
        outs = [torch.empty((m, H), dtype=torch.bfloat16, device=dev) for _ in range(a.layers)]

        def overlay_calls(up: Any, down: Any) -> list[Callable[[], Any]]:
            return [(lambda l=l: routed_experts(x, w13[l], w2[l], wts[l], ids[l], up, down, out=outs[l]))
                    for l in range(a.layers)]

        ref = exact(x, w13[0], w2[0], wts[0], ids[0])
        rounded = as_vllm_rounds(x, w13[0], w2[0], wts[0], ids[0])
        if fused_experts is not None:
            try:
                stock_out = fused_experts(x, w13[0], w2[0], wts[0], ids[0])
                t = graph_call_times_us([(lambda l=l: fused_experts(x, w13[l], w2[l], wts[l], ids[l]))
                                         for l in range(a.layers)], a.reps)
                row["stock_us"] = stat(t)
                row["stock_error"] = errors(stock_out, ref, rounded)
            except Exception:  # noqa: BLE001 (recorded)
                row["stock_failed"] = traceback.format_exc()[-3000:]
                stock_out = None
        else:
            stock_out = None

        up_h, down_h = heuristic(I, H, m * K_TOP, sms), heuristic(H, I, m, sms)
        timed: dict[tuple[Any, Any], float] = {}
        failed: list[str] = []

        def time_pair(up: Any, down: Any) -> float | None:
            key = (up, down)
            if key not in timed:
                try:
                    timed[key] = statistics.median(graph_call_times_us(overlay_calls(up, down), a.reps))
                except Exception as exc:  # noqa: BLE001 (a config that does not compile or run is listed)
                    failed.append(f"up {up.as_list()} down {down.as_list()}: {type(exc).__name__}: {str(exc)[:200]}")
                    return None
            return timed[key]

        h_us = time_pair(up_h, down_h)
        row["overlay_heuristic"] = {"up": up_h.as_list(), "down": down_h.as_list(),
                                    "us": None if h_us is None else round(h_us, 2)}
        best_up, best_down = up_h, down_h
        if prev is not None:  # the previous token count's best, timed first: a cut search keeps what it found
            us = time_pair(*prev)
            if us is not None and (h_us is None or us < h_us):
                best_up, best_down = prev
        cut = False
        for which in ("up", "down"):
            cands = [Config(bn, bk, 4, 1) for bn, bk in SPACE_TILES if bk <= max(128, 2 * (H if which == "up" else I))]
            for c in cands:
                if time.monotonic() > deadline:
                    cut = True
                    break
                u, d = (c, best_down) if which == "up" else (best_up, c)
                us = time_pair(u, d)
                if us is not None and us < (time_pair(best_up, best_down) or float("inf")):
                    best_up, best_down = u, d
        for which in ("up", "down"):
            base = best_up if which == "up" else best_down
            for w in (2, 4, 8):
                for s in (1, 3):
                    if time.monotonic() > deadline:
                        cut = True
                        break
                    c = Config(base.block_n, base.block_k, w, s)
                    u, d = (c, best_down) if which == "up" else (best_up, c)
                    us = time_pair(u, d)
                    if us is not None and us < (time_pair(best_up, best_down) or float("inf")):
                        best_up, best_down = u, d
        prev = (best_up, best_down)
        best_t = graph_call_times_us(overlay_calls(best_up, best_down), a.reps)
        ov_out = routed_experts(x, w13[0], w2[0], wts[0], ids[0], best_up, best_down)
        row["overlay_best"] = {"up": best_up.as_list(), "down": best_down.as_list(), "us": stat(best_t),
                               "configs_timed": len(timed), "failed": failed[:10], "search_cut_by_budget": cut}
        row["overlay_error"] = errors(ov_out, ref, rounded)
        if stock_out is not None:
            row["overlay_vs_stock"] = {"bit_equal_fraction": round((ov_out == stock_out).float().mean().item(), 4),
                                       "max_steps_of_scale": steps_of_scale(ov_out, stock_out)}
            s_med, o_med = row["stock_us"]["median"], row["overlay_best"]["us"]["median"]
            row["stock_over_overlay"] = round(s_med / o_med, 3)
            row["per_step_ms"] = {"stock": round(s_med * moe_layers / 1000, 3),
                                  "overlay": round(o_med * moe_layers / 1000, 3),
                                  "floor": round(floor_us * moe_layers / 1000, 3)}
        else:
            row["per_step_ms"] = {"overlay": round(row["overlay_best"]["us"]["median"] * moe_layers / 1000, 3),
                                  "floor": round(floor_us * moe_layers / 1000, 3)}
        save()
        print(f"moe-decode-kernel: {m} token(s): " + json.dumps({k: row.get(k) for k in
              ("floor_us", "stock_us", "overlay_heuristic", "stock_over_overlay", "per_step_ms")}), flush=True)
    if fused_experts is not None:
        try:
            from vllm.model_executor.layers.fused_moe import fused_moe as fm

            res["stock_config"] = {"file": fm.get_config_file_name(E, I, None),
                                   "found": fm.get_moe_configs(E, I, None) is not None}
        except Exception as exc:  # noqa: BLE001 (recorded)
            res["stock_config"] = f"{type(exc).__name__}: {exc}"
    save()
    print(f"moe-decode-kernel: wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
