"""The bug report's serving stack through `vllm serve`, driven in steps that may span several device
calls (a server started with `boot` runs on in its own process session until `stop`).

  python3 bench/stack.py boot LABEL --config overlay --tp 2 --ep --kv turboquant_k8v4 --mtp 3 [--wait S]
  python3 bench/stack.py wait LABEL --wait S          # until /health answers, the server dies, or S seconds
  python3 bench/stack.py stress LABEL --min-band 1000 --duration S
  python3 bench/stack.py decode LABEL --streams 1,16 --tokens 256 --reps 3
  python3 bench/stack.py stop LABEL                   # ends the server, then `collect`
  python3 bench/stack.py collect LABEL                # copies log tail, reports, results into $OUT/LABEL
  python3 bench/stack.py merge RESULT.json NAME=DIR ...  # (here) one result file from the summaries brought back

Configurations (the overlay's environment; every one uses the same vLLM arguments):
  overlay        the overlay's defaults, profile cap 4096 through the legacy name GENESIS_PROFILE_RUN_CAP_M
  legacy         + VLLM_OVERLAY_TEST_BUFFER_ROWS=4096, VLLM_OVERLAY_TEST_GUARD=0 (the reference tree's sizing),
                 VLLM_OVERLAY_MEMORY_HEADROOM=0
  forced-guard   + VLLM_OVERLAY_TEST_BUFFER_ROWS=4096 with the capacity guard on, VLLM_OVERLAY_MEMORY_HEADROOM=0
  stock          VLLM_OVERLAY=0 (stock vLLM refuses TurboQuant on hybrid models: run it with --kv auto)

Runs from the project root with vLLM staged in /tmp/site (../shared/gpu/README.md); this tree's src/
goes first on PYTHONPATH. State lives in /tmp/stack/LABEL; every step writes `$OUT/LABEL/` (or
bench/results/stack/LABEL without $OUT): summary.json (merged over the steps run on this machine),
serve.log (its last 400 kB), reports/, stress/, decode.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import glob
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATE = "/tmp/stack"
MODEL = "/tmp/vllm-overlay-model-qwen36-35b-a3b-geometry-mtp"  # one folder: compile cache hits
CONFIGS = {
    "overlay": {"GENESIS_PROFILE_RUN_CAP_M": "4096"},
    # memory-headroom off in the two red configurations: its boot-time forward of
    # max_num_batched_tokens would meet the forced 4096-row buffer first (the recorded runs of
    # 2026-12-01 predate that patch)
    "legacy": {"GENESIS_PROFILE_RUN_CAP_M": "4096", "VLLM_OVERLAY_TEST_BUFFER_ROWS": "4096",
               "VLLM_OVERLAY_TEST_GUARD": "0", "VLLM_OVERLAY_MEMORY_HEADROOM": "0"},
    "forced-guard": {"GENESIS_PROFILE_RUN_CAP_M": "4096", "VLLM_OVERLAY_TEST_BUFFER_ROWS": "4096",
                     "VLLM_OVERLAY_MEMORY_HEADROOM": "0"},
    "stock": {"VLLM_OVERLAY": "0"},
}
# NVLink multicast stays off on shared multi-GPU hosts (device notes); vLLM's symmetric-memory
# all-reduce is kept off with it.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
                 "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}


def say(msg: str) -> None:
    print(f"stack: {time.strftime('%H:%M:%S')} {msg}", flush=True)


def sdir(label: str) -> str:
    return os.path.join(STATE, label)


def out_dir(label: str) -> str:
    base = os.environ.get("OUT") or os.path.join(ROOT, "bench", "results", "stack")
    path = os.path.join(base, label)
    os.makedirs(path, exist_ok=True)
    return path


def load_state(label: str) -> dict:
    path = os.path.join(sdir(label), "state.json")
    if not os.path.exists(path):
        sys.exit(f"stack: no server state for {label!r} in {sdir(label)} (run `boot {label}` first on this machine)")
    return json.load(open(path))


def save_state(label: str, st: dict) -> None:
    json.dump(st, open(os.path.join(sdir(label), "state.json"), "w"), indent=1)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie is not alive
        return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
    except OSError:
        return False


def healthy(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
        return True
    except Exception:  # noqa: BLE001 - not up yet
        return False


def write_model(mtp: int) -> None:
    os.makedirs(MODEL, exist_ok=True)
    cfg = json.load(open(os.path.join(ROOT, "bench", "models", "qwen36-35b-a3b-geometry.json")))
    if mtp:
        cfg["num_nextn_predict_layers"] = 1  # one MTP layer: qwen3_next_mtp drafts from it
    json.dump(cfg, open(os.path.join(MODEL, "config.json"), "w"), indent=1)


def cmd_boot(a: argparse.Namespace) -> int:
    d = sdir(a.label)
    if os.path.exists(os.path.join(d, "state.json")):
        st = json.load(open(os.path.join(d, "state.json")))
        if alive(st["pid"]):
            sys.exit(f"stack: {a.label!r} is already running (pid {st['pid']}); `stop {a.label}` first")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(os.path.join(d, "reports"))
    write_model(a.mtp)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_OVERLAY", "GENESIS_"))}
    env.update(CONFIGS[a.config])
    env.update(MULTICAST_OFF)
    env["VLLM_OVERLAY_REPORT_DIR"] = os.path.join(d, "reports")
    env["TRITON_CACHE_AUTOTUNING"] = env.get("TRITON_CACHE_AUTOTUNING", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(ROOT, "src"), "/tmp/site", env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", MODEL, "--load-format", "dummy",
           "--skip-tokenizer-init", "--additional-config", '{"gdn_prefill_backend":"triton"}',
           "--max-num-batched-tokens", str(a.mnbt), "--max-model-len", str(a.max_model_len),
           "--gpu-memory-utilization", str(a.mem), "--port", str(a.port), "--seed", "0"]
    if a.tp > 1:
        cmd += ["--tensor-parallel-size", str(a.tp)]
    if a.ep:
        cmd += ["--enable-expert-parallel"]
    if a.kv != "auto":
        cmd += ["--kv-cache-dtype", a.kv]
    if a.mtp:
        cmd += ["--speculative-config", json.dumps({"method": "qwen3_next_mtp", "num_speculative_tokens": a.mtp})]
    log = open(os.path.join(d, "serve.log"), "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    st = {"label": a.label, "config": a.config, "pid": proc.pid, "port": a.port, "cmd": cmd,
          "overlay_env": {k: v for k, v in env.items() if k.startswith(("VLLM_OVERLAY", "GENESIS_"))},
          "vllm_args": {"tp": a.tp, "ep": a.ep, "kv_cache_dtype": a.kv, "mtp": a.mtp, "mnbt": a.mnbt,
                        "max_model_len": a.max_model_len, "gpu_memory_utilization": a.mem},
          "started": time.time(), "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    save_state(a.label, st)
    say(f"{a.label}: vllm serve started (pid {proc.pid}, port {a.port}, config {a.config})")
    rc = wait(a.label, a.wait) if a.wait > 0 else 0
    collect(a.label)
    return rc


def wait(label: str, seconds: float) -> int:
    st = load_state(label)
    end = time.time() + seconds
    while time.time() < end:
        if st.get("healthy_after_s") is not None or healthy(st["port"]):
            if st.get("healthy_after_s") is None:
                st["healthy_after_s"] = round(time.time() - st["started"], 1)
                save_state(label, st)
            say(f"{label}: healthy {st['healthy_after_s']} s after start")
            return 0
        if not alive(st["pid"]):
            st["died_after_s"] = round(time.time() - st["started"], 1)
            save_state(label, st)
            say(f"{label}: the server exited during boot after {st['died_after_s']} s")
            tail(label, 40)
            return 1
        time.sleep(3)
    say(f"{label}: not healthy yet ({round(time.time() - st['started'])} s after start)")
    return 2


def tail(label: str, n: int) -> None:
    lines = open(os.path.join(sdir(label), "serve.log"), errors="replace").read().splitlines()
    for line in lines[-n:]:
        print("  | " + line[-300:])


def cmd_stress(a: argparse.Namespace) -> int:
    st = load_state(a.label)
    if wait(a.label, 1) != 0:
        collect(a.label)
        return 1
    out = os.path.join(sdir(a.label), "stress")
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "vllm_overlay", "stress", "--url", f"http://127.0.0.1:{st['port']}",
           "--out", out, "--min-band-forwards", str(a.min_band), "--duration", str(a.duration)]
    if st["config"] != "stock":
        cmd += ["--report-dir", os.path.join(sdir(a.label), "reports")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), "/tmp/site"]))
    say(f"{a.label}: stress for at most {a.duration} s, {a.min_band} band forwards asked")
    t0 = time.time()
    with open(os.path.join(sdir(a.label), "stress.log"), "w") as log:
        try:
            rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                timeout=a.duration + 90).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    st = load_state(a.label)
    st.setdefault("stress_runs", []).append({"rc": rc, "wall_s": round(time.time() - t0, 1),
                                             "min_band": a.min_band, "duration": a.duration})
    save_state(a.label, st)
    lines = open(os.path.join(sdir(a.label), "stress.log"), errors="replace").read().splitlines()
    for line in lines[-25:]:
        print("  | " + line[-300:])
    say(f"{a.label}: stress exit {rc}; server {'alive' if alive(st['pid']) else 'DEAD'}")
    collect(a.label)
    return rc


def _complete(port: int, ids: list[int], tokens: int) -> tuple[float, int]:
    body = json.dumps({"model": MODEL, "prompt": ids, "max_tokens": tokens, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    data = json.loads(urllib.request.urlopen(req, timeout=600).read())
    secs = time.perf_counter() - t0
    choice = data["choices"][0]
    return secs, len(choice.get("token_ids") or []) or data.get("usage", {}).get("completion_tokens", 0)


def spec_counters(port: int) -> dict[str, float]:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=20).read().decode()
    except Exception:  # noqa: BLE001
        return {}
    vals: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(vllm:spec_decode_num_(?:drafts|draft_tokens|accepted_tokens)_total)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m:
            vals[m.group(1)] = vals.get(m.group(1), 0.0) + float(m.group(3))
    return vals


def cmd_decode(a: argparse.Namespace) -> int:
    st = load_state(a.label)
    if wait(a.label, 1) != 0:
        collect(a.label)
        return 1
    rng = random.Random(0)
    res = {"tokens_out": a.tokens, "prompt_tokens": 32, "reps": a.reps, "streams": {}}
    for n in [int(s) for s in a.streams.split(",")]:
        prompts = [[rng.randrange(10, 4000) for _ in range(32)] for _ in range(n)]
        runs = []
        for rep in range(a.reps + 1):  # the first is a warm-up, not counted
            before = spec_counters(st["port"])
            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(n) as pool:
                got = list(pool.map(lambda p: _complete(st["port"], p, a.tokens), prompts))
            wall = time.perf_counter() - t0
            after = spec_counters(st["port"])
            drafts = {k.removeprefix("vllm:spec_decode_num_").removesuffix("_total"): after[k] - before.get(k, 0.0)
                      for k in after}
            toks = sum(t for _, t in got)
            run = {"wall_s": round(wall, 3), "tokens": toks, "tokens_per_s": round(toks / wall, 2),
                   "ms_per_token_per_stream": round(1000 * statistics.median(s for s, _ in got) / a.tokens, 3),
                   "spec_decode": drafts}
            if rep:
                runs.append(run)
            say(f"{a.label}: decode-{n} {'rep ' + str(rep) if rep else 'warm-up'}: {json.dumps(run)}")
        ms = [r["ms_per_token_per_stream"] for r in runs]
        tps = [r["tokens_per_s"] for r in runs]
        res["streams"][f"decode-{n}"] = {
            "ms_per_token_per_stream": {"median": statistics.median(ms), "min": min(ms), "max": max(ms)},
            "tokens_per_s": {"median": statistics.median(tps), "min": min(tps), "max": max(tps)},
            "runs": runs}
    json.dump(res, open(os.path.join(sdir(a.label), "decode.json"), "w"), indent=1)
    collect(a.label)
    return 0


def cmd_stop(a: argparse.Namespace) -> int:
    st = load_state(a.label)
    if alive(st["pid"]):
        try:
            os.killpg(st["pid"], signal.SIGTERM)
        except OSError:
            pass
        for _ in range(30):
            if not alive(st["pid"]):
                break
            time.sleep(1)
        else:
            try:
                os.killpg(st["pid"], signal.SIGKILL)
            except OSError:
                pass
    st["stopped_after_s"] = round(time.time() - st["started"], 1)
    save_state(a.label, st)
    say(f"{a.label}: stopped")
    collect(a.label)
    return 0


def classify(text: str) -> str | None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import common

    return common.classify(text)


def summarize(label: str) -> dict:
    st = load_state(label)
    d = sdir(label)
    text = open(os.path.join(d, "serve.log"), errors="replace").read()
    s = {k: st.get(k) for k in ("config", "started_utc", "vllm_args", "overlay_env", "healthy_after_s",
                                 "died_after_s", "stress_runs")}
    s["server_alive"] = alive(st["pid"])
    for key, pat in (("kv_cache_tokens", r"KV cache size: ([0-9,]+) tokens"),
                     ("init_engine_s", r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+)"),
                     ("model_weights_gib", r"Model loading took ([0-9.]+) GiB")):
        found = [float(m.replace(",", "")) for m in re.findall(pat, text)]
        if found:
            s[key] = found if len(found) > 1 else found[0]
    s["kv_cache_lines"] = [ln.strip()[-200:] for ln in text.splitlines() if "KV cache size" in ln][:8]
    s["overlay_summary_lines"] = [ln.strip()[-400:] for ln in text.splitlines() if "[vllm-overlay] pid" in ln][-12:]
    s["first_error_lines"] = [ln.strip()[-400:] for ln in text.splitlines()
                              if re.search(r"Error|Traceback|CapacityError|illegal memory|setStorage", ln)][:25]
    s["failure_class"] = classify(text)
    procs = []
    for path in sorted(glob.glob(os.path.join(d, "reports", "overlay-*.json"))):
        try:
            r = json.load(open(path))
        except Exception:  # noqa: BLE001 - a report being written
            continue
        statuses = {pid: rec.get("status") for pid, rec in (r.get("patches") or {}).items()}
        procs.append({"pid": r.get("pid"), "role": r.get("role"), "tp_rank": r.get("tp_rank"),
                      "runner": r.get("runner"), "counts": r.get("counts"), "patches": statuses,
                      "counters": r.get("counters"),
                      "buffers": [{k: b.get(k) for k in ("rows", "bytes", "source", "requested_source") if k in b}
                                  for b in r.get("buffers", [])][:4]})
    s["processes"] = procs
    sp = os.path.join(d, "stress", "stress.json")
    if os.path.exists(sp):
        r = json.load(open(sp))
        s["stress"] = {k: r.get(k) for k in ("verdict", "why", "band", "band_forwards", "min_band_forwards",
                                             "forwards", "max_forward", "guard_trips", "requests_ok",
                                             "requests_failed", "errors", "wall_s", "warmup_s", "tokens_per_s",
                                             "ttft_p50_s", "ttft_p99_s", "worker_roles", "gdn_buffer_rows")}
        s["stress"]["errors"] = (s["stress"]["errors"] or [])[:5]
    dp = os.path.join(d, "decode.json")
    if os.path.exists(dp):
        s["decode"] = {k: {kk: v[kk] for kk in ("ms_per_token_per_stream", "tokens_per_s")}
                       for k, v in json.load(open(dp))["streams"].items()}
    s["spec_decode_now"] = spec_counters(st["port"]) if s["server_alive"] else None
    return s


def collect(label: str) -> None:
    d, o = sdir(label), out_dir(label)
    text = open(os.path.join(d, "serve.log"), "rb").read()
    open(os.path.join(o, "serve.log"), "wb").write(text[-400_000:])
    for sub in ("reports", "stress"):
        if os.path.isdir(os.path.join(d, sub)):
            shutil.copytree(os.path.join(d, sub), os.path.join(o, sub), dirs_exist_ok=True)
    for f in ("stress.log", "decode.json", "state.json"):
        if os.path.exists(os.path.join(d, f)):
            shutil.copy(os.path.join(d, f), o)
    s = summarize(label)
    json.dump(s, open(os.path.join(o, "summary.json"), "w"), indent=1)
    brief = {k: s.get(k) for k in ("config", "healthy_after_s", "died_after_s", "server_alive", "kv_cache_tokens",
                                   "failure_class")}
    say(f"{label}: {json.dumps(brief)}")
    for p in s["processes"]:
        say(f"{label}: report pid {p['pid']} role {p['role']} tp_rank {p['tp_rank']} runner {p.get('runner')}: "
            f"{json.dumps(p['counts'])}")
    if "stress" in s:
        say(f"{label}: stress {json.dumps({k: s['stress'][k] for k in ('verdict', 'why', 'band_forwards', 'requests_failed', 'max_forward')})}")


def cmd_merge(a: argparse.Namespace) -> int:
    """One result file for bench/results from the `summary.json` files of several runs (a run's
    DIR is what a device call brought back for its LABEL; the newest summary of a run wins)."""
    res: dict = {"script": "bench/stack.py", "note": a.note, "runs": {}}
    for item in a.runs:
        name, _, path = item.partition("=")
        if not path or not os.path.isfile(os.path.join(path, "summary.json")):
            sys.exit(f"stack: merge: {item!r}: expected NAME=DIR with DIR/summary.json")
        s = json.load(open(os.path.join(path, "summary.json")))
        s.pop("kv_cache_lines", None)
        if os.path.isfile(os.path.join(path, "serve.log")):  # classes added since the run are applied too
            s["failure_class"] = classify(open(os.path.join(path, "serve.log"), errors="replace").read())
        s["first_error_lines"] = [ln for ln in s.get("first_error_lines", [])
                                  if not re.search(r"ulimit|Tokenizer not available|base.py:255", ln)][:12]
        res["runs"][name] = s
    json.dump(res, open(a.result, "w"), indent=1)
    say(f"wrote {a.result} ({', '.join(res['runs'])})")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="step", required=True)
    b = sub.add_parser("boot")
    b.add_argument("label")
    b.add_argument("--config", choices=tuple(CONFIGS), default="overlay")
    b.add_argument("--tp", type=int, default=1)
    b.add_argument("--ep", action="store_true", help="--enable-expert-parallel")
    b.add_argument("--kv", default="turboquant_k8v4", help="--kv-cache-dtype (auto: the model's dtype)")
    b.add_argument("--mtp", type=int, default=3, help="speculative tokens of qwen3_next_mtp (0: no MTP)")
    b.add_argument("--mnbt", type=int, default=8192)
    b.add_argument("--max-model-len", type=int, default=262144)
    b.add_argument("--mem", type=float, default=0.82)
    b.add_argument("--port", type=int, default=8011)
    b.add_argument("--wait", type=float, default=0, help="seconds to wait for /health (0: return at once)")
    for name in ("wait", "stop", "collect"):
        p = sub.add_parser(name)
        p.add_argument("label")
        if name == "wait":
            p.add_argument("--wait", type=float, default=540)
    s = sub.add_parser("stress")
    s.add_argument("label")
    s.add_argument("--min-band", type=int, default=1000)
    s.add_argument("--duration", type=int, default=300)
    dc = sub.add_parser("decode")
    dc.add_argument("label")
    dc.add_argument("--streams", default="1,16")
    dc.add_argument("--tokens", type=int, default=256)
    dc.add_argument("--reps", type=int, default=3)
    m = sub.add_parser("merge")
    m.add_argument("result")
    m.add_argument("runs", nargs="+", help="NAME=DIR holding a summary.json")
    m.add_argument("--note", default="", help="date, machine and conditions of the runs")
    a = ap.parse_args()
    if a.step == "merge":
        return cmd_merge(a)
    if a.step == "boot":
        return cmd_boot(a)
    if a.step == "wait":
        rc = wait(a.label, a.wait)
        collect(a.label)
        return rc
    if a.step == "stress":
        return cmd_stress(a)
    if a.step == "decode":
        return cmd_decode(a)
    if a.step == "stop":
        return cmd_stop(a)
    collect(a.label)
    return 0


if __name__ == "__main__":
    sys.exit(main())
