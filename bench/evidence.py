"""Read bench/results/*.json into runs that can be matched to support-level cells (stdlib only).

A run is one boot of vLLM with the overlay (a bench.py result, one configuration of redgreen.py or
v2_runner_h200.py, one label of a stack.py merge or bundle, one `vllm-overlay stress` or
tq_mtp_serve.sh result) and says: vLLM release, platform, model runner built, the patches applied
(in at least one process, failed in none), the date, the outcome, and whether it is proof
(it served traffic: a boot that died, a failed or untested stress, a stock or test-only
configuration is not).

Where a file lacks a field, the overlay reports kept beside it (``logs/reports-NAME``,
``logs/NAME-reports``, ``logs/NAME/reports``, ``logs/NAME``) supply it; else
``bench/results/provenance.json`` does, by hand, with the reason (``supplied``: field -> value for
every run of the file, ``runs``: label -> fields for one run). Supplying a field the file has is an
error. A file of no known format is read as no run and said so (``levels.py --explain``).
"""

from __future__ import annotations

import glob
import json
import os
import re
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
PROVENANCE = os.path.join(RESULTS, "provenance.json")
FIELDS = ("vllm", "platform", "runner", "applied", "date")
TEST_ONLY = ("VLLM_OVERLAY_TEST_BUFFER_ROWS", "VLLM_OVERLAY_TEST_GUARD")


class EvidenceError(ValueError):
    pass


def platform_of_torch(torch: str | None) -> str | None:
    local = (torch or "").partition("+")[2]
    return "cuda" if local.startswith("cu") else "cpu" if local == "cpu" else None


def kept_reports(results: str, name: str) -> list[dict[str, Any]]:
    stem = name.removesuffix(".json")
    for d in (f"reports-{stem}", f"{stem}-reports", os.path.join(stem, "reports"), stem):
        paths = sorted(glob.glob(os.path.join(results, "logs", d, "overlay-*.json")))
        if paths:
            return [json.load(open(p)) for p in paths]
    return []


def processes_of_reports(reps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"role": r.get("role"), "vllm_version": r.get("vllm_version"), "platform": r.get("platform"),
             "runner": r.get("runner"), "started": r.get("started"),
             "patches": {k: v.get("status") for k, v in (r.get("patches") or {}).items()}}
            for r in reps if isinstance(r.get("patches"), dict) and "pid" in r]


def day(text: Any) -> str | None:
    """The day of a date as the files write it ('2026-11-30 22:57:48 UTC', '2026-12-01T12:57:58Z')."""
    m = re.match(r"\d{4}-\d{2}-\d{2}", str(text or ""))
    return m.group(0) if m else None


def from_processes(procs: list[dict[str, Any]]) -> dict[str, Any]:
    """vllm, platform, runner, applied as the processes' records say (absent where none says)."""
    out: dict[str, Any] = {}
    versions = {p.get("vllm_version") for p in procs} - {None}
    platforms = {p.get("platform") for p in procs} - {None}
    runners = {(p.get("runner") or {}).get("kind") for p in procs} - {None, "unknown"}
    for key, found in (("vllm", versions), ("platform", platforms), ("runner", runners)):
        if len(found) == 1:
            out[key] = found.pop()
        elif len(found) > 1:
            out[key] = "several: " + ", ".join(sorted(found))
    started = [p["started"] for p in procs if isinstance(p.get("started"), (int, float))]
    if started:
        out["date"] = time.strftime("%Y-%m-%d", time.gmtime(min(started)))
    statuses = [p.get("patches") or {} for p in procs]
    if any(statuses):
        applied = {pid for s in statuses for pid, st in s.items() if st == "applied"}
        failed = {pid for s in statuses for pid, st in s.items() if st == "failed"}
        if any("counters" in p for p in procs):  # a patch whose spec names counters must have moved one
            from vllm_overlay.tools import matrix

            specs = {s.id: s for s in matrix.specs()}
            quiet = {pid for pid in applied if not acted(specs.get(pid), procs)}
            if quiet:
                out["applied_quiet"] = sorted(quiet)
            applied -= quiet
        out["applied"] = sorted(applied - failed)
    return out


def acted(spec: Any, procs: list[dict[str, Any]]) -> bool:
    """Whether the processes' counters show the patch of ``spec`` (None: an id no spec has) acted: one
    of its ``shown_by`` counters above 0 (a patch without such counters: applied is all a result can
    show, unless one of its ``idle_by`` counters says it did nothing there)."""
    need = spec.shown_by if spec is not None else ()
    if need:
        return any((p.get("counters") or {}).get(c) for p in procs for c in need)
    idle = spec.idle_by if spec is not None else ()  # applied, but a counter says it did nothing there
    return not any((p.get("counters") or {}).get(c) for p in procs for c in idle)


