"""What a server left behind, gathered into $OUT/LABEL (or one $OUT/LABEL.json with --compact): the
summary (health, model runner, overlay reports, spec-decode counters), result files and the log."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import time
import urllib.request
from typing import Any

from .server import (
    alive, compact, load_state, log_excerpt, LOG_HEAD, LOG_TAIL, out_base, out_dir, say, sdir, SPEC_METRIC,
    write_json)


def parse_spec_counters(text: str) -> dict[str, float]:
    vals: dict[str, float] = {}
    for line in text.splitlines():
        m = SPEC_METRIC.match(line)
        if m:
            vals[m.group(1)] = vals.get(m.group(1), 0.0) + float(m.group(3))
    return vals


def spec_counters(port: int) -> dict[str, float]:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=20).read().decode()
    except Exception:  # noqa: BLE001
        return {}
    return parse_spec_counters(text)


def overlay_reports(d: str) -> list[dict[str, Any]]:
    """The overlay's report files in D/reports (one per process), by file name; a file being written or
    replaced at that moment is left out (the next read has it)."""
    out = []
    for path in sorted(glob.glob(os.path.join(d, "reports", "overlay-*.json"))):
        try:
            out.append(json.load(open(path)))
        except Exception:  # noqa: BLE001 - a report being written
            continue
    return out


def classify(text: str) -> str | None:
    from bench import common

    return common.classify(text)


def steps_brief(data: dict[str, Any]) -> dict[str, Any]:
    """A steps file without the per-round chunk times."""
    return {**data, "points": {k: {kk: vv for kk, vv in v.items() if kk != "raw_last_rep"}
                               for k, v in data.get("points", {}).items()}}


def result_files(label: str) -> dict[str, Any]:
    """The result files of a label's state folder (decode.json, steps, logprob runs), by file name."""
    out = {}
    for path in sorted(glob.glob(os.path.join(sdir(label), "*.json"))):
        if os.path.basename(path) == "state.json":
            continue
        try:
            out[os.path.basename(path)] = json.load(open(path))
        except Exception:  # noqa: BLE001 - being written
            continue
    return out


def continuation_brief(data: dict[str, Any]) -> dict[str, Any]:
    """A continuation run per trial: the continuing request's and the fresh one's pair-vs-alone comparison,
    the cached tokens, and what the overlay counted during the pair."""
    out = []
    for t in data.get("trials") or []:
        row: dict[str, Any] = {"trial": t.get("trial"), "errors": t.get("errors"), "cached_tokens": t.get("cached_tokens"),
                               "pair_overlay": t.get("pair_overlay")}
        for key in ("cont_vs_alone", "fresh_vs_alone"):
            c = t.get(key)
            if c:
                row[key] = {"first_token": c["first_token"], "later_tokens": c["later_tokens"],
                            "same_tokens": c["same_tokens"]}
        out.append(row)
    return {k: data.get(k) for k in ("prefix", "cont", "fresh", "top", "max_tokens")} | {"trials": out}


def attach_results(s: dict[str, Any], files: dict[str, Any]) -> None:
    """The summary's view of result files: steps (without chunk times) and logprob runs by name."""
    for name, data in files.items():
        if not isinstance(data, dict):
            continue
        if data.get("kind") == "steps":
            key = "steps" if name == "steps.json" else f"steps:{name.removesuffix('.json')}"
            s[key] = steps_brief(data)
        elif data.get("kind") == "logprobs":
            s.setdefault("logprobs", {})[name.removesuffix(".json")] = data
        elif data.get("kind") == "memory":
            s["memory"] = data
        elif data.get("kind") == "continuation":
            s["continuation"] = continuation_brief(data)


RUNNER_V2_LINE = "Using V2 Model Runner"  # vLLM's worker logs it when it builds Model Runner V2 (0.2x)


