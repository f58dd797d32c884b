"""Memory under traffic through `vllm serve`: `bench/stack.py memory LABEL` sends traffic
phases to a server `stack.py boot` started and records, per phase, what the worker's allocator and
the device reached against what was reserved.

  python3 bench/stack.py memory LABEL [--phases longest,band,burst,mixed] [--band-seconds 45]
      [--min-band 20] [--mixed-tokens 192] [--budget-s S] [--out memory]

Phases (each one window of memory-headroom's watch: the mark file in the server's report folder,
acknowledged through the worker's report before traffic starts):
  longest  one prompt of max_model_len - 1 tokens, 1 token out: every chunk of the longest prompt,
           the last ones at the largest cached context
  band     `vllm-overlay stress --url` for --band-seconds after its warm-up wave: single forwards in
           (cap or a budget below mnbt, mnbt], proven from the server's telemetry
  burst    max_num_seqs prompts of mnbt // max_num_seqs tokens in one request: steps whose every
           request is a short prefill (the most GDN states and chunks a step can hold)
  mixed    max_num_seqs - 1 streams of 16-token prompts decoding --mixed-tokens tokens, then, once
           they run, one prompt of max_model_len - 1 tokens: each of its chunks shares a step with
           the decodes, which then take the chunked GDN path too (a busy server when a long
           prompt arrives)

Per phase: the worker's window (memory-headroom's `runtime` report field: allocator peak above the
pre-profiling baseline with the KV cache left out, against the budget: vLLM's reserved peak plus
what was moved; per worker rank), the device's used memory from `nvidia-smi -lms 200` (peak against
gpu_memory_utilization x total, or --device-fraction x total where servers side by side share the
device), requests ok / failed, and whether the server is alive, with any out-of-memory line of its
log. A phase after which the server is dead ends the step (exit 1: the series marks the label FAILED
and keeps its log); phases already measured are kept in
LABEL/memory.json and skipped when the same command runs again (exit 3: --budget-s left no room
for the next phase); window numbers go on after the last one the workers hold, so a second step
against the same server (another --out) is not answered by the first step's windows. Without
memory-headroom's watch (the overlay off, or the patch off) the device
numbers and the outcome are still recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

PHASES = ("longest", "band", "burst", "mixed")
MARK_FILE = "memory-window.json"  # memory-headroom's (vllm_overlay.patches.memory_headroom.MARK_FILE)
ACK_S = 15.0  # the watch polls every 0.5 s and the report is flushed within a second
OOM = re.compile(r"out of memory|OutOfMemoryError|CUDA error: out of memory", re.I)


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    m = sub.add_parser("memory", parents=parents,
                       help="traffic phases against a running server, with the worker's memory "
                            "peak per phase (bench/memory_serve.py)")
    m.add_argument("label")
    m.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES)}")
    m.add_argument("--band-seconds", type=float, default=45, help="band phase: stress duration after its warm-up")
    m.add_argument("--min-band", type=int, default=20, help="band phase: band forwards asked of the stress tool")
    m.add_argument("--mixed-tokens", type=int, default=192, help="mixed phase: tokens each decode stream asks for")
    m.add_argument("--budget-s", type=float, default=None, help="start no phase that may not end within this")
    m.add_argument("--device-fraction", type=float, default=None,
                   help="the device's used memory is compared with this fraction of its total (default: the "
                        "server's gpu_memory_utilization; servers side by side: what they request together)")
    m.add_argument("--out", default="memory", help="result file NAME.json in the label's folder")


def phase_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in PHASES]
    if bad or not names:
        sys.exit(f"stack: memory --phases {text!r}: expected some of {', '.join(PHASES)}")
    return names


def phase_seconds(name: str, a: argparse.Namespace) -> float:
    """What a phase may take at most on the H200 (35B geometry), to decide whether to start it."""
    return {"longest": 90.0, "band": a.band_seconds + 90.0, "burst": 60.0, "mixed": 150.0}[name]


# ---- the server's side: reports, marks, log ---------------------------------------------------------


def reports(report_dir: str) -> list[dict[str, Any]]:
    out = []
    for name in sorted(os.listdir(report_dir)) if os.path.isdir(report_dir) else []:
        if name.startswith("overlay-") and name.endswith(".json"):
            try:
                out.append(json.load(open(os.path.join(report_dir, name))))
            except (OSError, ValueError):  # being replaced
                continue
    return out


def runtimes(report_dir: str) -> dict[str, dict[str, Any]]:
    """memory-headroom's runtime record per worker (pid -> record)."""
    out = {}
    for r in reports(report_dir):
        rt = ((r.get("patches") or {}).get("memory-headroom") or {}).get("runtime")
        if rt:
            out[str(r.get("pid"))] = rt
    return out


