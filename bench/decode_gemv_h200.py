"""One-row GEMV against cuBLAS on a model's dense projection shapes: time per call inside a CUDA
graph, the kernel config that is fastest per shape, and how the outputs compare.

  python3 bench/decode_gemv_h200.py [--model qwen36-35b-a3b-geometry] [--out FILE.json]
      [--write-configs FILE.json] [--reps 7] [--budget-s 240]

Needs a CUDA GPU with torch and Triton (not vLLM). The shapes are the unquantized linear layers of
one decode step of the model (bench/models/NAME.json, a Qwen3-Next config): per GDN layer
in_proj_qkvz, in_proj_ba and out_proj, per full-attention layer qkv_proj (gated query) and o_proj,
per layer the MoE router gate and the shared expert's gate_up, down and gate. (vLLM 0.33.0's router
gate, GateLinear, runs its own GEMM kernels where they are available and this linear method otherwise:
in the served runs of 2026-12-05 it took the GEMV.)

Per shape: the weight is copied until the copies hold at least --min-mib (default 512 MiB, ten
times the H200's L2) so the calls read HBM as a decode step does (copies are capped at 4096, so the
smallest weights stay in L2: they are latency-bound either way); one CUDA graph holds a sequence of
calls cycling over the copies; its replays are timed with CUDA events, the time per call is the
replay time over the calls, --reps replays (median, min, max). cuBLAS is torch.nn.functional.linear
captured the same way (with any split-K reduction kernel it launches). The GEMV's configs are
searched in two rounds: tile shapes at 4 warps and 1 stage, then warps and stages around the best
three. --budget-s bounds the search (the second round is cut short past it, said on stderr).

Outputs: x ~ N(0, 1), W ~ N(0, 1/K) in bf16 (seeded). Counted: elements bit-equal to cuBLAS's, the
largest difference from cuBLAS in bf16 steps of the reference value, and each kernel's largest
error against the exact (float64) product in those steps (0.5 is correctly rounded).

The config table (--write-configs) is the file `VLLM_OVERLAY_DECODE_GEMV_CONFIGS` reads:
{"devices": {DEVICE NAME: {"NxK": [BLOCK_N, BLOCK_K, num_warps, num_stages]}}}, the fastest config
per shape, or "cublas" where no config beat cuBLAS (that shape keeps torch.nn.functional.linear).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if not __package__:  # run as python3 bench/decode_gemv_h200.py: this checkout's src/ before any installed copy
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))


def shapes(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """The model's unquantized decode projections: name, N, K and how many per step."""
    h = cfg["hidden_size"]
    kinds = cfg.get("layer_types") or []
    gdn = sum(1 for t in kinds if t == "linear_attention")
    attn = sum(1 for t in kinds if t == "full_attention")
    layers = cfg["num_hidden_layers"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    sh = cfg.get("shared_expert_intermediate_size") or 0
    out = [
        {"name": "in_proj_qkvz", "n": 2 * nk * dk + 2 * nv * dv, "k": h, "per_step": gdn},
        {"name": "in_proj_ba", "n": 2 * nv, "k": h, "per_step": gdn},
        {"name": "out_proj (GDN)", "n": h, "k": nv * dv, "per_step": gdn},
        {"name": "qkv_proj (gated q)", "n": 2 * nh * hd + 2 * nkv * hd, "k": h, "per_step": attn},
        {"name": "o_proj", "n": h, "k": nh * hd, "per_step": attn},
    ]
    if cfg.get("num_experts"):
        out.append({"name": "router gate", "n": cfg["num_experts"], "k": h, "per_step": layers})
    if sh:
        out += [{"name": "shared_expert gate_up", "n": 2 * sh, "k": h, "per_step": layers},
                {"name": "shared_expert down", "n": h, "k": sh, "per_step": layers},
                {"name": "shared_expert_gate", "n": 1, "k": h, "per_step": layers}]
    merged: dict[tuple[int, int], dict[str, Any]] = {}
    for s in out:  # o_proj and out_proj share a shape: measured once, counted together
        if s["per_step"] <= 0:
            continue
        key = (s["n"], s["k"])
        if key in merged:
            merged[key]["name"] += " + " + s["name"]
            merged[key]["per_step"] += s["per_step"]
        else:
            merged[key] = dict(s)
    return list(merged.values())


class Timer:
    """Calls captured in one CUDA graph, replayed and timed with CUDA events."""

    def __init__(self, reps: int) -> None:
        self.reps = reps

    def per_call_us(self, calls: list[Any]) -> dict[str, float]:
        from vllm_overlay.tools.tune.gemv_cuda import graph_call_times_us

        times = graph_call_times_us(calls, self.reps)
        return {"median": round(statistics.median(times), 3), "min": round(min(times), 3),
                "max": round(max(times), 3)}


def steps_of(ref: Any) -> Any:
    """The bf16 spacing at each reference value (float32 tensor): 2 ** (exponent - 8) for a value
    m * 2 ** exponent with m in [0.5, 1)."""
    import torch

    _, e = torch.frexp(ref.float().abs())
    return torch.ldexp(torch.ones_like(ref, dtype=torch.float32), (e - 8).float()).clamp_min(
        torch.finfo(torch.float32).tiny)


def compare(n: int, k: int, cfg: Any, seed: int) -> dict[str, Any]:
    import torch

    from vllm_overlay.kernels.decode_gemv import gemv

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn((1, k), generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn((n, k), generator=g, device="cuda") / k ** 0.5).to(torch.bfloat16)
    ours = gemv(x, w, None, cfg).float()
    cub = torch.nn.functional.linear(x, w).float()
    exact = torch.nn.functional.linear(x.double(), w.double()).float()
    sp = steps_of(exact)
    return {"elements": n, "bit_equal_to_cublas": int((ours == cub).sum().item()),
            "max_steps_from_cublas": round(((ours - cub).abs() / sp).max().item(), 3),
            "max_steps_from_exact_ours": round(((ours - exact).abs() / sp).max().item(), 3),
            "max_steps_from_exact_cublas": round(((cub - exact).abs() / sp).max().item(), 3)}


def measure_shape(s: dict[str, Any], a: argparse.Namespace, deadline: float, timer: Timer) -> dict[str, Any]:
    import torch

    from vllm_overlay.kernels.decode_gemv import Config, gemv, heuristic
    from vllm_overlay.tools.tune.gemv import round_one, round_two  # the search tune-gemv makes too

    n, k = s["n"], s["k"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    nbytes = n * k * 2
    copies = max(1, min(4096, -(-a.min_mib * 2 ** 20 // nbytes)))
    ws = [torch.randn((n, k), device="cuda").to(torch.bfloat16) for _ in range(copies)]
    x = torch.randn((1, k), device="cuda").to(torch.bfloat16)
    calls_n = max(copies, a.calls)
    order = [ws[i % copies] for i in range(calls_n)]

    def time_cfg(cfg: Config) -> dict[str, float] | None:
        try:
            gemv(x, ws[0], None, cfg)  # compile outside the capture
            return timer.per_call_us([lambda w=w: gemv(x, w, None, cfg) for w in order])
        except Exception as exc:  # noqa: BLE001 - a config that does not compile or run is skipped, said
            print(f"  {s['name']}: config {cfg.as_list()} failed: {type(exc).__name__}: {str(exc)[:200]}",
                  file=sys.stderr, flush=True)
            torch.cuda.synchronize()
            return None

    res: dict[str, Any] = dict(s, bytes=nbytes, copies=copies, calls_per_graph=calls_n)
    res["cublas_us"] = timer.per_call_us([lambda w=w: torch.nn.functional.linear(x, w) for w in order])
    tried: dict[tuple[int, int, int, int], dict[str, float]] = {}
    heur = heuristic(n, k, sms)
    failed: list[list[int]] = []

    def attempt(c: tuple[int, int, int, int]) -> None:
        t = time_cfg(Config(*c))
        if t is None:
            failed.append(list(c))
        else:
            tried[c] = t

    for c in [tuple(heur.as_list())] + round_one(k):
        if c not in tried and list(c) not in failed:
            attempt(c)
    if not tried:
        raise RuntimeError(f"{s['name']} (N={n}, K={k}): no GEMV config ran (see the lines above)")
    cut = False
    for c in round_two(sorted(tried, key=lambda c: tried[c]["median"])[:3]):
        if c in tried or list(c) in failed:
            continue
        if time.time() > deadline:
            cut = True
            break
        attempt(c)
    best = min(tried, key=lambda c: tried[c]["median"])
    res["heuristic"] = {"config": list(heur.as_list()), "us": tried.get(tuple(heur.as_list()))}
    res["failed_configs"] = failed
    res["best"] = {"config": list(best), "us": tried[best]}
    res["search_cut_by_budget"] = cut
    res["tried"] = {",".join(map(str, c)): t["median"] for c, t in sorted(tried.items())}
    res["speedup_vs_cublas"] = round(res["cublas_us"]["median"] / tried[best]["median"], 3)
    res["tb_per_s"] = {"cublas": round(nbytes / res["cublas_us"]["median"] / 1e6, 3),
                       "ours": round(nbytes / tried[best]["median"] / 1e6, 3)}
    res["numerics"] = compare(n, k, Config(*best), seed=a.seed)
    del ws
    torch.cuda.empty_cache()
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen36-35b-a3b-geometry",
                   help="bench/models/NAME.json or a path to a Qwen3-Next config.json")
    p.add_argument("--out", default=None, help="result JSON (default: print only)")
    p.add_argument("--write-configs", default=None, metavar="FILE.json",
                   help="write the fastest config per shape for this device (VLLM_OVERLAY_DECODE_GEMV_CONFIGS)")
    p.add_argument("--reps", type=int, default=7, help="timed replays per measurement (median, min, max)")
    p.add_argument("--calls", type=int, default=200, help="calls per CUDA graph (at least one per weight copy)")
    p.add_argument("--min-mib", type=int, default=512, help="weight copies per shape hold at least this much")
    p.add_argument("--budget-s", type=float, default=240.0, help="the second search round stops past this")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    for name, v, lo in (("--reps", a.reps, 1), ("--calls", a.calls, 1), ("--min-mib", a.min_mib, 1)):
        if v < lo:
            p.error(f"{name} {v}: expected an integer >= {lo}")
    if a.budget_s <= 0:
        p.error(f"--budget-s {a.budget_s}: expected seconds > 0")
    path = a.model if os.path.isfile(a.model) else os.path.join(HERE, "models", f"{a.model}.json")
    if not os.path.isfile(path):
        p.error(f"--model {a.model}: no such file {path} (expected bench/models/NAME.json or a config.json path)")
    cfg = json.load(open(path))
    if cfg.get("model_type") != "qwen3_next":
        p.error(f"--model {a.model}: model_type {cfg.get('model_type')!r}: expected a qwen3_next config")

    import torch

    if not torch.cuda.is_available():
        print("decode_gemv_h200: no CUDA device here (this benchmark times kernels on a GPU)", file=sys.stderr)
        return 2
    import triton

    started = time.time()
    deadline = started + a.budget_s
    timer = Timer(a.reps)
    props = torch.cuda.get_device_properties(0)
    out: dict[str, Any] = {
        "script": "bench/decode_gemv_h200.py", "model": a.model,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
        "triton": triton.__version__, "settings": {k: v for k, v in vars(a).items() if k not in ("out",)},
        "shapes": [],
    }
    for s in shapes(cfg):
        t0 = time.time()
        print(f"{s['name']}: N={s['n']} K={s['k']}, {s['per_step']} per step ...", flush=True)
        r = measure_shape(s, a, deadline, timer)
        out["shapes"].append(r)
        print(f"{r['name']:<40} N={r['n']:>6} K={r['k']:>5} x{r['per_step']:<3} cuBLAS {r['cublas_us']['median']:7.2f} us "
              f"({r['tb_per_s']['cublas']:.2f} TB/s)  GEMV {r['best']['us']['median']:7.2f} us "
              f"({r['tb_per_s']['ours']:.2f} TB/s) {r['best']['config']}  x{r['speedup_vs_cublas']:.2f}  "
              f"bit-equal {r['numerics']['bit_equal_to_cublas']}/{r['numerics']['elements']}  "
              f"[{time.time() - t0:.0f} s]", flush=True)
    per_step = {"cublas_us": round(sum(r["cublas_us"]["median"] * r["per_step"] for r in out["shapes"]), 1),
                "gemv_us": round(sum(min(r["best"]["us"]["median"], r["cublas_us"]["median"]) * r["per_step"]
                                     for r in out["shapes"]), 1),
                "gemv_heuristic_us": round(sum((r["heuristic"]["us"] or r["best"]["us"])["median"] * r["per_step"]
                                               for r in out["shapes"]), 1)}
    per_step["saved_us"] = round(per_step["cublas_us"] - per_step["gemv_us"], 1)
    out["per_step"] = per_step
    out["seconds"] = round(time.time() - started, 1)
    print(f"per decode step (these shapes, calls in graphs, one after another): cuBLAS {per_step['cublas_us']} us, "
          f"GEMV where faster {per_step['gemv_us']} us (heuristic configs {per_step['gemv_heuristic_us']} us), "
          f"{per_step['saved_us']} us less; {out['seconds']} s", flush=True)
    if a.write_configs:
        table = {"about": f"written by bench/decode_gemv_h200.py on {out['date_utc']} ({props.name}, torch "
                          f"{torch.__version__}, Triton {triton.__version__})",
                 "devices": {props.name: {f"{r['n']}x{r['k']}": r["best"]["config"] if r["speedup_vs_cublas"] > 1.0
                                          else "cublas" for r in out["shapes"]}}}
        os.makedirs(os.path.dirname(os.path.abspath(a.write_configs)), exist_ok=True)
        with open(a.write_configs, "w") as f:
            json.dump(table, f, indent=1)
        print("wrote", a.write_configs, flush=True)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
        print("wrote", a.out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
