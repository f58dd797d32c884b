"""Where one decode step's time goes: a torch.profiler trace of decode on the 35B geometry, at 1 and
16 streams, with CUDA graphs on (vLLM's default compilation), aggregated by kernel family.

  python bench/moe_breakdown_h200.py [--model qwen36-35b-a3b-geometry] [--config overlay|stock]
      [--streams 1,16] [--steps 30] [--out DIR] [--timeout 530] [--keep-trace] [--moe-config-dir DIR]

Runs on a CUDA machine with vLLM 0.20.2 (staged with PYTHONPATH=/tmp/site, as bench.py) in one
child process (an in-process engine: VLLM_ENABLE_V1_MULTIPROCESSING=0, so the profiler sees the
model's kernels), bounded by --timeout (default 530 s: one command of under 9 minutes including the
first boot of the 35B geometry, 130-230 s on an H200). Writes
``moe-breakdown-<model>-<config>.json`` under --out (default: $OUT, else bench/results).

Per stream count: the engine decodes that many streams (32-token prompts, no EOS) until every one
is past its prefill, then --steps engine steps run under torch.profiler. From the trace's GPU
kernels: per family (fused MoE, GDN, full attention, dense GEMMs, norms and small ops, other) the
kernel time per step, its share of the step's wall time, kernel counts and the top kernels; the
GPU-busy time (union of kernel intervals) and the gaps: wall per step minus GPU busy per step (CPU
scheduling, sampling, launch gaps between CUDA graphs). The wall time per step is the median of the
same number of steps run just before without the profiler (its overhead would inflate the gaps), each
step the interval between two returns of engine.step() (no device sync in between, so scheduling
overlaps the previous step as in serving); their mean, min and max and the profiled steps' wall time
are recorded beside it. The "levers" list ranks families by time
per step. Kernel names that match no family are listed under "other" with their times, so a
family can be corrected from the JSON without rerunning. Known ambiguity: the SiLU-and-mul kernel
(act_and_mul) serves both the routed experts inside fused_experts and the dense shared expert, and
Inductor-fused elementwise kernels (triton_poi/red/per_*) of any layer count as "norms and small ops". Also recorded: which fused-MoE config file
vLLM used (its log lines, and the overlay report's moe-configs entries).
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import re
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

if __package__:  # imported as bench.moe_breakdown_h200 (the tests)
    from . import common
else:  # run as python3 bench/moe_breakdown_h200.py (or imported by bench/bench.py): bench/ is on sys.path
    import common  # type: ignore[no-redef]

CONFIGS = {"overlay": {}, "stock": {"VLLM_OVERLAY": "0"}}

# (family, regex on the lower-cased kernel name), first match wins. Order matters: MoE and GDN
# kernels are Triton kernels whose names would also match the generic rules below them.
FAMILIES: tuple[tuple[str, str], ...] = (
    ("fused MoE", r"fused_moe|moe_align|moe_sum|count_and_sort_expert|topkgating|topk_softmax|moe_|_moe"),
    ("GDN (linear attention)", r"gated_delta|delta_rule|fused_recurrent|chunk_|solve_tril|causal_conv1d|"
                               r"gdn|fla_|l2norm|kkt|recompute_w_u|wy_fast|fused_sigmoid_gating"),
    ("full attention", r"flash|fmha|attention|attn|paged|reshape_and_cache|rotary|rope|flashinfer|mla"),
    ("dense GEMMs (projections, shared expert, lm_head)", r"gemm|cutlass|sm90_|sm100_|nvjet|cublas|xmma|"
                                                          r"splitk|ampere_|magma|matmul"),
    ("norms and small ops", r"norm|silu|act_and_mul|gelu|sigmoid|softmax|elementwise|triton_poi|triton_red|"
                            r"triton_per|reduce|copy|memcpy|memset|fill|cat|index|gather|scatter|argmax|"
                            r"sampl|topk|sort|cumsum|embedding|add|mul|div|exp|where|clamp|arange|unrolled"),
)


def family(name: str) -> str:
    return common.kernel_family(name, FAMILIES)


load_trace = common.load_trace


def summarize(trace: dict[str, Any], steps: int, wall_s: float) -> dict[str, Any]:
    """Aggregate a chrome trace's GPU kernels by family, per step."""
    events = trace.get("traceEvents", trace if isinstance(trace, list) else [])
    kernels = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"
               and str(e.get("cat", "")).lower() in ("kernel", "gpu_memcpy", "gpu_memset")]
    graph_launches = sum(1 for e in events if isinstance(e, dict) and "cudaGraphLaunch" in str(e.get("name", "")))
    wall_ms = 1000.0 * wall_s / steps
    out: dict[str, Any] = {"steps": steps, "wall_ms_per_step": round(wall_ms, 4), "kernel_events": len(kernels),
                           "cuda_graph_launches": graph_launches}
    if not kernels:
        out["problem"] = ("no GPU kernel events in the trace: the profiler recorded no kernels "
                          f"({graph_launches} cudaGraphLaunch calls seen); kernels inside CUDA graphs may "
                          "not be traced by this torch/CUPTI")
        return out
    fams: dict[str, dict[str, Any]] = {}
    names: dict[str, list[float]] = {}
    for e in kernels:
        name, dur = str(e.get("name", "?")), float(e.get("dur", 0.0))
        f = fams.setdefault(family(name), {"us": 0.0, "kernels": 0})
        f["us"] += dur
        f["kernels"] += 1
        names.setdefault(name, [0.0, 0])
        names[name][0] += dur
        names[name][1] += 1
    # GPU busy = union of kernel intervals (streams can overlap)
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in kernels)
    busy, cur_s, cur_e = 0.0, spans[0][0], spans[0][1]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    window_us = spans[-1][1] - spans[0][0]
    busy_ms = busy / 1000.0 / steps
    families = {}
    for fam, f in sorted(fams.items(), key=lambda kv: -kv[1]["us"]):
        ms = f["us"] / 1000.0 / steps
        top = sorted(((n, v) for n, v in names.items() if family(n) == fam), key=lambda kv: -kv[1][0])[:8]
        families[fam] = {"ms_per_step": round(ms, 4), "share_of_wall": round(ms / wall_ms, 4) if wall_ms else None,
                         "kernels_per_step": round(f["kernels"] / steps, 1),
                         "top": [{"name": n[:160], "ms_per_step": round(v[0] / 1000.0 / steps, 4),
                                  "calls_per_step": round(v[1] / steps, 1)} for n, v in top]}
    gaps_ms = max(0.0, wall_ms - busy_ms)
    families["gaps (wall minus GPU busy)"] = {"ms_per_step": round(gaps_ms, 4),
                                              "share_of_wall": round(gaps_ms / wall_ms, 4) if wall_ms else None}
    out.update({
        "gpu_busy_ms_per_step": round(busy_ms, 4),
        "gpu_idle_inside_kernel_window_ms_per_step": round((window_us - busy) / 1000.0 / steps, 4),
        "families": families,
        "levers": [{"family": fam, "ms_per_step": v["ms_per_step"], "share_of_wall": v["share_of_wall"]}
                   for fam, v in sorted(families.items(), key=lambda kv: -kv[1]["ms_per_step"])],
    })
    return out


