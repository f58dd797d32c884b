"""Reading the per-process JSON reports of a run (used by the CLI, the stress harness and /metrics).

An engine core's report may carry its worker ranks' reports (``ranks``, patch rank-reports: gathered
through vLLM's executor, for workers whose report directory is on another host); ``expand`` lists
them beside it, ``dedupe`` keeps one report per process (a worker's own file and its gathered copy,
where both are readable: the newer), and ``missing_ranks`` the ranks that sent none.
"""

from __future__ import annotations

import glob
import json
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from vllm_overlay import report_files
from vllm_overlay.errors import OverlayError


@dataclass
class Scan:
    """A report directory read for one server: its reports, the other servers' reports (not
    counted, named), and the files that are not reports (skipped, with why)."""

    reports: list[dict[str, Any]] = field(default_factory=list)
    foreign: list[dict[str, Any]] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # path -> why
    missing: list[dict[str, Any]] = field(default_factory=list)  # ranks that sent no report (missing_ranks)


def scan(directory: str, since: float | None = None, server: str | None = None) -> Scan:
    """Every ``overlay-*.json`` in ``directory`` (written at or after ``since``, if given); with
    ``server``, only the reports carrying that server id count, the others are ``foreign``."""
    if not os.path.isdir(directory):
        raise OverlayError(f"report DIR {directory!r}: not a directory")
    out = Scan()
    for path in sorted(glob.glob(report_files.all_glob(directory))):
        try:
            with open(path) as f:
                rep = json.load(f)
        except OSError:
            continue  # removed since the listing
        except ValueError as exc:
            out.skipped[path] = f"not JSON: {exc}"
            continue
        why = problem(rep)
        if why is not None:
            out.skipped[path] = why
            continue
        if since is not None and rep.get("written", 0) < since:
            continue
        rep["_path"] = path
        if server is not None and rep.get("server_id") != server:
            out.foreign.append(rep)
        else:
            out.reports.append(rep)
    out.reports = dedupe([r for rep in out.reports for r in expand(rep)])
    out.missing = missing_ranks(out.reports)
    return out


def where(rep: dict[str, Any]) -> str:
    """Where a loaded report came from: its file, or the engine core's file it was gathered in (a
    worker's report that ``expand`` took from its engine core's has no file of its own)."""
    if rep.get("_path"):
        return str(rep["_path"])
    return f"gathered in {rep.get('_via') or 'an engine core report'}"


def expand(rep: dict[str, Any]) -> list[dict[str, Any]]:
    """``rep`` and the worker reports its engine core gathered (each with ``_via``: the file they
    came in). Where no step ran since the gather, the ranks' reports are as current as the engine
    core's own (a worker changes only in a step), so they take its ``written``."""
    ranks = rep.get("ranks") or {}
    out = [rep]
    for sub in ranks.get("reports") or []:
        sub = dict(sub)
        sub["_via"] = rep.get("_path", "")
        if not ranks.get("stepped_since") and isinstance(rep.get("written"), (int, float)):
            sub["written"] = max(float(sub.get("written") or 0), float(rep["written"]))
        out.append(sub)
    return out


def dedupe(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One report per process (host, pid, instance): the most recently written."""
    best: dict[tuple[Any, ...], dict[str, Any]] = {}
    for rep in reports:
        key = (rep.get("host"), rep.get("pid"), rep.get("instance") or rep.get("_path"))
        have = best.get(key)
        if have is None or float(rep.get("written") or 0) > float(have.get("written") or 0):
            best[key] = rep
    return list(best.values())


def missing_ranks(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The worker ranks an engine core expected and got no report from: each with the engine
    core's pid and host, the rank and why."""
    out = []
    for rep in reports:
        for m in (rep.get("ranks") or {}).get("missing") or []:
            out.append({"engine_pid": rep.get("pid"), "host": rep.get("host"), "rank": m.get("rank"),
                        "why": str(m.get("why", ""))})
    return out


def load(directory: str, since: float | None = None) -> list[dict[str, Any]]:
    """Every well-formed ``overlay-*.json`` in ``directory`` (written at or after ``since``)."""
    return scan(directory, since).reports


_SHAPES: dict[str, type | tuple[type, ...]] = {
    "counters": dict, "buffers": list, "patches": dict, "engine_config": dict, "telemetry": dict,
    "counts": dict, "events": list, "runner": dict, "budgets": list, "written": (int, float),
    "server_id": (str, type(None)), "role": str, "tp_rank": (int, type(None)), "ranks": dict,
}


def gone_before(rep: dict[str, Any], started: float | None) -> bool:
    """Whether ``rep`` is an earlier server's: written on this host before ``started`` (the reading
    process's start) by a process that no longer runs here. Restarts under one hand-set server id
    share its file names' key, so such files sit beside the current ones until pruned; they are not
    counted. A report gathered from a rank (``_via``), one from another host, or one whose process
    runs (or cannot be checked) is kept."""
    if started is None or rep.get("_via") or rep.get("host") != socket.gethostname():
        return False
    if float(rep.get("written") or 0) >= started:
        return False
    try:
        os.kill(int(rep["pid"]), 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return False


def problem(rep: Any) -> str | None:
    """Why ``rep`` is not a report this release can read, or None."""
    if not isinstance(rep, dict):
        return f"expected a JSON object, found {type(rep).__name__}"
    if not isinstance(rep.get("pid"), int):
        return "no integer pid"
    for key, kind in _SHAPES.items():
        if key in rep and not isinstance(rep[key], kind):
            return f"field {key!r} is {type(rep[key]).__name__}"
    for b in rep.get("buffers", []):
        if not isinstance(b, dict):
            return "field 'buffers' holds a non-object"
    ranks = rep.get("ranks") or {}
    if not isinstance(ranks.get("reports", []), list) or not isinstance(ranks.get("missing", []), list):
        return "field 'ranks' holds no lists of reports and missing ranks"
    for sub in ranks.get("reports", []):
        why = problem(sub)
        if why is not None:
            return f"a gathered rank report: {why}"
    for m in ranks.get("missing", []):
        if not isinstance(m, dict):
            return "field 'ranks' holds a missing rank that is not an object"
    for pid, rec in (rep.get("patches") or {}).items():
        if not isinstance(rec, dict):
            return f"patch {pid!r} is not an object"
    for key in ("forwards", "dummy_forwards"):
        hist = (rep.get("telemetry") or {}).get(key)
        if hist is None:
            continue
        sizes = hist.get("sizes") if isinstance(hist, dict) else None
        if not isinstance(sizes, dict) or not all(
                str(k).isdigit() and isinstance(v, int) for k, v in sizes.items()):
            return f"telemetry {key!r} has no sizes of integer counts"
    return None
