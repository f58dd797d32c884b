"""`merge`: runs from folders, labels or compact bundles into one result, with the logprob
comparisons of runs on one model and the verdicts of the series that booted them."""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from typing import Any

from .. import serve_measure as sm  # bench/serve_measure.py (stdlib only)
from .server import say
from .collect import attach_results, classify, runner_env
from .series import SERIES


def load_run(item: str) -> tuple[str, dict[str, Any]]:
    """NAME=DIR (a run's folder with summary.json) or NAME=LABEL.json (a compact bundle)."""
    name, _, path = item.partition("=")
    if glob.has_magic(path):  # the same label's bundle copied off a host several times: the newest
        found = [(json.load(open(p)).get("written_utc") or "", p) for p in glob.glob(path) if os.path.isfile(p)]
        if not found:
            sys.exit(f"stack: merge: {item!r}: no file matches {path}")
        path = max(found)[1]
        say(f"merge: {name}: {path} (newest of {len(found)})")
    if path and os.path.isfile(path):
        bundle = json.load(open(path))
        if not ("summary" in bundle and "files" in bundle):
            sys.exit(f"stack: merge: {item!r}: {path} is not a bundle written with --compact")
        s = bundle["summary"]
        text = (bundle.get("logs") or {}).get("serve.log")
        files = {k: v for k, v in bundle["files"].items() if k != "state.json"}
        by_pid = {r.get("pid"): r for r in bundle.get("reports") or [] if isinstance(r, dict)}
        for proc in s.get("processes") or []:  # a summary written before it recorded them: the reports say
            for key in ("vllm_version", "platform"):
                if proc.get(key) is None and (by_pid.get(proc.get("pid")) or {}).get(key) is not None:
                    proc[key] = by_pid[proc["pid"]][key]
    elif path and os.path.isfile(os.path.join(path, "summary.json")):
        s = json.load(open(os.path.join(path, "summary.json")))
        log = os.path.join(path, "serve.log")
        text = open(log, errors="replace").read() if os.path.isfile(log) else None
        files = {}
        for f in sorted(glob.glob(os.path.join(path, "*.json"))):
            if os.path.basename(f) not in ("summary.json", "state.json"):
                files[os.path.basename(f)] = json.load(open(f))
    else:
        sys.exit(f"stack: merge: {item!r}: expected NAME=DIR with DIR/summary.json or NAME=LABEL.json (compact)")
    if not name:
        sys.exit(f"stack: merge: {item!r}: the run needs a NAME before '='")
    s.pop("kv_cache_lines", None)
    if text is not None:  # classes added since the run are applied too
        s["failure_class"] = classify(text)
    s["first_error_lines"] = [ln for ln in s.get("first_error_lines", [])
                              if not re.search(r"ulimit|Tokenizer not available|base.py:255", ln)][:12]
    s.pop("logprobs", None)
    attach_results(s, files)
    return name, s


def logprob_pairs(runs: dict[str, dict[str, Any]], top: int = 20) -> dict[str, Any]:
    """Pairs of runs compared on each logprob run both have under the same name: with the same
    configuration, those that differ in exactly one of (KV dtype, speculative tokens) (MTP on vs off with
    one KV dtype); an overlay configuration and stock with the same KV dtype, speculative tokens and
    VLLM_USE_V2_MODEL_RUNNER (outputs match stock on one runner)."""
    out = {}
    names = list(runs)
    for i, x in enumerate(names):
        for y in names[i + 1:]:
            ax, ay = runs[x].get("vllm_args") or {}, runs[y].get("vllm_args") or {}
            same_kv = ax.get("kv_cache_dtype") == ay.get("kv_cache_dtype")
            same_mtp = bool(ax.get("mtp")) == bool(ay.get("mtp"))
            cx, cy = runs[x].get("config"), runs[y].get("config")
            if cx != cy:
                if "stock" not in (cx, cy) or not (same_kv and same_mtp) or runner_env(runs[x]) != runner_env(runs[y]):
                    continue
                first, second = (y, x) if cx == "stock" else (x, y)
                what = "overlay vs stock"
            elif same_kv == same_mtp:
                continue
            else:
                first, second = (x, y) if (ax.get("mtp") or 0) >= (ay.get("mtp") or 0) else (y, x)
                what = "MTP on vs off" if same_kv else "KV dtype"
            for lp in sorted(set(runs[x].get("logprobs") or {}) & set(runs[y].get("logprobs") or {})):
                try:
                    c = sm.compare_logprobs(runs[first]["logprobs"][lp], runs[second]["logprobs"][lp], top)
                except ValueError as exc:
                    c = {"error": str(exc)}
                c["what"] = what
                out[f"{first} vs {second} ({lp})"] = c
    return out


def cmd_merge(a: argparse.Namespace) -> int:
    """One result file for bench/results from the `summary.json` files (or compact bundles) of several
    runs (a run's DIR is what was copied off the host for its LABEL; the newest summary of a run wins)."""
    res: dict = {"script": "bench/stack.py", "note": a.note, "runs": {}}
    for item in a.runs:
        name, s = load_run(item)
        res["runs"][name] = s
    pairs = logprob_pairs(res["runs"])
    if pairs:
        res["logprobs_compare"] = pairs
        for k, c in pairs.items():
            say(f"logprobs {k}: {c.get('error') or sm.describe_comparison(c)}")
    for series, spec in SERIES.items():  # a series' verdict on the runs it booted
        own = {n: r for n, r in res["runs"].items() if (r.get("series") or {}).get("series") == series}
        lines = spec["verdict"](own, pairs) if spec.get("verdict") and own else []
        if lines:
            res.setdefault("verdicts", {})[series] = lines
            for line in lines:
                say(f"verdict ({series}): {line}")
    table = sm.steps_table(res["runs"])
    if table:
        print("\n".join(table))
    json.dump(res, open(a.result, "w"), indent=1)
    say(f"wrote {a.result} ({', '.join(res['runs'])})")
    return 0