def decode_profile(engine: Any, sampling: Any, streams: int, steps: int, tag: int, trace_path: str,
                   deadline: float) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()  # without CUDA (the CPU build's rehearsal) the trace has no kernels

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    ids = [f"s{tag}-{i}" for i in range(streams)]
    for rid, p in zip(ids, common.prompts([32] * streams, seed=tag)):
        engine.add_request(rid, p, sampling)
    produced: dict[str, int] = {}
    warm = 0
    while min((produced.get(r, 0) for r in ids), default=0) < 3 and warm < 400:  # every stream past prefill
        for o in engine.step():
            produced[o.request_id] = len(o.outputs[0].token_ids) if o.outputs else 0
        warm += 1
        if time.time() > deadline:
            raise TimeoutError(f"{streams} streams: not all decoding after {warm} steps before the deadline")
    for _ in range(5):  # a few plain decode steps: the steady state
        engine.step()
    sync()
    # the step's wall time without the profiler's own overhead: the interval between consecutive
    # returns of engine.step() (no device sync in between, so vLLM's overlap of scheduling with the
    # previous step stays as in serving), the median (one slow step would move a mean)
    plain = []
    t_last = time.perf_counter()
    for _ in range(steps):
        engine.step()
        now = time.perf_counter()
        plain.append(now - t_last)
        t_last = now
    sync()
    wall_plain = statistics.median(plain) * steps
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities, record_shapes=False) as prof:
        t0 = time.perf_counter()
        sizes = []
        for _ in range(steps):
            outs = engine.step()
            sizes.append(sum(1 for o in outs if o.request_id in ids))
        sync()
        wall = time.perf_counter() - t0
    prof.export_chrome_trace(trace_path)
    res = summarize(load_trace(trace_path), steps, wall_plain)
    res["streams"] = streams
    res["wall_ms_per_step_under_profiler"] = round(1000.0 * wall / steps, 4)
    res["wall_ms_per_step_plain"] = {"median": round(1000.0 * statistics.median(plain), 4),
                                     "mean": round(1000.0 * sum(plain) / steps, 4),
                                     "min": round(1000.0 * min(plain), 4), "max": round(1000.0 * max(plain), 4)}
    res["outputs_per_step"] = sorted(set(sizes))
    res["warmup_steps"] = warm
    try:
        engine.abort_request(ids)
    except Exception:  # noqa: BLE001 - some finished already: abort one by one
        for rid in ids:
            try:
                engine.abort_request([rid])
            except Exception:  # noqa: BLE001
                pass
    while engine.has_unfinished_requests():
        engine.step()
    return res


