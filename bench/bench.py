"""Throughput and boot figures for one configuration, one boot (vLLM 0.20.2 on a CUDA GPU).

  python bench/bench.py --model qwen36-35b-a3b-geometry --config overlay --mnbt 8192 --out DIR
      [--kv-cache-dtype turboquant_k8v4] [--cap 4096] [--logprobs]
      [--soak-waves 2000 [--soak-seconds 300]] [--workloads decode-1,band-mix] [--reps 3]

Workloads (each: one warm-up run discarded, then --reps runs; median, min, max):
  decode-1     one stream, 32-token prompt, 256 tokens out
  decode-16    16 streams, 32-token prompts, 256 tokens out each
  prefill-8k   one 8000-token prompt, 1 token out
  band-mix     2500 + 2600 + 2400 + 8 x 64 token prompts queued together, 128 out each
               (TTFT of the three long prompts from the engine's own steps)
  prefill-heavy  12 x 3000 + 8 x 64 token prompts queued together, 16 out each (TTFT of the 12 long)
  mixed-long   8 prompts of 2000, 2200, ..., 3400 + 16 x 64 tokens, 64 out each (TTFT of the 8 long)
               (the two mixes on which stock vLLM 0.20.2 measured 1.46 x and 1.16 x for mnbt 8192
               over 4096 on 2026-11-30)
Also: boot time and vLLM's own "init engine (profile, create kv cache, warmup model)" time, the KV
cache size in tokens, the overlay's load+apply time per process (from its reports); with
--logprobs, the top-20 logprobs of the first generated token for 8 fixed prompts (to compare KV
cache dtypes or configurations across boots: `make_table.py`); with --soak-waves, a band soak through
`vllm_overlay.tools.stress` (each wave: prefills co-scheduled with decodes in one forward in
(4096, 8192]), bounded by --soak-seconds. The soak runs before the timed workloads.

--moe-config-dir DIR (overlay only): the moe-configs patch reads its tuned fused-MoE configs from DIR
(VLLM_OVERLAY_MOE_CONFIG_DIR, where `vllm-overlay tune-moe --out-dir DIR` wrote them); the result
name gains `-moetuned` and records the files DIR held. --breakdown 1,16: after the workloads, in the
same boot, where a decode step's time goes at those stream counts (torch.profiler, kernels by family:
bench/moe_breakdown_h200.py), under "breakdown" in the result.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import statistics
import sys
import time
from typing import Any

import common  # bench/common.py: run as python3 bench/bench.py, Python puts bench/ first on sys.path

CONFIGS = {"overlay": {}, "stock": {"VLLM_OVERLAY": "0"}}

# name -> (prompt lengths, tokens out per prompt, how many prompts at the front are the long ones
# whose time to first token is reported)
WORKLOADS: dict[str, tuple[list[int], list[int], int]] = {
    "decode-1": ([32], [256], 0),
    "decode-16": ([32] * 16, [256] * 16, 0),
    "prefill-8k": ([8000], [1], 0),
    "band-mix": ([2500, 2600, 2400] + [64] * 8, [128] * 11, 3),
    "prefill-heavy": ([3000] * 12 + [64] * 8, [16] * 20, 12),
    "mixed-long": ([2000 + 200 * i for i in range(8)] + [64] * 16, [64] * 24, 8),
}


def stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def run_engine(engine: Any, reqs: list[tuple[str, dict, Any]]) -> tuple[float, dict[str, float], int]:
    """Queue every request, step to completion; (seconds, first-token time per id, tokens out)."""
    t0 = time.perf_counter()
    for rid, prompt, params in reqs:
        engine.add_request(rid, prompt, params)
    first: dict[str, float] = {}
    out_tokens = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.outputs and o.outputs[0].token_ids and o.request_id not in first:
                first[o.request_id] = time.perf_counter() - t0
            if o.finished:
                out_tokens += len(o.outputs[0].token_ids)
    return time.perf_counter() - t0, first, out_tokens


def save(out: str, res: dict[str, Any]) -> None:
    """Write what is measured so far: partial results survive a time limit or a crash."""
    with open(out, "w") as f:
        json.dump(res, f)


def child(out: str, args: argparse.Namespace) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    t_start = time.time()
    cap = common.Capture()  # after importing vLLM, which configures its loggers at import
    logging.getLogger("vllm").addHandler(cap)
    logging.getLogger("vllm_overlay").addHandler(cap)

    res: dict[str, Any] = {"config": args.config, "mnbt": args.mnbt, "model": args.model,
                           "kv_cache_dtype": args.kv_cache_dtype, "profile_run_cap": args.cap}
    if args.moe_config_dir:
        d = os.environ.get("VLLM_OVERLAY_MOE_CONFIG_DIR", "")
        res["moe_config_dir"] = {"path": d, "files": sorted(f for f in os.listdir(d) if f.endswith(".json"))
                                 if os.path.isdir(d) else None}
    t0 = time.time()
    llm = LLM(model=common.model_dir(args.model), load_format="dummy", skip_tokenizer_init=True,
              max_num_batched_tokens=args.mnbt, max_model_len=32768, max_num_seqs=64, dtype="bfloat16",
              gpu_memory_utilization=args.mem, enable_prefix_caching=False, seed=0,
              tensor_parallel_size=args.tp,
              kv_cache_dtype=args.kv_cache_dtype, additional_config={"gdn_prefill_backend": "triton"})
    res["boot_s"] = round(time.time() - t0, 1)
    for line in cap.lines:
        if m := re.search(r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+)", line):
            res["init_engine_s"] = float(m.group(1))
        if m := re.search(r"KV cache size: ([0-9,]+) tokens", line):
            res["kv_cache_tokens"] = int(m.group(1).replace(",", ""))
        if m := re.search(r"Setting attention block size to (\d+) tokens", line):
            res["attention_block_size"] = int(m.group(1))
        if "hybrid-turboquant:" in line or "Using TURBOQUANT" in line:
            res.setdefault("turboquant_lines", []).append(line)
    res["moe_config_log"] = moe_lines(cap.lines)  # the first MoE calls ran in the profiling forward
    save(out, res)
    engine = llm.llm_engine
    n = 0

    def sp(k: int) -> Any:
        return SamplingParams(max_tokens=k, temperature=0, ignore_eos=True, detokenize=False)

    def reqs(lens: list[int], outs: list[int]) -> list[tuple[str, dict, Any]]:
        nonlocal n
        n += 1
        return [(f"r{n}-{i}", p, sp(o)) for i, (p, o) in enumerate(zip(common.prompts(lens, seed=n), outs))]

    if args.logprobs:
        lp_params = SamplingParams(max_tokens=1, temperature=0, logprobs=20, detokenize=False)
        lens = [16, 64, 256, 1024, 2400, 2500, 2600, 4000]
        outs = llm.generate(common.prompts(lens, seed=1234), lp_params, use_tqdm=False)
        res["logprobs"] = [{"prompt_tokens": k, "top": {str(t): lp.logprob for t, lp in o.outputs[0].logprobs[0].items()}}
                           for k, o in zip(lens, outs)]
        save(out, res)
    if args.soak_waves:
        from vllm_overlay.tools.stress import offline
        from vllm_overlay.tools.stress.plan import Limits, make_plan

        plan = dataclasses.replace(make_plan(4096, 8192, Limits(args.mnbt, 32768, 64), args.soak_waves, None,
                                             prefill_out_tokens=1), waves=args.soak_waves)
        t = time.time()
        outcome = offline.run(llm, plan, args.soak_seconds or None, 1, lambda done, total: None)
        res["soak"] = {"plan": plan.describe(), "wall_s": round(time.time() - t, 1),
                       "requests_ok": outcome.requests_ok, "requests_failed": outcome.requests_failed,
                       "engine_error": outcome.engine_error, "errors": outcome.errors[:5]}
        print("soak", json.dumps(res["soak"]), flush=True)
        save(out, res)
        if outcome.engine_error:
            res["ok"] = False
            common.finish_child(out, res)

    res["workloads"] = {}
    for name, (lens, outs, long) in WORKLOADS.items():
        if args.workloads and name not in args.workloads.split(","):
            continue
        run_engine(engine, reqs(lens, outs))  # warm-up: first run of a new shape can be slow
        secs, tps, ttft = [], [], []
        for _ in range(args.reps):
            s, first, toks = run_engine(engine, reqs(lens, outs))
            secs.append(s)
            tps.append(toks / s)
            ttft.extend(v for k, v in first.items() if int(k.split("-")[1]) < long)
        w = {"seconds": stats(secs), "tokens_per_s": stats(tps)}
        if name.startswith("decode"):
            w["ms_per_token_per_stream"] = stats([1000 * s / outs[0] for s in secs])
        if ttft:
            w["ttft_long_prompts_s"] = {"p50": statistics.median(ttft), "p99": max(ttft), "n": len(ttft)}
        res["workloads"][name] = w
        print(name, json.dumps(w), flush=True)
        save(out, res)
    if args.breakdown:
        breakdown(engine, args, res, out, t_start)
    res["moe_config_log"] = moe_lines(cap.lines)
    res["ok"] = True
    common.finish_child(out, res)


def moe_lines(lines: list[str]) -> list[str]:
    """vLLM's and the overlay's log lines on fused-MoE config files (which file each shape used)."""
    return sorted({ln for ln in lines if "MoE config" in ln or "for MoE layer" in ln or "moe-configs:" in ln})


def breakdown(engine: Any, args: argparse.Namespace, res: dict[str, Any], out: str, t_start: float) -> None:
    """Where a decode step's time goes at each --breakdown stream count, in this boot (after the
    workloads): bench/moe_breakdown_h200.py's profile and aggregation, bounded by the child's time."""
    import tempfile
    import traceback

    from vllm import SamplingParams

    import moe_breakdown_h200 as mb

    deadline = t_start + args.timeout - 20
    sampling = SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True, detokenize=False)
    res["breakdown"] = {"steps": args.breakdown_steps, "families": dict(mb.FAMILIES), "by_streams": {}}
    tmp = tempfile.mkdtemp(prefix="bench-breakdown-")
    for i, n in enumerate(args.breakdown):
        if time.time() > deadline - 40:
            res["breakdown"]["by_streams"][str(n)] = {"skipped": "not measured: the run's --timeout was near"}
            continue
        trace = os.path.join(tmp, f"trace-{n}.json")
        try:
            r = mb.decode_profile(engine, sampling, n, args.breakdown_steps, 100 + i, trace, deadline)
        except Exception as exc:  # noqa: BLE001 - keep the other stream counts and the workloads
            r = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)}
        if os.path.exists(trace):
            os.remove(trace)
        res["breakdown"]["by_streams"][str(n)] = r
        print(f"breakdown {n} streams:", json.dumps({k: r.get(k) for k in (
            "wall_ms_per_step", "gpu_busy_ms_per_step", "levers", "error", "problem")}), flush=True)
        save(out, res)


def result_name(args: argparse.Namespace) -> str:
    """bench-MODEL-CONFIG-mnbtN[-KV][-capN][-tpN][-moetuned][-TAG]: an overlay run and the stock run
    with the same settings differ only in CONFIG and -moetuned (make_table pairs them so)."""
    kv = "" if args.kv_cache_dtype == "auto" else f"-{args.kv_cache_dtype.removeprefix('turboquant_')}"
    return (f"bench-{args.model}-{args.config}-mnbt{args.mnbt}{kv}{f'-cap{args.cap}' if args.cap else ''}"
            f"{f'-tp{args.tp}' if args.tp > 1 else ''}{'-moetuned' if args.moe_config_dir else ''}"
            f"{'-' + args.tag.lstrip('-') if args.tag else ''}")


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """One clear error per bad value, naming the option, the value and what is accepted."""
    bad = [w for w in args.workloads.split(",") if w and w not in WORKLOADS] if args.workloads else []
    if bad:
        ap.error(f"--workloads {args.workloads!r}: {bad[0]!r} is not one of {', '.join(WORKLOADS)}")
    raw = args.breakdown
    if isinstance(raw, str):
        try:
            args.breakdown = [int(x) for x in raw.split(",") if x.strip()] if raw.strip() else []
            if any(not 1 <= n <= 64 for n in args.breakdown):
                raise ValueError
        except ValueError:
            ap.error(f"--breakdown {raw!r}: expected comma-separated stream counts in [1, 64] (max_num_seqs 64), "
                     "e.g. 1,16")
    if args.breakdown_steps < 1:
        ap.error(f"--breakdown-steps {args.breakdown_steps}: expected an integer >= 1")
    if args.moe_config_dir:
        if args.config != "overlay":
            ap.error(f"--moe-config-dir with --config {args.config}: the tuned configs are read by the overlay's "
                     "moe-configs patch; expected --config overlay")
        args.moe_config_dir = os.path.abspath(args.moe_config_dir)
        if not args.child and not os.path.isdir(args.moe_config_dir):
            ap.error(f"--moe-config-dir {args.moe_config_dir!r}: not a directory; expected the --out-dir that "
                     "`vllm-overlay tune-moe` wrote")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", default=None)
    ap.add_argument("--model", default="qwen36-35b-a3b-geometry")
    ap.add_argument("--config", choices=tuple(CONFIGS), default="overlay")
    ap.add_argument("--mnbt", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mem", type=float, default=0.9)
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size (NCCL_NVLS_ENABLE=0 is set)")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--cap", type=int, default=0, help="VLLM_OVERLAY_PROFILE_RUN_CAP (0: no cap)")
    ap.add_argument("--logprobs", action="store_true")
    ap.add_argument("--workloads", default="", help="comma-separated subset (default: all)")
    ap.add_argument("--soak-waves", type=int, default=0)
    ap.add_argument("--soak-seconds", type=float, default=0, help="time bound of the soak (0: none)")
    ap.add_argument("--moe-config-dir", default="", metavar="DIR",
                    help="overlay only: tuned fused-MoE configs from DIR (VLLM_OVERLAY_MOE_CONFIG_DIR)")
    ap.add_argument("--breakdown", default="", metavar="STREAMS",
                    help="after the workloads: a profiled decode-step breakdown at these stream counts, e.g. 1,16")
    ap.add_argument("--breakdown-steps", type=int, default=30, help="profiled decode steps per stream count")
    ap.add_argument("--tag", default="", help="suffix of the result file name, e.g. soak2000")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--timeout", type=int, default=560)
    args = ap.parse_args()
    check_args(ap, args)
    if args.child:
        child(args.child, args)
        return
    tag = result_name(args)
    env = {**CONFIGS[args.config], "VLLM_OVERLAY_REPORT_DIR": os.path.join(args.out, f"reports-{tag}")}
    if args.moe_config_dir:
        env["VLLM_OVERLAY_MOE_CONFIG_DIR"] = args.moe_config_dir
    if args.cap:
        env["VLLM_OVERLAY_PROFILE_RUN_CAP"] = str(args.cap)
    if args.tp > 1:
        env["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off, as on the two-H200 host of the recorded TP 2 runs
    fwd = ["--model", args.model, "--config", args.config, "--mnbt", str(args.mnbt), "--reps", str(args.reps),
           "--mem", str(args.mem), "--tp", str(args.tp), "--soak-seconds", str(args.soak_seconds), "--soak-waves", str(args.soak_waves),
           "--kv-cache-dtype", args.kv_cache_dtype, "--cap", str(args.cap), "--workloads", args.workloads,
           "--timeout", str(args.timeout), "--breakdown-steps", str(args.breakdown_steps)]
    if args.breakdown:
        fwd += ["--breakdown", ",".join(map(str, args.breakdown))]
    if args.moe_config_dir:
        fwd += ["--moe-config-dir", args.moe_config_dir]
    if args.logprobs:
        fwd.append("--logprobs")
    log = os.path.join(args.out, f"{tag}.log")
    r = common.run_child(os.path.abspath(__file__), fwd, env, log, args.timeout)
    if os.path.exists(log):  # from the whole log: under tensor parallel the workers log these, not the child
        r.update(common.boot_parts(open(log, errors="replace").read()))
    r.update({"script": "bench/bench.py", "environment": common.environment(),
              "settings": {"compilation": "vLLM default (torch.compile + CUDA graphs)", "gdn_prefill_backend":
                           "triton", "prefix_caching": False, "max_model_len": 32768, "max_num_seqs": 64,
                           "gpu_memory_utilization": args.mem, "weights": "dummy bf16", "mnbt": args.mnbt,
                           "kv_cache_dtype": args.kv_cache_dtype, "profile_run_cap": args.cap or None,
                           "overlay": args.config == "overlay", "reps": args.reps,
                           "tensor_parallel_size": args.tp, "tag": args.tag.lstrip("-") or None,
                           "moe_config_dir": args.moe_config_dir or None,
                           "workloads": {k: {"prompts": v[0], "tokens_out": v[1], "ttft_of_first": v[2]}
                                         for k, v in WORKLOADS.items()
                                         if not args.workloads or k in args.workloads.split(",")}}})
    common.write_result(os.path.join(args.out, f"{tag}.json"), r)


if __name__ == "__main__":
    main()
