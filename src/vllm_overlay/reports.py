"""Reading the per-process JSON reports of a run (used by the CLI and the stress harness)."""

from __future__ import annotations

import glob
import json
import os
from typing import Any

from vllm_overlay.errors import OverlayError


def load(directory: str, since: float | None = None) -> list[dict[str, Any]]:
    """Every ``overlay-*.json`` in ``directory`` (written at or after ``since``, if given)."""
    if not os.path.isdir(directory):
        raise OverlayError(f"report DIR {directory!r}: not a directory")
    out = []
    for path in sorted(glob.glob(os.path.join(directory, "overlay-*.json"))):
        try:
            with open(path) as f:
                rep = json.load(f)
        except (OSError, ValueError):
            continue  # being replaced right now (atomic rename); the next read sees it
        if since is not None and rep.get("written", 0) < since:
            continue
        rep["_path"] = path
        out.append(rep)
    return out