def runner_evidence(d: str, log_text: str) -> dict[str, Any]:
    """Which model runner each worker built and what the overlay's runner hooks did, from the overlay's
    reports in D/reports (a stock server has none: then only vLLM's own log line says V2).

    Per worker: the runner (kind, class), per runner patch the hooks it has on that runner, those that
    fired and those missing (checked after the worker's first forward), telemetry forward counts,
    guard checks and trips. Then one flag per question: built (the kinds built, or from the log),
    telemetry_fired, guard_fired, cap_fired, precapture_forward, hooks_missing, capacity_error."""
    workers = []
    for r in overlay_reports(d):
        if not (r.get("runner") or r.get("engine_config")):
            continue  # the API server: no runner
        hooks = {pid: rec["runner"] for pid, rec in (r.get("patches") or {}).items()
                 if isinstance(rec, dict) and isinstance(rec.get("runner"), dict)}
        tel = r.get("telemetry") if isinstance(r.get("telemetry"), dict) else {}
        counters = r.get("counters") or {}
        workers.append({
            "pid": r.get("pid"), "role": r.get("role"), "tp_rank": r.get("tp_rank"),
            "vllm_version": r.get("vllm_version"), "runner": r.get("runner"),
            "hooks": {pid: {k: h.get(k) for k in ("kind", "hooks", "fired", "missing")} for pid, h in hooks.items()},
            "forwards": (tel.get("forwards") or {}).get("count"),
            "dummy_forwards": (tel.get("dummy_forwards") or {}).get("count"),
            "profile_forward_tokens": tel.get("profile_forward_tokens"),
            "counters": {k: counters[k] for k in ("guard_checks", "guard_trips", "guard_unreadable",
                                                  "runner_hooks_not_fired") if k in counters},
            "events": [e for e in (r.get("events") or []) if any(w in e for w in (
                "profile-run-cap", "guard", "did not fire", "Model Runner V2", "memory-headroom"))][-12:],
        })
    kinds = sorted({(w["runner"] or {}).get("kind") or "unknown" for w in workers if w["runner"]})
    events = [e for w in workers for e in w["events"]]
    fired = {p: set() for p in ("forward-telemetry", "gdn-output-prealloc", "profile-run-cap")}
    for w in workers:
        for p, h in w["hooks"].items():
            fired.setdefault(p, set()).update(h.get("fired") or [])
    return {
        "workers": workers,
        "built": kinds or (["V2"] if RUNNER_V2_LINE in log_text else []),
        "built_from": "overlay reports" if kinds else ("vLLM's log" if RUNNER_V2_LINE in log_text else None),
        "log_says_v2": RUNNER_V2_LINE in log_text,
        "telemetry_fired": bool(fired["forward-telemetry"] & {"execute_model", "_model_forward"}),
        "guard_fired": bool(fired["gdn-output-prealloc"] & {"prepare_inputs", "_model_forward"}),
        "guard_checks": sum(w["counters"].get("guard_checks", 0) for w in workers),
        "guard_trips": sum(w["counters"].get("guard_trips", 0) for w in workers),
        "cap_fired": any("profiling forward capped" in e for e in events),
        "precapture_forward": any("before CUDA graph capture" in e for e in events),
        "hooks_missing": {f"{w['pid']}:{p}": h["missing"] for w in workers for p, h in w["hooks"].items()
                          if h.get("missing")},
        "forwards": sum(w["forwards"] or 0 for w in workers if w["tp_rank"] in (None, 0)),
        "capacity_error": "CapacityError" in log_text or "exceeds the GDN output buffer" in log_text,
    }