def headroom_records(report_dir: str) -> dict[str, Any]:
    """memory-headroom's boot-time records per worker (pid -> list), and why it did not measure."""
    out: dict[str, Any] = {}
    for r in reports(report_dir):
        mh = (r.get("patches") or {}).get("memory-headroom") or {}
        if mh.get("headroom") or mh.get("not_corrected") or r.get("tp_rank") is not None:
            out[str(r.get("pid"))] = {"status": mh.get("status"), "reason": mh.get("reason"),
                                      "not_corrected": mh.get("not_corrected"),
                                      "records": [{k: v for k, v in h.items() if k != "profile"}
                                                  for h in mh.get("headroom", [])]}
    return out


def engine_config(report_dir: str) -> dict[str, Any]:
    for r in reports(report_dir):
        if (r.get("engine_config") or {}).get("max_num_seqs"):
            return r["engine_config"]
    return {}


def write_mark(report_dir: str, seq: int, name: str) -> None:
    path = os.path.join(report_dir, MARK_FILE)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"seq": seq, "name": name}, f)
    os.replace(tmp, path)


def await_window(report_dir: str, seq: int, limit: float = ACK_S) -> float | None:
    """Seconds until every watching worker shows window ``seq``; None when none watches or in time."""
    t0 = time.time()
    while time.time() - t0 < limit:
        rts = runtimes(report_dir)
        if not rts:
            return None
        if all(any(w.get("seq") == seq for w in rt.get("windows", [])) for rt in rts.values()):
            return round(time.time() - t0, 2)
        time.sleep(0.25)
    return None


def peak_words(worker: dict[str, Any]) -> str:
    """One worker's window in the step's line. The CPU build's meter is the whole process's resident set
    (the API requests, the scheduler's blocks and the modules as well as the forwards): its excess over the
    reservation is said as such, not as the forwards going over it."""
    x = worker["window"]
    over = x["over_budget"] / 2**30
    words = f"; worker runtime peak {x['runtime_peak'] / 2**30:.3f} GiB, "
    if worker.get("whole_process") and over > 0:
        return words + (f"{over:.3f} GiB above the budget on the whole process's {worker.get('meter') or 'resident set'}"
                        " (more than the forwards: no allocator peak on this build)")
    words += f"{'OVER' if over > 0 else 'under'} budget by {abs(over):.3f} GiB"
    if worker.get("driver_peak_mib") is not None and x.get("reserved_peak") is not None:
        words += (f" (on the device the process peaked at {worker['driver_peak_mib']} MiB, its allocator's "
                  f"reserved peak {x['reserved_peak'] / 2**20:.0f} MiB)")
    return words


def window_of(report_dir: str, seq: int) -> dict[str, Any]:
    """Window ``seq`` of each worker, and the worker's totals (budget, KV bytes, cumulative peak)."""
    out = {}
    for pid, rt in runtimes(report_dir).items():
        w = next((w for w in rt.get("windows", []) if w.get("seq") == seq), None)
        out[pid] = {"window": w, **{k: rt.get(k) for k in ("budget", "baseline", "kv_bytes", "runtime_peak",
                                                          "over_budget", "meter", "whole_process", "error",
                                                          "mark_error")}}
    return out