def run(label: str | None, fields: dict[str, Any], proof: bool, outcome: str) -> dict[str, Any]:
    fields = {**fields, "date": day(fields.get("date"))}
    return {"run": label, **{k: v for k, v in fields.items() if v is not None}, "proof": proof, "outcome": outcome}


def env_disqualifies(env: dict[str, str] | None) -> str | None:
    env = env or {}
    if env.get("VLLM_OVERLAY") == "0":
        return "stock (VLLM_OVERLAY=0)"
    test = [k for k in TEST_ONLY if k in env]
    return f"test-only settings {', '.join(test)}" if test else None


# ---- the formats ------------------------------------------------------------------------------


def read_bench(d: dict[str, Any], reps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    env = d.get("environment") or {}
    f = {"vllm": env.get("vllm"), "platform": platform_of_torch(env.get("torch")), "date": env.get("date")}
    rp = d.get("reports") or {}
    procs = processes_of_reports(reps) if reps else rp.get("processes") or []
    f = {**from_processes(procs), **{k: v for k, v in f.items() if v}}
    if "applied" not in f and rp.get("patches"):
        f["applied"] = sorted(p for p, s in rp["patches"].items() if s == "applied")
    if d.get("config") != "overlay":
        return [run(None, f, False, f"configuration {d.get('config')!r}: not the overlay's defaults")]
    if d.get("ok") is not True:
        return [run(None, f, False, f"did not finish: {d.get('failure') or 'returncode ' + str(d.get('returncode'))}")]
    soak = d.get("soak") or {}
    what = f"served {len(d.get('workloads') or {})} workloads" + (
        f", soak {soak.get('requests_ok')} requests ok, {soak.get('requests_failed')} failed" if soak else "")
    if soak.get("requests_failed"):
        return [run(None, f, False, what)]
    return [run(None, f, True, what)]


def read_configs(d: dict[str, Any], reps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    env = d.get("environment") or {}
    out = []
    for label, c in (d.get("configs") or {}).items():
        f = {"vllm": env.get("vllm"), "platform": platform_of_torch(env.get("torch")), "date": env.get("date")}
        procs = [{"vllm_version": w.get("vllm_version"), "runner": w.get("runner"),
                  "patches": {p: (s or {}).get("status") for p, s in (w.get("patches") or {}).items()}}
                 for w in (c.get("runner_evidence") or {}).get("workers", [])] \
            or (c.get("reports") or {}).get("processes") or []
        f.update(from_processes(procs))
        patches = (c.get("reports") or {}).get("patches")
        if patches and "applied" not in f:
            f["applied"] = sorted(p for p, s in patches.items() if s == "applied")
        bad = env_disqualifies(c.get("env"))
        if bad:
            out.append(run(label, f, False, bad))
        elif c.get("ok") is not True:
            why = c.get("error") or c.get("failure") or f"returncode {c.get('returncode')}"
            out.append(run(label, f, False, f"died or failed: {str(why)[:160]}"))
        else:
            out.append(run(label, f, True, f"served ({c.get('boot_s')} s boot)"))
    return out


def judge_served(s: dict[str, Any]) -> tuple[bool, str]:
    """A stack.py summary: proof when the server became healthy, did not die, and served traffic
    (a stress that PASSED, or decode / steps / logprob measurements)."""
    bad = env_disqualifies(s.get("overlay_env"))
    if s.get("config") != "overlay" or bad:
        return False, bad or f"configuration {s.get('config')!r}"
    if s.get("died_after_s") is not None or s.get("healthy_after_s") is None:
        return False, f"died at boot: {s.get('failure_class') or (s.get('first_error_lines') or ['?'])[-1][-160:]}"
    stress = s.get("stress") or {}
    healthy = f"healthy after {s['healthy_after_s']} s"
    if stress:
        ok = stress.get("verdict") == "PASSED"
        return ok, f"{healthy}; stress {stress.get('verdict')}: {stress.get('why')}"
    served = [k for k in s if k in ("decode", "logprobs") or k.startswith("steps")]
    if served:
        return True, f"{healthy}; served {', '.join(sorted(served))}"
    phases = ((s.get("memory") or {}).get("phases") or {})
    if phases:  # the memory step's traffic phases (bench/memory_serve.py)
        bad = [n for n, ph in phases.items() if ph.get("requests_failed") or ph.get("oom")
               or not ph.get("server_alive") or not ph.get("requests_ok")]
        if bad:
            return False, f"{healthy}; memory phases failed, ran out of memory or ended the server: {', '.join(bad)}"
        ok = sum(int(ph.get("requests_ok") or 0) for ph in phases.values())
        return True, f"{healthy}; memory phases {', '.join(phases)}: {ok} requests, none failed"
    return False, f"{healthy}; no traffic recorded"


def summary_run(label: str, s: dict[str, Any], date: str | None) -> dict[str, Any]:
    f = {"date": s.get("started_utc") or date, **from_processes(s.get("processes") or [])}
    proof, outcome = judge_served(s)
    return run(label, f, proof, outcome)


def read_stack(d: dict[str, Any], reps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [summary_run(label, s, None) for label, s in (d.get("runs") or {}).items()]


def read_bundle(d: dict[str, Any], reps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [summary_run(d.get("label") or "bundle", d["summary"], d.get("written_utc"))]


def read_stress(d: dict[str, Any], reps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    f = from_processes(d.get("processes") or processes_of_reports(reps))
    if d.get("date"):
        f["date"] = d["date"]
    ok = d.get("verdict") == "PASSED"
    return [run(None, f, ok, f"stress {d.get('verdict')}: {d.get('why')}")]


def read_serve_script(d: dict[str, Any], reps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    f = from_processes(processes_of_reports(reps)) if reps else {}
    stress = d.get("stress") or {}
    ok = stress.get("verdict") == "PASSED"
    return [run(None, f, ok, f"{d.get('phase_reached')}; stress {stress.get('verdict')}: {stress.get('why')}")]


def kind(d: Any) -> str | None:
    if not isinstance(d, dict):
        return None
    script = d.get("script")
    if script == "bench/bench.py":
        return "bench"
    if script == "bench/stack.py" and isinstance(d.get("runs"), dict):
        return "stack"
    if isinstance(d.get("configs"), dict) and "environment" in d:
        return "configs"
    if isinstance(d.get("summary"), dict) and "label" in d:
        return "bundle"
    if "verdict" in d and "plan" in d and "mode" in d:
        return "stress"
    if "phase_reached" in d:
        return "serve-script"
    if "gpu" in d and ("results" in d or "accuracy" in d) and "configs" not in d:
        return "kernel"
    return None


READERS = {"bench": read_bench, "configs": read_configs, "stack": read_stack, "bundle": read_bundle,
           "stress": read_stress, "serve-script": read_serve_script}


def load_provenance(path: str = PROVENANCE) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    return json.load(open(path)).get("files", {})


def supply(name: str, runs: list[dict[str, Any]], entry: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Fill what the file lacks from its provenance entry; naming a field the file has is an error."""
    entry = entry or {}
    for r in runs:
        given = {**entry.get("supplied", {}), **entry.get("runs", {}).get(r["run"] or "", {})}
        for key, value in given.items():
            if key not in FIELDS:
                raise EvidenceError(f"provenance.json: {name}: field {key!r}: expected one of {', '.join(FIELDS)}")
            if key in r:
                raise EvidenceError(f"provenance.json: {name}: run {r['run']}: field {key!r} is in the file "
                                    f"({r[key]!r}); supply only what a file lacks")
            r[key] = value
        r["by_hand"] = sorted(given)
        if given:
            r["by_hand_why"] = entry.get("why", "")
        missing = [k for k in FIELDS if k not in r]
        if missing and r["proof"]:
            r["proof"] = False
            r["outcome"] += f"; not matched to a cell: the file lacks {', '.join(missing)} (no provenance entry)"
    return runs


def read_file(path: str, provenance: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """(runs, what the file is)."""
    name = os.path.basename(path)
    d = json.load(open(path))
    k = kind(d)
    entry = provenance.get(name)
    if entry and entry.get("not_evidence"):
        return [], f"not evidence (by hand): {entry['not_evidence']}"
    if k == "kernel":
        return [], "kernel benchmark: no engine with the overlay"
    if k is None:
        return [], "format not recognised: no run read (add a reader here or a provenance entry)"
    runs = READERS[k](d, kept_reports(os.path.dirname(path), name))
    for r in runs:
        r["file"] = f"bench/results/{name}"
    return supply(name, runs, entry), k


def read_all(results: str = RESULTS, provenance_path: str = PROVENANCE) -> tuple[list[dict[str, Any]], list[str]]:
    """Every run of every result file, and one line per file that holds none."""
    prov = load_provenance(provenance_path)
    names = {os.path.basename(p) for p in glob.glob(os.path.join(results, "*.json"))} - {"provenance.json"}
    unknown = sorted(set(prov) - names)
    if unknown:
        raise EvidenceError(f"provenance.json names files that are not in bench/results: {', '.join(unknown)}")
    runs, none = [], []
    for name in sorted(names):
        got, what = read_file(os.path.join(results, name), prov)
        runs += got
        if not got:
            none.append(f"bench/results/{name}: {what}")
    return runs, none
