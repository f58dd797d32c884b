"""Reading the per-process JSON reports of a run (used by the CLI and the stress harness)."""

from __future__ import annotations

import glob
import json
import os
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
    return out


def load(directory: str, since: float | None = None) -> list[dict[str, Any]]:
    """Every well-formed ``overlay-*.json`` in ``directory`` (written at or after ``since``)."""
    return scan(directory, since).reports


_SHAPES: dict[str, type | tuple[type, ...]] = {
    "counters": dict, "buffers": list, "patches": dict, "engine_config": dict, "telemetry": dict,
    "counts": dict, "events": list, "runner": dict, "budgets": list, "written": (int, float),
    "server_id": (str, type(None)), "role": str, "tp_rank": (int, type(None)),
}


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