def child(out: str, args: argparse.Namespace) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core + worker in this process: one trace
    deadline = time.time() + args.child_budget
    res: dict[str, Any] = {"ok": False, "config": args.config, "model": args.model, "steps": args.steps}
    try:
        from vllm import LLM, SamplingParams

        cap = common.Capture()
        logging.getLogger("vllm").addHandler(cap)
        logging.getLogger("vllm_overlay").addHandler(cap)
        t0 = time.time()
        llm = LLM(model=common.model_dir(args.model), load_format="dummy", skip_tokenizer_init=True,
                  max_num_batched_tokens=8192, max_model_len=4096, max_num_seqs=64, dtype="bfloat16",
                  gpu_memory_utilization=args.mem, enable_prefix_caching=False, seed=0,
                  additional_config={"gdn_prefill_backend": "triton"})
        res["boot_s"] = round(time.time() - t0, 1)
        res["moe_config_log"] = sorted({ln for ln in cap.lines if "MoE config" in ln or "for MoE layer" in ln
                                        or "moe-configs:" in ln})
        sampling = SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True, detokenize=False)
        res["by_streams"] = {}
        tmp = tempfile.mkdtemp(prefix="moe-breakdown-")
        for i, n in enumerate(args.streams):
            if time.time() > deadline - 30:
                res["by_streams"][str(n)] = {"skipped": "not measured: the child's time budget ran out"}
                continue
            trace = os.path.join(tmp, f"trace-{n}.json")
            try:
                r = decode_profile(llm.llm_engine, sampling, n, args.steps, i + 1, trace, deadline)
            except Exception as exc:  # noqa: BLE001 - keep what the other stream counts measured
                r = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)}
            res["by_streams"][str(n)] = r
            print(f"streams {n}:", json.dumps({k: r.get(k) for k in ("wall_ms_per_step", "gpu_busy_ms_per_step",
                                                                    "levers", "error", "problem")}), flush=True)
            if args.keep_trace and os.path.exists(trace):
                with open(trace, "rb") as src, gzip.open(os.path.join(args.out_dir, f"trace-{args.config}-{n}.json.gz"),
                                                         "wb") as dst:
                    dst.write(src.read())
            if os.path.exists(trace):
                os.remove(trace)
            with open(out, "w") as f:
                json.dump(res, f)  # partial results survive a crash or the time limit
        res["moe_config_log"] = sorted({ln for ln in cap.lines if "MoE config" in ln or "for MoE layer" in ln
                                        or "moe-configs:" in ln})
        res["ok"] = all("families" in v for v in res["by_streams"].values())
    except Exception as exc:  # noqa: BLE001
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc(limit=12)
    common.finish_child(out, res)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", default=None)
    ap.add_argument("--model", default="qwen36-35b-a3b-geometry")
    ap.add_argument("--config", choices=tuple(CONFIGS), default="overlay")
    ap.add_argument("--streams", default="1,16", help="comma-separated stream counts (default 1,16)")
    ap.add_argument("--steps", type=int, default=30, help="profiled decode steps per stream count")
    ap.add_argument("--mem", type=float, default=0.9)
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(common.HERE, "results"))
    ap.add_argument("--timeout", type=int, default=530, help="the child's wall limit in seconds")
    ap.add_argument("--keep-trace", action="store_true", help="also write the gzipped traces under --out")
    ap.add_argument("--moe-config-dir", default="", metavar="DIR",
                    help="overlay only: tuned fused-MoE configs from DIR (VLLM_OVERLAY_MOE_CONFIG_DIR)")
    ap.add_argument("--child-budget", type=float, default=500, help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    raw = args.streams
    try:
        args.streams = [int(s) for s in str(raw).split(",")]
        if not args.streams or min(args.streams) < 1 or max(args.streams) > 64:
            raise ValueError
    except ValueError:
        ap.error(f"--streams {raw!r}: expected comma-separated integers in [1, 64] (max_num_seqs is 64)")
    if args.steps < 1:
        ap.error(f"--steps {args.steps}: expected an integer >= 1")
    if args.moe_config_dir and args.config != "overlay":
        ap.error(f"--moe-config-dir with --config {args.config}: the tuned configs are read by the overlay's "
                 "moe-configs patch; expected --config overlay")
    if args.child:
        child(args.child, args)
        return
    os.makedirs(args.out, exist_ok=True)
    tag = f"moe-breakdown-{args.model}-{args.config}{'-moetuned' if args.moe_config_dir else ''}"
    fwd = ["--model", args.model, "--config", args.config, "--streams", ",".join(map(str, args.streams)),
           "--steps", str(args.steps), "--mem", str(args.mem), "--child-budget", str(max(60, args.timeout - 30)),
           "--out-dir", os.path.abspath(args.out)]
    if args.keep_trace:
        fwd.append("--keep-trace")
    env = {**CONFIGS[args.config], "VLLM_OVERLAY_REPORT_DIR": os.path.join(args.out, f"reports-{tag}"),
           "PYTHONUNBUFFERED": "1"}
    if args.moe_config_dir:  # run_child drops the caller's VLLM_OVERLAY_* variables: pass it on here
        env["VLLM_OVERLAY_MOE_CONFIG_DIR"] = os.path.abspath(args.moe_config_dir)
    log = os.path.join(args.out, f"{tag}.log")
    r = common.run_child(os.path.abspath(__file__), fwd, env, log, args.timeout)
    if os.path.exists(log):
        text = open(log, errors="replace").read()
        r.update(common.boot_parts(text))
        r.setdefault("moe_config_log", sorted({m.strip() for m in re.findall(
            r"[^\n]*(?:Using default MoE config|for MoE layer|moe-configs:)[^\n]*", text)})[:20])
    rep_dir = os.path.join(args.out, f"reports-{tag}")
    moe = {}
    if os.path.isdir(rep_dir):
        for name in os.listdir(rep_dir):
            try:
                rep = json.load(open(os.path.join(rep_dir, name)))
            except (OSError, ValueError):
                continue
            moe.update(rep.get("patches", {}).get("moe-configs", {}).get("moe_configs", {}))
    r["moe_configs_report"] = moe
    r.update({"script": "bench/moe_breakdown_h200.py", "environment": common.environment(),
              "settings": {"compilation": "vLLM default (torch.compile + CUDA graphs)", "gdn_prefill_backend": "triton",
                           "prefix_caching": False, "max_model_len": 4096, "max_num_seqs": 64,
                           "max_num_batched_tokens": 8192, "gpu_memory_utilization": args.mem,
                           "weights": "dummy bf16", "overlay": args.config == "overlay", "streams": args.streams,
                           "profiled_steps": args.steps, "prompt_tokens": 32, "families": dict(FAMILIES),
                           "moe_config_dir": os.path.abspath(args.moe_config_dir) if args.moe_config_dir else None}})
    common.write_result(os.path.join(args.out, f"{tag}.json"), r)


if __name__ == "__main__":
    main()