class LogTail:
    """The server log's lines written since the last read (out-of-memory evidence per phase)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = os.path.getsize(path) if os.path.exists(path) else 0

    def new_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        return data.decode(errors="replace").splitlines()


def parse_apps(text: str) -> dict[int, int]:
    """`nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits`: pid -> MiB.
    Lines that are not "PID, MIB" (e.g. "[N/A]" where the driver hides a figure) are left out."""
    out: dict[int, int] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            out[int(parts[0])] = int(parts[1])
    return out


APPS_EVERY_S = 0.5


def highest(samples: list[tuple[float, dict[Any, int]]], t0: float, t1: float) -> dict[Any, int]:
    """Per key (GPU index or pid), the highest MiB of the samples taken from t0 to t1 (and up to 0.5 s
    after: the last sample of a phase may land just after it)."""
    out: dict[Any, int] = {}
    for t, batch in list(samples):
        if t0 <= t <= t1 + 0.5:
            for key, mib in batch.items():
                out[key] = max(out.get(key, 0), mib)
    return out


class DeviceSampler:
    """`nvidia-smi -lms 200` in the background: used and total MiB per GPU over time (None without
    nvidia-smi, e.g. on the CPU build); and every APPS_EVERY_S what the driver charges each process
    (`--query-compute-apps`: its CUDA context, libraries and allocator together)."""

    def __init__(self, gpus: str | None) -> None:
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.apps: list[tuple[float, dict[int, int]]] = []
        self.total: dict[str, int] = {}
        self.stopping = threading.Event()
        self.proc = None
        cmd = ["nvidia-smi", "--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits",
               "-lms", "200"]
        if gpus:
            cmd += ["-i", gpus]
        try:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return
        threading.Thread(target=self.read, daemon=True).start()
        apps = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
        threading.Thread(target=self.poll_apps, args=(apps + (["-i", gpus] if gpus else []),), daemon=True).start()

    def poll_apps(self, cmd: list[str]) -> None:
        while not self.stopping.wait(APPS_EVERY_S):
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.TimeoutExpired):
                return
            self.apps.append((time.time(), parse_apps(out)))

    def process_peaks(self, t0: float, t1: float) -> dict[int, int]:
        """Each process's highest driver figure (MiB) sampled from t0 to t1."""
        return highest(self.apps, t0, t1)

    def read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        batch: dict[str, int] = {}
        for line in self.proc.stdout:
            parts = [x.strip() for x in line.split(",")]
            if len(parts) != 3 or not all(p.isdigit() for p in parts):
                continue
            idx, used, total = parts[0], int(parts[1]), int(parts[2])
            if idx in batch:  # a new round of GPUs
                self.samples.append((time.time(), batch))
                batch = {}
            batch[idx] = used
            self.total[idx] = total
        if batch:
            self.samples.append((time.time(), batch))

    def peak(self, t0: float, t1: float) -> dict[str, int] | None:
        if self.proc is None:
            return None
        return highest(self.samples, t0, t1) or None

    def stop(self) -> None:
        self.stopping.set()
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# ---- traffic --------------------------------------------------------------------------------------


