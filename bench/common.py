"""Shared pieces of the GPU bench scripts: model folders, the bug report's traffic, report reading.

Runs on a CUDA machine with vLLM 0.20.2 and this package installed (the recorded results: NVIDIA
H200, torch 2.11.0+cu130). Every configuration is its own process: the overlay reads its settings
once per vLLM process.
"""

from __future__ import annotations

import glob
import gzip
import json
import logging
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
BUG_SHAPE = [2500, 2600, 2400] + [40] * 8  # one scheduler step of 7820 tokens
BAND = (4096, 8192)


# vLLM log lines that give a boot's parts: result key -> pattern (bench.py reads them from the run's
# log, make_table.py from a kept log when an older result lacks them)
BOOT_PARTS = {"profiling_s": r"Initial profiling/warmup run took ([0-9.]+) s",
              "compile_s": r"torch.compile took ([0-9.]+) s in total"}


def boot_parts(text: str) -> dict[str, float]:
    return {key: float(m.group(1)) for key, pat in BOOT_PARTS.items() if (m := re.search(pat, text))}


def model_dir(name: str) -> str:
    """A folder holding only config.json (weights: load_format=dummy)."""
    if name == "tiny":
        from vllm_overlay.tools.models import tiny_hybrid_dir

        return tiny_hybrid_dir()
    src = os.path.join(HERE, "models", f"{name}.json")
    dst = os.path.join(tempfile.gettempdir(), f"vllm-overlay-model-{name}")
    os.makedirs(dst, exist_ok=True)
    shutil.copy(src, os.path.join(dst, "config.json"))
    return dst


def prompts(lens: list[int], seed: int = 0, vocab: int = 4000) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(n)]} for n in lens]


class Capture(logging.Handler):
    """Keeps the messages of the log records it is given (a bench script reads vLLM's lines from it)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(record.getMessage())
        except Exception:  # noqa: BLE001
            pass


def environment() -> dict[str, Any]:
    import torch
    import vllm

    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "gpus": torch.cuda.device_count(),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "triton_cache_autotuning": os.environ.get("TRITON_CACHE_AUTOTUNING"),
        "note": os.environ.get("BENCH_NOTE"),
    }


def reports_summary(report_dir: str) -> dict[str, Any]:
    from vllm_overlay.tools.cli.report import load
    from vllm_overlay.telemetry import in_band, merge_sizes

    reps = load(report_dir) if os.path.isdir(report_dir) else []
    sizes = merge_sizes(reps)
    workers = [r for r in reps if r.get("engine_config")]
    return {
        # vllm_version, platform, runner and patch statuses: what bench/evidence.py matches to a level cell
        "processes": [{"pid": r["pid"], "role": r["role"], "counts": r["counts"],
                       "load_apply_s": r["load_apply_s"], "hook_apply_s": r.get("hook_apply_s"),
                       "vllm_version": r.get("vllm_version"), "platform": r.get("platform"), "runner": r.get("runner"),
                       "patches": {pid: rec.get("status") for pid, rec in (r.get("patches") or {}).items()}}
                      for r in reps],
        "patches": {pid: rec["status"] for r in workers for pid, rec in r["patches"].items()},
        "forwards": sum(sizes.values()),
        "band_forwards": in_band(sizes, *BAND),
        "max_forward": max(sizes) if sizes else None,
        "guard_trips": sum(r["counters"].get("guard_trips", 0) for r in reps),
        "buffers": [b for r in workers for b in r.get("buffers", [])],
        "profile_forward_tokens": [t for r in workers for t in r["telemetry"]["profile_forward_tokens"]],
        "buckets": {k: v for r in workers for k, v in r["telemetry"]["forwards"].get("buckets", {}).items()},
        # the moe-configs patch: per expert shape, the config file vLLM's fused-MoE kernel used
        "moe_configs": {k: v for r in reps for k, v in
                        ((r.get("patches") or {}).get("moe-configs") or {}).get("moe_configs", {}).items()},
    }


def classify(text: str) -> str | None:
    for needle, name in (("setStorage", "setStorage (Inductor alias regeneration past the buffer)"),
                         ("FakeTensor", "Dynamo fake-tensor shape mismatch in the profiling forward"),
                         ("CapacityError", "vllm-overlay CapacityError (clear error, no crash)"),
                         ("exceeds the GDN output buffer", "vllm-overlay CapacityError (clear error, no crash)"),
                         ("Workspace is locked", "locked workspace too small (sized by the capped profiling forward)"),
                         ("out of memory", "CUDA out of memory"),
                         ("CUBLAS_STATUS_EXECUTION_FAILED", "CUDA memory fault in a forward past the buffer "
                          "(CUBLAS_STATUS_EXECUTION_FAILED, then an illegal memory access)"),
                         ("illegal memory access", "CUDA illegal memory access")):
        if needle in text:
            return name
    return None


def run_child(script: str, args: list[str], env: dict[str, str], log_path: str, timeout: int) -> dict[str, Any]:
    """Run one configuration in its own process; returns its JSON result (or the failure)."""
    out = log_path.replace(".log", ".json")
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_OVERLAY", "GENESIS_"))}
    full_env.update(env)
    t0 = time.time()
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run([sys.executable, script, "--child", out, *args], env=full_env, stdout=log,
                                stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    text = open(log_path, errors="replace").read()
    res = json.load(open(out)) if os.path.exists(out) else {"ok": False}
    res.update({"returncode": rc, "wall_s": round(time.time() - t0, 1)})
    if rc == "timeout":
        res["failure"] = f"not measured: ended by this script's per-config limit of {timeout} s"
        res["log_tail"] = text[-2500:]
    elif not res.get("ok"):
        res["failure"] = classify(text + json.dumps(res.get("error", ""))) or "other"
        res["log_tail"] = text[-2500:]
    return res


def write_result(path: str, data: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    print("wrote", path, flush=True)


def newest(pattern: str) -> str | None:
    found = sorted(glob.glob(pattern))
    return found[-1] if found else None


def finish_child(out: str, res: dict[str, Any]) -> None:
    """Flush this process's overlay report, add its summary to ``res``, write ``out``, exit now
    (a crashed engine may hang at interpreter exit)."""
    try:
        import vllm_overlay

        vllm_overlay.flush()
    except Exception:  # noqa: BLE001 - no overlay installed (stock runs still report nothing)
        pass
    res["reports"] = reports_summary(os.environ.get("VLLM_OVERLAY_REPORT_DIR", ""))
    with open(out, "w") as f:
        json.dump(res, f)
    os._exit(0)


def kernel_family(name: str, families: tuple[tuple[str, str], ...]) -> str:
    """The first family of ``families`` ((family, regex) pairs) whose pattern is in ``name``
    (lowercased), else "other": how the profiler-trace breakdowns classify kernels."""
    low = name.lower()
    for fam, pat in families:
        if re.search(pat, low):
            return fam
    return "other"


def load_trace(path: str) -> dict[str, Any]:
    """A torch profiler's Chrome trace (gzipped or not); a bare event list becomes {"traceEvents": [...]}."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {"traceEvents": data}
