"""Files of the fused-MoE device runs (bench/moe_queue.json), unpacked by `devqueue.py unpack`, put
where make_table.py and the moe-configs patch read them (stdlib only).

  python3 bench/moe_merge.py DEST [--results bench/results] [--ship]

DEST/ID/ per job (`out/`: the job's folder, `keep/`: its kept paths, `pack.json`: its state):
- bench jobs: `bench-*.json` to results/, their `.log` to results/logs/, their overlay reports
  (`reports-bench-*/`) to results/logs/; a job that left no result keeps its queue log as
  results/logs/queue-ID-DATE.txt;
- tune jobs (a kept tune-moe folder, /tmp/moe-configs): the newest folder among them gives
  results/tune-moe-DEVICE-DATE.json (per shape and batch size: vLLM's config and time, the tuned config
  and time, configs timed, seconds; the config files as written), each tune job's log goes to
  results/logs/tune-moe-DEVICE-DATE-ID.txt; with --ship the config files that hold at least one tuned
  batch size are copied into src/vllm_overlay/moe_configs/ (the package ships them).
Prints what it wrote and what to check.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SHIP = os.path.join(ROOT, "src", "vllm_overlay", "moe_configs")


def kept_moe(d: str) -> str | None:
    """The tune-moe folder a job kept (the one holding tune-state/), if any."""
    found = sorted(glob.glob(os.path.join(d, "keep", "**", "tune-state"), recursive=True))
    return os.path.dirname(found[0]) if found else None


def load(path: str, default: Any = None) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def date_of(pack: dict[str, Any]) -> str:
    return str(pack.get("packed_utc", "unknown"))[:10].replace("-", "")


def merge_bench(job: str, d: str, results: str) -> list[str]:
    out, done = os.path.join(d, "out"), []
    logs = os.path.join(results, "logs")
    os.makedirs(logs, exist_ok=True)
    for path in sorted(glob.glob(os.path.join(out, "bench-*.json"))):
        name = os.path.basename(path)
        shutil.copy(path, os.path.join(results, name))
        done.append(os.path.join(results, name))
        log = path[:-5] + ".log"
        if os.path.exists(log):
            shutil.copy(log, os.path.join(logs, os.path.basename(log)))
            done.append(os.path.join(logs, os.path.basename(log)))
        reps = os.path.join(out, "reports-" + name[:-5])
        if os.path.isdir(reps):
            dst = os.path.join(logs, os.path.basename(reps))
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(reps, dst)
            done.append(dst + "/")
    if not done and os.path.exists(os.path.join(out, "job.log")):
        dst = os.path.join(logs, f"queue-{job}-{date_of(load(os.path.join(d, 'pack.json'), {}))}.txt")
        shutil.copy(os.path.join(out, "job.log"), dst)
        done.append(dst)
    return done


def tune_summary(folder: str) -> dict[str, Any]:
    """tune-moe's state and config files in one result."""
    shapes: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    stamps = []
    for path in sorted(glob.glob(os.path.join(folder, "tune-state", "*.state.json"))):
        st = load(path, {})
        m = st.get("meta", {})
        meta = meta or m
        name = os.path.basename(path).replace(".state.json", ".json")
        written = load(os.path.join(folder, name), {}) or {}
        batches = st.get("batches", {})
        stamps += [b["utc"] for b in batches.values() if b.get("utc")]
        shapes[m.get("shape", name)] = {
            "file": name, "batches": batches,
            "file_batch_sizes": sorted(int(k) for k in written if k.isdigit()),
            "tuned": sorted(int(k) for k in batches)}
    files = {os.path.basename(p): load(p, {}) for p in sorted(glob.glob(os.path.join(folder, "E=*.json")))}
    return {"script": "vllm-overlay tune-moe (src/vllm_overlay/tune)", "device": meta.get("device"),
            "vllm": meta.get("vllm"), "triton": meta.get("triton"), "search": meta.get("search"),
            "hidden": meta.get("hidden"), "topk": meta.get("topk"),
            "first_utc": min(stamps) if stamps else None, "last_utc": max(stamps) if stamps else None,
            "method": "vLLM's fused_experts under override_config, random bf16 weights, uniform random top-k routing, "
                      "10 calls in one CUDA graph, median of --iters replays; 'before' is the config vLLM picks "
                      "without a tuned file (its default heuristic), 'after' the fastest candidate",
            "shapes": shapes, "config_files": files}


def merge_tune(jobs: dict[str, str], results: str, ship: bool) -> list[str]:
    kept = [(load(os.path.join(d, "pack.json"), {}).get("packed", 0), j, d) for j, d in jobs.items() if kept_moe(d)]
    if not kept:
        return []
    _, _, newest = max(kept)
    folder = str(kept_moe(newest))
    s = tune_summary(folder)
    device = s["device"] or "unknown-device"
    date = (s["first_utc"] or "unknown")[:10].replace("-", "")
    done = []
    s["logs"] = []
    for _, job, d in sorted(kept):
        log = os.path.join(d, "out", "job.log")
        if os.path.exists(log):
            dst = os.path.join(results, "logs", f"tune-moe-{device}-{date}-{job}.txt")
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copy(log, dst)
            s["logs"].append(os.path.relpath(dst, ROOT))
            done.append(dst)
    path = os.path.join(results, f"tune-moe-{device}-{date}.json")
    with open(path, "w") as f:
        json.dump(s, f, indent=1, sort_keys=True)
    done.append(path)
    if ship:
        os.makedirs(SHIP, exist_ok=True)
        for shape, rec in s["shapes"].items():
            if rec["tuned"] and rec["file"] in s["config_files"]:
                dst = os.path.join(SHIP, rec["file"])
                shutil.copy(os.path.join(folder, rec["file"]), dst)
                done.append(dst)
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dest", help="the folder `devqueue.py unpack --into` wrote (one subfolder per job)")
    ap.add_argument("--results", default=os.path.join(HERE, "results"))
    ap.add_argument("--ship", action="store_true", help="copy the tuned config files into the package")
    a = ap.parse_args(argv)
    jobs = {os.path.basename(p): p for p in sorted(glob.glob(os.path.join(a.dest, "*")))
            if os.path.exists(os.path.join(p, "pack.json"))}
    if not jobs:
        print(f"moe_merge: {a.dest!r}: no job folders (DEST/ID/pack.json); run `python3 bench/devqueue.py unpack "
              "CALL_FOLDERS... --into DEST` first", file=sys.stderr)
        return 2
    written = []
    for job, d in jobs.items():
        pack = load(os.path.join(d, "pack.json"), {})
        st = pack.get("status", {})
        print(f"moe_merge: {job}: {st.get('state', 'not started')}, rc {st.get('rc')}, {st.get('wall_s')} s "
              f"(packed {pack.get('packed_utc')})")
        if not kept_moe(d):
            written += merge_bench(job, d, a.results)
    written += merge_tune({j: d for j, d in jobs.items() if kept_moe(d)}, a.results, a.ship)
    for w in written:
        print(f"moe_merge: wrote {os.path.relpath(w, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