def ids(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


def complete(port: int, model: str, prompt: Any, max_tokens: int, timeout: float = 600) -> dict[str, Any]:
    """One /v1/completions request (a prompt, or a list of prompts: one engine request each)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.time()
    try:
        data = json.loads(urllib.request.urlopen(req, timeout=timeout).read())
    except urllib.error.HTTPError as exc:
        error = f"HTTP {exc.code}: {exc.read()[:300]!r}"
    except Exception as exc:  # noqa: BLE001 - a dead server is a result
        error = f"{type(exc).__name__}: {exc}"[:300]
    else:
        error = None
    if error is not None:
        return {"ok": 0, "failed": 1, "error": error, "seconds": round(time.time() - t0, 2)}
    n = len(data.get("choices") or [])
    return {"ok": n, "failed": 0, "seconds": round(time.time() - t0, 2),
            "completion_tokens": (data.get("usage") or {}).get("completion_tokens")}


def running_requests(port: int) -> float | None:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    except Exception:  # noqa: BLE001
        return None
    vals = [float(m.group(1)) for m in re.finditer(r"^vllm:num_requests_running(?:\{[^}]*\})? ([0-9.e+-]+)$",
                                                   text, re.M)]
    return sum(vals) if vals else None


def longest(port: int, model: str, cfg: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    n = cfg["max_model_len"] - 1
    r = complete(port, model, ids(n, 1), 1, timeout=phase_seconds("longest", a))
    return {"prompt_tokens": n, "requests_ok": r["ok"], "requests_failed": r["failed"], "errors": [r["error"]]
            if r.get("error") else [], "request_s": r["seconds"]}


def burst(port: int, model: str, cfg: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    n = cfg["max_num_seqs"]
    each = max(1, cfg["mnbt"] // n)
    r = complete(port, model, [ids(each, 1000 + i) for i in range(n)], 4, timeout=phase_seconds("burst", a))
    return {"prompts": n, "prompt_tokens_each": each, "requests_ok": r["ok"],
            "requests_failed": n if r["failed"] else n - r["ok"], "errors": [r["error"]] if r.get("error") else [],
            "request_s": r["seconds"]}


def mixed(port: int, model: str, cfg: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    streams = cfg["max_num_seqs"] - 1
    long_n = cfg["max_model_len"] - 1
    tokens = a.mixed_tokens
    kv = cfg.get("kv_cache_tokens")
    need = streams * (16 + tokens) + long_n
    note = None
    if kv and need > kv:
        tokens = max(8, int((kv - long_n) / streams) - 16 - 1)
        note = f"{need} tokens would exceed the KV cache ({int(kv)}): streams ask for {tokens} tokens"
    got: dict[str, Any] = {}
    t = threading.Thread(target=lambda: got.update(
        streams=complete(port, model, [ids(16, 5000 + i) for i in range(streams)], tokens,
                         timeout=phase_seconds("mixed", a))))
    t.start()
    t_wait = time.time()
    seen = None
    while time.time() - t_wait < 30 and t.is_alive():
        seen = running_requests(port)
        if seen is not None and seen >= 0.9 * streams:
            break
        time.sleep(0.5)
    t_long = time.time()
    got["long"] = complete(port, model, ids(long_n, 2), 1, timeout=phase_seconds("mixed", a))
    t.join(timeout=phase_seconds("mixed", a))
    s, lg = got.get("streams") or {"ok": 0, "failed": streams, "error": "no answer"}, got["long"]
    errors = [x["error"] for x in (s, lg) if x.get("error")]
    if seen is None or seen < 0.9 * streams:
        note = ((note + "; ") if note else "") + (
            f"{seen} requests were running when the long prompt was sent, not about {streams}: its chunks "
            "did not share steps with the decodes (ask for more --mixed-tokens)")
    return {"streams": streams, "stream_tokens": tokens, "long_prompt_tokens": long_n,
            "running_when_long_sent": seen, "long_sent_after_s": round(t_long - t_wait, 1),
            "requests_ok": s["ok"] + lg["ok"],
            "requests_failed": (streams if s["failed"] else streams - s["ok"]) + lg["failed"],
            "long_request_s": lg["seconds"], "errors": errors, **({"note": note} if note else {})}


def band(stk: Any, label: str, port: int, a: argparse.Namespace) -> dict[str, Any]:
    d = stk.sdir(label)
    out = os.path.join(d, "memory-stress")
    cmd = [sys.executable, "-m", "vllm_overlay", "stress", "--url", f"http://127.0.0.1:{port}", "--out", out,
           "--min-band-forwards", str(a.min_band), "--duration", str(a.band_seconds),
           "--report-dir", os.path.join(d, "reports")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(stk.ROOT, "src"), "/tmp/site"]))
    with open(os.path.join(d, "memory-stress.log"), "w") as log:
        try:
            rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=stk.ROOT,
                                timeout=a.band_seconds + 240).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    res: dict[str, Any] = {"stress_rc": rc}
    try:
        s = json.load(open(os.path.join(out, "stress.json")))
        res.update({k: s.get(k) for k in ("verdict", "why", "band", "band_forwards", "forwards", "max_forward",
                                          "requests_ok", "requests_failed", "wall_s", "warmup_s")})
        res["errors"] = (s.get("errors") or [])[:5]
    except (OSError, ValueError):
        res.update(requests_ok=0, requests_failed=0, errors=[f"no stress.json (exit {rc}); see memory-stress.log"])
    return res


# ---- the step -------------------------------------------------------------------------------------


def cmd_memory(a: argparse.Namespace, stk: Any) -> int:
    st = stk.load_state(a.label)
    if stk.wait(a.label, 1) != 0:
        stk.collect(a.label)
        return 1
    t_start = time.time()
    names = phase_list(a.phases)
    if a.device_fraction is not None and not 0 < a.device_fraction <= 1:
        sys.exit(f"stack: memory --device-fraction {a.device_fraction}: expected a fraction in (0, 1]")
    d = stk.sdir(a.label)
    report_dir = os.path.join(d, "reports")
    path = os.path.join(d, f"{a.out}.json")
    args = st["vllm_args"]
    ec = engine_config(report_dir)
    cfg = {"mnbt": int(args["mnbt"]), "max_model_len": int(args["max_model_len"]),
           "max_num_seqs": int(ec.get("max_num_seqs") or args.get("max_num_seqs") or 256),
           "max_num_seqs_source": "the worker's report" if ec.get("max_num_seqs") else
           ("--max-num-seqs" if args.get("max_num_seqs") else "assumed 256 (no overlay report)"),
           "kv_cache_tokens": stk.log_number(a.label, r"KV cache size: ([0-9,]+) tokens"),
           "gpu_memory_utilization": float(args["gpu_memory_utilization"]),
           "device_fraction": a.device_fraction or float(args["gpu_memory_utilization"])}
    res: dict[str, Any] = {"kind": "memory", "label": a.label, "vllm_args": args, "config": cfg,
                           "overlay_env": st.get("overlay_env"), "phases": {}, "seq": 0}
    if os.path.exists(path):
        old = json.load(open(path))
        res["phases"] = {k: v for k, v in old.get("phases", {}).items() if v.get("done")}
        res["seq"] = int(old.get("seq", 0))
        if res["phases"]:
            stk.say(f"{a.label}: memory: keeping {sorted(res['phases'])} from {path}")
    res["headroom"] = headroom_records(report_dir)
    # windows go on from the last one the workers hold (an earlier step against this server, --out another
    # file): a number they have seen would be acknowledged at once, by the old window
    res["seq"] = max([res["seq"], *(int(w.get("seq") or 0) for rt in runtimes(report_dir).values()
                                    for w in rt.get("windows", []))])

    def save() -> None:
        res["wall_s"] = round(time.time() - t_start, 1)
        stk.write_json(path, res)

    sampler = DeviceSampler(st.get("gpu"))
    log = LogTail(os.path.join(d, "serve.log"))
    model, port = stk.served_model(st), st["port"]
    funcs = {"longest": lambda: longest(port, model, cfg, a), "burst": lambda: burst(port, model, cfg, a),
             "mixed": lambda: mixed(port, model, cfg, a), "band": lambda: band(stk, a.label, port, a)}
    rc = 0
    try:
        time.sleep(1.0)
        idle = sampler.peak(time.time() - 1.0, time.time())
        if idle:
            res["device_idle_mib"] = idle
        for name in names:
            if name in res["phases"]:
                continue
            if a.budget_s is not None and time.time() - t_start + phase_seconds(name, a) > a.budget_s:
                stk.say(f"{a.label}: memory: --budget-s {a.budget_s} leaves no room for {name} "
                        "(run the same command again)")
                rc = 3
                break
            res["seq"] += 1
            seq = res["seq"]
            write_mark(report_dir, seq, name)
            ack = await_window(report_dir, seq)
            log.new_lines()
            t0 = time.time()
            stk.say(f"{a.label}: memory: {name} (window {seq}, opened after {ack} s)")
            ph = funcs[name]()
            t1 = time.time()
            res["seq"] += 1
            write_mark(report_dir, res["seq"], f"after {name}")
            ph["close_ack_s"] = await_window(report_dir, res["seq"])
            alive = stk.alive(st["pid"]) and stk.healthy(port)
            lines = log.new_lines()
            peak = sampler.peak(t0, t1)
            total = sampler.total
            ph.update(seq=seq, open_ack_s=ack, seconds=round(t1 - t0, 1), server_alive=alive,
                      oom_lines=[ln[-400:] for ln in lines if OOM.search(ln)][:6],
                      workers=window_of(report_dir, seq), device_peak_mib=peak,
                      device_total_mib=dict(total) or None)
            procs = sampler.process_peaks(t0, t1)
            for pid, w in ph["workers"].items():
                if str(pid).isdigit() and int(pid) in procs:
                    w["driver_peak_mib"] = procs[int(pid)]
            if peak and total:
                ph["device_requested_mib"] = {i: int(cfg["device_fraction"] * total[i]) for i in peak}
                ph["device_within_requested"] = all(peak[i] <= ph["device_requested_mib"][i] for i in peak)
            ph["oom"] = bool(ph["oom_lines"]) or any(OOM.search(e or "") for e in ph.get("errors", []))
            ph["done"] = True
            res["phases"][name] = ph
            save()
            w = [v for v in ph["workers"].values() if v.get("window")]
            stk.say(f"{a.label}: memory: {name}: {ph['requests_ok']} ok / {ph['requests_failed']} failed, "
                    f"{ph['seconds']} s, server {'alive' if alive else 'DEAD'}"
                    + (f", OOM: {ph['oom_lines'][0][-200:]}" if ph["oom_lines"] else "")
                    + "".join(peak_words(v) for v in w)
                    + (f"; device peak {peak} MiB of {total} (requested {ph.get('device_requested_mib')})"
                       if peak else ""))
            if not alive:
                res["server_died_in"] = name
                rc = 1
                break
    finally:
        sampler.stop()
        res["done"] = all(n in res["phases"] for n in names)
        save()
        stk.collect(a.label)
    return rc
