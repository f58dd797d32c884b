"""Reserved vs measured activation memory, and out-of-memory errors, per configuration (vLLM 0.20.2
on one CUDA GPU; written for the H200 with the Qwen3.6-35B-A3B geometry).

  export PYTHONPATH=/tmp/site   # vLLM 0.20.2 staged there, this package installed with --target
  python3 bench/memory_headroom_h200.py --out DIR [--model qwen36-35b-a3b-geometry]
      [--mnbt 8192,16384] [--cap 0,4096] [--configs stock,cap-only,headroom] [--mem 0.95]
      [--soak-seconds 90] [--timeout 550]

One process and one boot per (mnbt, cap, config, mem); each writes
DIR/memory-headroom-MODEL-mnbtN-capC-CONFIG-memM.json (and its .log). Configurations:
  stock      VLLM_OVERLAY=0 (vLLM alone; only with cap 0)
  cap-only   the overlay with VLLM_OVERLAY_MEMORY_HEADROOM=0 (with cap 0: the overlay without the
             correction; with cap C: profile-run-cap alone, which profiles C tokens)
  headroom   the overlay's defaults (memory-headroom on), with the cap when C > 0
Engine: load_format dummy, bf16, max_model_len 32768, max_num_seqs 64, no prefix caching,
additional_config gdn_prefill_backend triton, torch.compile + CUDA graphs (vLLM's defaults), the
engine core and its worker in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the CUDA
allocator statistics read here are the worker's.

Phases after boot, each with the allocator's peak statistics reset first (torch.cuda
reset_peak_memory_stats / max_memory_allocated / max_memory_reserved):
  band-soak        vllm_overlay.tools.stress waves, each one forward in (mnbt/2, mnbt] (or (cap, mnbt]),
                   bounded by --soak-seconds
  longest-prefill  one prompt of max_model_len - 1 tokens, 1 token out: forwards of mnbt tokens
                   with a context growing to 32767
  split-prefill    64 prompts of mnbt/64 tokens queued together: one forward of mnbt tokens made of
                   many short prefills (the most GDN chunks)
Per phase: activation peak = max_memory_allocated - memory_allocated before the phase, against
what vLLM reserved for activations (the worker's peak_activation_memory, which memory-headroom
raises by what it moved) and, with the overlay, the patch's own measured peak at mnbt; peak device
use = max_memory_reserved + non-torch memory, against the memory vLLM was given
(gpu_memory_utilization x total); an out-of-memory error is recorded with its phase. A phase after
a failed one is not run.

The same question through `vllm serve` is `bench/stack.py series memory` (`bench/memory_serve.py`),
where memory-headroom's own runtime watch gives the worker's peaks per phase. This script boots
in-process, and its max_num_seqs of 64 keeps the per-request GDN states that the series' 1024-request
phases exercise small; it has not run on a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import re
import sys
import time
import traceback
from typing import Any

import common  # bench/common.py: run as python3 bench/memory_headroom_h200.py, Python puts bench/ first on sys.path

MAX_MODEL_LEN = 32768
MAX_NUM_SEQS = 64
CONFIGS = ("stock", "cap-only", "headroom")


def config_env(config: str, cap: int) -> dict[str, str]:
    if config == "stock":
        return {"VLLM_OVERLAY": "0"}
    env = {"VLLM_OVERLAY_PROFILE_RUN_CAP": str(cap)} if cap else {}
    if config == "cap-only":
        env["VLLM_OVERLAY_MEMORY_HEADROOM"] = "0"
    return env


def worker_of(llm: Any) -> Any:
    """The in-process worker (uniprocess executor of vLLM 0.20.2), or None."""
    try:
        return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    except AttributeError:
        return None


def device_state() -> dict[str, int]:
    import torch

    free, total = torch.cuda.mem_get_info()
    reserved = torch.cuda.memory_reserved()
    return {"allocated": torch.cuda.memory_allocated(), "reserved": reserved, "used": total - free,
            "non_torch": total - free - reserved, "total": total}


def is_oom(text: str) -> bool:
    return "out of memory" in text.lower() or "OutOfMemoryError" in text


def phase(name: str, fn: Any, reserved_activation: int | None, predicted: int | None, requested: int | None
          ) -> dict[str, Any]:
    import torch

    torch.cuda.synchronize()
    before = device_state()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    res: dict[str, Any] = {"phase": name, "before": before}
    try:
        res.update(fn() or {})
        res["ok"] = not res.get("engine_error")
    except BaseException as exc:  # noqa: BLE001 - an out-of-memory error is a result
        res.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000], traceback=traceback.format_exc()[-2500:])
    res["seconds"] = round(time.time() - t0, 1)
    try:
        torch.cuda.synchronize()
    except BaseException as exc:  # noqa: BLE001
        res.setdefault("error", f"{type(exc).__name__}: {exc}"[:2000])
    after = device_state()
    peak_alloc, peak_reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    act = peak_alloc - before["allocated"]
    res.update(after=after, peak_allocated=peak_alloc, peak_reserved=peak_reserved, activation_peak=act,
               reserved_activation=reserved_activation, predicted_activation=predicted,
               peak_device_use=peak_reserved + after["non_torch"], requested_memory=requested,
               oom=is_oom(json.dumps([res.get("error"), res.get("engine_error")])))
    if reserved_activation is not None:
        res["activation_peak_within_reserved"] = act <= reserved_activation
        res["activation_gap"] = reserved_activation - act  # < 0: the phase peaked above the reservation
    if predicted is not None:
        res["predicted_minus_measured"] = predicted - act
    if requested is not None:
        res["within_requested"] = res["peak_device_use"] <= requested
    print(name, json.dumps({k: v for k, v in res.items() if k not in ("before", "after", "traceback")}), flush=True)
    return res


def child(out: str, args: argparse.Namespace) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM, SamplingParams

    cap = common.Capture()
    logging.getLogger("vllm").addHandler(cap)
    res: dict[str, Any] = {"config": args.config, "mnbt": args.mnbt, "cap": args.cap, "mem": args.mem,
                           "model": args.model, "phases": []}
    t0 = time.time()
    try:
        llm = LLM(model=common.model_dir(args.model), load_format="dummy", skip_tokenizer_init=True,
                  max_num_batched_tokens=args.mnbt, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
                  dtype="bfloat16", gpu_memory_utilization=args.mem, enable_prefix_caching=False, seed=0,
                  additional_config={"gdn_prefill_backend": "triton"})
    except BaseException as exc:  # noqa: BLE001 - a boot that runs out of memory is a result
        res.update(ok=False, boot_ok=False, error=f"{type(exc).__name__}: {exc}"[:2000],
                   traceback=traceback.format_exc()[-2500:], oom=is_oom(f"{exc}"), boot_s=round(time.time() - t0, 1))
        common.finish_child(out, res)
        return
    res.update(boot_ok=True, boot_s=round(time.time() - t0, 1))
    for line in cap.lines:
        if m := re.search(r"KV cache size: ([0-9,]+) tokens", line):
            res["kv_cache_tokens"] = int(m.group(1).replace(",", ""))
        if m := re.search(r"Available KV cache memory: ([0-9.]+) GiB", line):
            res["available_kv_cache_gib"] = float(m.group(1))
    w = worker_of(llm)
    vllm_numbers = {k: int(getattr(w, k)) for k in ("peak_activation_memory", "available_kv_cache_memory_bytes",
                                                      "non_torch_memory", "requested_memory",
                                                      "cudagraph_memory_estimate") if w is not None and hasattr(w, k)}
    if w is not None:
        if hasattr(w.model_runner, "model_memory_usage"):
            vllm_numbers["model_memory_usage"] = int(w.model_runner.model_memory_usage)
        vllm_numbers["num_gpu_blocks"] = int(w.cache_config.num_gpu_blocks or 0)
    res["vllm"] = vllm_numbers
    try:
        from vllm_overlay.report import STATE

        rec = STATE.patches.get("memory-headroom", {})
        res["memory_headroom"] = {"status": rec.get("status"), "reason": rec.get("reason"),
                                  "not_corrected": rec.get("not_corrected"), "records": rec.get("headroom", [])}
    except Exception:  # noqa: BLE001 - stock: the overlay is off
        res["memory_headroom"] = None
    records = (res.get("memory_headroom") or {}).get("records") or []
    predicted = records[-1]["measured_peak"] if records else None
    reserved = vllm_numbers.get("peak_activation_memory")
    requested = vllm_numbers.get("requested_memory")
    res["idle"] = device_state()
    common.write_result(out, res)

    engine = llm.llm_engine
    counter = itertools.count()

    def run(lens: list[int], max_tokens: int) -> dict[str, Any]:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False)
        n = next(counter)
        for i, p in enumerate(common.prompts(lens, seed=100 + n)):
            engine.add_request(f"p{n}-{i}", p, sp)
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        return {"prompts": len(lens), "prompt_tokens": sum(lens), "steps": steps}

    def band() -> dict[str, Any]:
        import dataclasses

        from vllm_overlay.tools.stress import offline
        from vllm_overlay.tools.stress.plan import Limits, make_plan

        lo = args.cap if 0 < args.cap < args.mnbt else args.mnbt // 2
        plan = make_plan(lo, args.mnbt, Limits(args.mnbt, MAX_MODEL_LEN, MAX_NUM_SEQS), 10_000, None,
                         prefill_out_tokens=1)
        plan = dataclasses.replace(plan, waves=10_000)
        o = offline.run(llm, plan, args.soak_seconds, 1, lambda done, total: None)
        return {"plan": plan.describe(), "waves": len(o.wave_s), "requests_ok": o.requests_ok,
                "requests_failed": o.requests_failed, "engine_error": o.engine_error, "errors": o.errors[:5]}

    phases = (("band-soak", band),
              ("longest-prefill", lambda: run([MAX_MODEL_LEN - 1], 1)),
              ("split-prefill", lambda: run([args.mnbt // MAX_NUM_SEQS] * MAX_NUM_SEQS, 1)))
    for name, fn in phases:
        r = phase(name, fn, reserved, predicted, requested)
        res["phases"].append(r)
        common.write_result(out, res)
        if not r["ok"]:
            break
    res["ok"] = all(p["ok"] for p in res["phases"]) and len(res["phases"]) == len(phases)
    res["oom"] = any(p["oom"] for p in res["phases"])
    res["max_activation_peak"] = max((p["activation_peak"] for p in res["phases"]), default=None)
    torch.cuda.synchronize()
    common.finish_child(out, res)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", default=None)
    ap.add_argument("--model", default="qwen36-35b-a3b-geometry")
    ap.add_argument("--mnbt", default="8192,16384", help="comma-separated max_num_batched_tokens")
    ap.add_argument("--cap", default="0,4096", help="comma-separated VLLM_OVERLAY_PROFILE_RUN_CAP values (0: none)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--mem", default="0.95", help="comma-separated gpu_memory_utilization values")
    ap.add_argument("--soak-seconds", type=float, default=90)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--timeout", type=int, default=550, help="per configuration, seconds")
    args = ap.parse_args()
    if args.child:
        args.mnbt, args.cap, args.mem = int(args.mnbt), int(args.cap), float(args.mem)
        child(args.child, args)
        return
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        ap.error(f"--configs {args.configs!r}: unknown {', '.join(bad)}; expected some of {', '.join(CONFIGS)}")
    runs = [(int(m), int(c), cfg, float(u)) for m in args.mnbt.split(",") for c in args.cap.split(",")
            for cfg in configs for u in args.mem.split(",") if not (cfg == "stock" and int(c))]
    summary = []
    for mnbt, cap, cfg, mem in runs:
        tag = f"memory-headroom-{args.model}-mnbt{mnbt}-cap{cap}-{cfg}-mem{mem}"
        env = {**config_env(cfg, cap), "VLLM_OVERLAY_REPORT_DIR": os.path.join(args.out, f"reports-{tag}")}
        fwd = ["--model", args.model, "--config", cfg, "--mnbt", str(mnbt), "--cap", str(cap), "--mem", str(mem),
               "--soak-seconds", str(args.soak_seconds)]
        print(f"== {tag}", flush=True)
        r = common.run_child(os.path.abspath(__file__), fwd, env, os.path.join(args.out, f"{tag}.log"), args.timeout)
        r.update({"script": "bench/memory_headroom_h200.py", "environment": common.environment(), "env": env,
                  "settings": {"compilation": "vLLM default (torch.compile + CUDA graphs)",
                               "gdn_prefill_backend": "triton", "prefix_caching": False,
                               "max_model_len": MAX_MODEL_LEN, "max_num_seqs": MAX_NUM_SEQS,
                               "gpu_memory_utilization": mem, "weights": "dummy bf16", "mnbt": mnbt,
                               "profile_run_cap": cap or None, "config": cfg}})
        common.write_result(os.path.join(args.out, f"{tag}.json"), r)
        summary.append({"tag": tag, "ok": r.get("ok"), "oom": r.get("oom"), "failure": r.get("failure"),
                        "kv_cache_tokens": r.get("kv_cache_tokens"),
                        "reserved_activation": (r.get("vllm") or {}).get("peak_activation_memory"),
                        "max_activation_peak": r.get("max_activation_peak")})
        print(json.dumps(summary[-1]), flush=True)
    common.write_result(os.path.join(args.out, f"memory-headroom-{args.model}-summary.json"), {"runs": summary})


if __name__ == "__main__":
    main()
