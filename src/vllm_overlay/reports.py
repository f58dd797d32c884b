"""Reading the per-process JSON reports of a run (used by the CLI, the stress harness and /metrics).

An engine core's report may carry its worker ranks' reports (``ranks``, patch rank-reports: gathered
through vLLM's executor, for workers whose report directory is on another host); ``expand`` lists
them beside it, ``dedupe`` keeps one report per process (a worker's own file and its gathered copy,
where both are readable: the newer), and ``missing_ranks`` the ranks that sent none.

Files are read through ``report_files.read`` (regular files only, never blocking, size-limited).
``process_gone`` tells a report whose process no longer runs on this host; ``servers`` the live
servers (process trees, ``server_tree``) behind the reports of one server id.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from vllm_overlay import report_files, server_id
from vllm_overlay.errors import OverlayError
from vllm_overlay.spec import WORKER_MODULES


@dataclass
class Scan:
    """A report directory read for one server: its reports, the other servers' reports (not
    counted, named), and the files that are not reports (skipped, with why)."""

    reports: list[dict[str, Any]] = field(default_factory=list)
    foreign: list[dict[str, Any]] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # path -> why
    missing: list[dict[str, Any]] = field(default_factory=list)  # ranks that sent no report (missing_ranks)
    gone: list[str] = field(default_factory=list)  # with live=True: reports of processes gone, left out

    def servers(self) -> dict[str, list[dict[str, Any]]]:
        return servers(self.reports)


def is_worker(rep: dict[str, Any]) -> bool:
    """Whether the process of ``rep`` is (also) a worker: its role names a worker."""
    return "worker" in str(rep.get("role", ""))


def shown_status(rep: dict[str, Any], rec: dict[str, Any]) -> str:
    """A patch's status in the process of ``rep`` as reports and /metrics show it: the report's own,
    except ``worker-only`` for a patch armed in a process that is no worker (API server, engine core)
    while every module it waits for is one vLLM imports in workers only (spec.WORKER_MODULES): it acts in
    the workers, and this process never imports those modules (were one imported, it would apply)."""
    status = str(rec.get("status", ""))
    pending = [str(m) for m in rec.get("pending_modules") or []]
    if status == "armed" and pending and not is_worker(rep) and all(m.startswith(WORKER_MODULES) for m in pending):
        return "worker-only"
    return status


def waiting_for(rec: dict[str, Any]) -> str:
    """The modules an armed patch waits for, comma-separated ('' for any other status)."""
    return ",".join(str(m) for m in rec.get("pending_modules") or []) if rec.get("status") == "armed" else ""


def load_file(path: str) -> tuple[dict[str, Any] | None, str | None]:
    """(the report in ``path``, None) or (None, why it is not one); (None, None) when it is gone."""
    try:
        raw = report_files.read(path)
    except FileNotFoundError:
        return None, None  # removed since the listing
    except report_files.Unreadable as exc:
        return None, str(exc)
    except OSError as exc:
        return None, f"cannot read it: {exc.strerror or exc}"
    try:
        rep = json.loads(raw)
    except ValueError as exc:  # the writers rename whole files: never half-written
        return None, f"not JSON: {exc}"
    why = problem(rep)
    return (None, why) if why is not None else (rep, None)


def scan(directory: str, since: float | None = None, server: str | None = None, live: bool = False) -> Scan:
    """Every ``overlay-*.json`` in ``directory`` (written at or after ``since``, if given); with
    ``server``, only the reports carrying that server id count, the others are ``foreign``; with
    ``live``, reports of processes gone from this host are left out (``gone``)."""
    if not os.path.isdir(directory):
        raise OverlayError(f"report DIR {directory!r}: not a directory")
    out = Scan()
    for path, _ in sorted(report_files.entries(directory)):
        rep, why = load_file(path)
        if why is not None:
            out.skipped[path] = why
            continue
        if rep is None:
            continue
        if since is not None and rep.get("written", 0) < since:
            continue
        rep["_path"] = path
        if live and process_gone(rep):
            out.gone.append(path)
            continue
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
    "server_id": (str, type(None)), "server_tree": (str, type(None)), "role": str, "tp_rank": (int, type(None)), "ranks": dict,
}


def process_gone(rep: dict[str, Any]) -> bool:
    """Whether the process that wrote ``rep`` is gone: the report is of this host and its pid runs
    no process here, a zombie, or a process started after the report's (the pid was reused).
    Whenever the report was written: a dead process's file (a crash, an earlier boot under one
    hand-set server id, a file planted there) says nothing about the server now. A report gathered
    from a rank (``_via``), one from another host, or one whose process cannot be checked is kept."""
    if rep.get("_via") or rep.get("host") != socket.gethostname():
        return False
    try:
        import psutil

        proc = psutil.Process(int(rep["pid"]))
        if proc.status() == psutil.STATUS_ZOMBIE:
            return True
        created = proc.create_time()
    except (KeyError, TypeError, ValueError):
        return False
    except Exception as exc:  # noqa: BLE001 - psutil.NoSuchProcess, or psutil itself missing
        return type(exc).__name__ == "NoSuchProcess"
    started = rep.get("started")
    # the report's process recorded its start after it was created; a process created later is another
    return isinstance(started, (int, float)) and created > float(started) + 1.0


def servers(reports: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The reports by server tree (``server_tree``: the process tree of one server; the reports of
    older releases carry none and are left out). More than one tree under one server id: two live
    servers share a hand-set VLLM_OVERLAY_SERVER_ID."""
    out: dict[str, list[dict[str, Any]]] = {}
    for rep in reports:
        tree = rep.get("server_tree")
        if isinstance(tree, str) and tree:
            out.setdefault(tree, []).append(rep)
    return out


def scan_server(directory: str, sid: str, own_tree: str | None = None) -> dict[str, list[dict[str, Any]]]:
    """The live servers (``servers``) whose reports in ``directory`` carry ``sid``: only that id's files
    are read; this process's own tree (``own_tree``), where given, is one of them."""
    out: dict[str, list[dict[str, Any]]] = {}
    for path, _ in report_files.entries(directory, server_id.file_key(sid)):
        rep, _why = load_file(path)
        if rep is not None and rep.get("server_id") == sid and not process_gone(rep):
            for tree, reps in servers([rep]).items():
                out.setdefault(tree, []).extend(reps)
    if own_tree:
        out.setdefault(own_tree, [{"role": "this process", "pid": os.getpid()}])
    return out


def shared_line(sid: str | None, trees: dict[str, list[dict[str, Any]]]) -> str | None:
    """One line naming the live servers that share ``sid``, or None when there are not several."""
    if len(trees) < 2:
        return None
    def procs(reps: list[dict[str, Any]]) -> str:
        named = sorted(f"{r.get('role')} pid {r.get('pid')}" for r in reps)
        return ", ".join(named[:4]) + (f" and {len(named) - 4} more" if len(named) > 4 else "")

    shown = "; ".join(f"{tree.rsplit(':', 1)[0]} ({procs(reps)})" for tree, reps in sorted(trees.items()))
    return (f"VLLM_OVERLAY_SERVER_ID={sid} is used by {len(trees)} live servers (their main process host:pid "
            f"and processes: {shown}): their reports, /metrics series and stress verdicts mix; give each "
            "server its own VLLM_OVERLAY_SERVER_ID (or leave it unset: each server then makes its own)")


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