def summarize(label: str) -> dict:
    st = load_state(label)
    d = sdir(label)
    text = open(os.path.join(d, "serve.log"), errors="replace").read()
    s = {k: st.get(k) for k in ("config", "started_utc", "vllm_args", "overlay_env", "vllm_env", "healthy_after_s",
                                 "died_after_s", "stress_runs", "gpu", "model", "serve_entry", "stopped_after_s",
                                 "gpu_freed", "series")}
    s["server_alive"] = alive(st["pid"])
    for key, pat in (("kv_cache_tokens", r"KV cache size: ([0-9,]+) tokens"),
                     ("init_engine_s", r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+)"),
                     ("model_weights_gib", r"Model loading took ([0-9.]+) GiB"),
                     ("profiling_s", r"Initial profiling/warmup run took ([0-9.]+) s"),
                     ("graph_capture_s", r"Graph capturing finished in ([0-9.]+) secs")):
        found = [float(m.replace(",", "")) for m in re.findall(pat, text)]
        if found:
            s[key] = found if len(found) > 1 else found[0]
    s["kv_cache_lines"] = [ln.strip()[-200:] for ln in text.splitlines() if "KV cache size" in ln][:8]
    # the CUDA graphs vLLM captured, as its progress bars name them ("(decode, FULL)" on V1: verify batches)
    s["graph_captures"] = sorted(set(re.findall(r"Capturing CUDA graphs[^:\r\n(]*\([^)\r\n]*\)", text)))
    s["overlay_summary_lines"] = [ln.strip()[-400:] for ln in text.splitlines() if "[vllm-overlay] pid" in ln][-12:]
    s["first_error_lines"] = [ln.strip()[-400:] for ln in text.splitlines()
                              if re.search(r"Error|Traceback|CapacityError|illegal memory|setStorage", ln)][:25]
    s["failure_class"] = classify(text)
    procs = []
    for r in overlay_reports(d):
        statuses = {pid: rec.get("status") for pid, rec in (r.get("patches") or {}).items()}
        procs.append({"pid": r.get("pid"), "role": r.get("role"), "tp_rank": r.get("tp_rank"),
                      "vllm_version": r.get("vllm_version"), "platform": r.get("platform"),
                      "runner": r.get("runner"), "counts": r.get("counts"), "patches": statuses,
                      "counters": r.get("counters"),
                      "buffers": [{k: b.get(k) for k in ("rows", "bytes", "source", "requested_source") if k in b}
                                  for b in r.get("buffers", [])][:4]})
    s["processes"] = procs
    s["runner_evidence"] = runner_evidence(d, text)
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
    attach_results(s, result_files(label))
    s["spec_decode_now"] = spec_counters(st["port"]) if s["server_alive"] else None
    return s


def collect(label: str) -> None:
    d = sdir(label)
    s = summarize(label)
    if compact():
        reports = overlay_reports(d)
        stress = os.path.join(d, "stress", "stress.json")
        logs = {}
        for name, head, limit in (("serve.log", LOG_HEAD, LOG_TAIL), ("stress.log", 0, 20_000)):
            if os.path.exists(os.path.join(d, name)):
                logs[name] = log_excerpt(open(os.path.join(d, name), "rb").read(), head, limit)
        bundle = {"label": label, "written_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "summary": s, "files": {**result_files(label), "state.json": load_state(label)},
                  "stress": json.load(open(stress)) if os.path.exists(stress) else None,
                  "reports": reports, "logs": logs}
        os.makedirs(out_base(), exist_ok=True)
        write_json(os.path.join(out_base(), f"{label}.json"), bundle)
    else:
        o = out_dir(label)
        text = open(os.path.join(d, "serve.log"), "rb").read()
        open(os.path.join(o, "serve.log"), "wb").write(text[-400_000:])
        for sub in ("reports", "stress"):
            if os.path.isdir(os.path.join(d, sub)):
                shutil.copytree(os.path.join(d, sub), os.path.join(o, sub), dirs_exist_ok=True)
        for f in [*sorted(glob.glob(os.path.join(d, "*.json"))), os.path.join(d, "stress.log")]:
            if os.path.exists(f):
                shutil.copy(f, o)
        json.dump(s, open(os.path.join(o, "summary.json"), "w"), indent=1)
    brief = {k: s.get(k) for k in ("config", "healthy_after_s", "died_after_s", "server_alive", "kv_cache_tokens",
                                   "failure_class")}
    say(f"{label}: {json.dumps(brief)}")
    for p in s["processes"]:
        say(f"{label}: report pid {p['pid']} role {p['role']} tp_rank {p['tp_rank']} runner {p.get('runner')}: "
            f"{json.dumps(p['counts'])}")
    if "stress" in s:
        say(f"{label}: stress {json.dumps({k: s['stress'][k] for k in ('verdict', 'why', 'band_forwards', 'requests_failed', 'max_forward')})}")


def runner_env(run: dict[str, Any]) -> str | None:
    return (run.get("vllm_env") or {}).get("VLLM_USE_V2_MODEL_RUNNER")
