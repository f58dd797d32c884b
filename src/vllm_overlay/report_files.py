"""Report file names, and the pruning rule of a report directory.

Each process writes ``overlay-KEY-PID-INSTANCE.json``: KEY names its server (12 hex digits of the
server id's hash, ``server_id.file_key``), PID is the process id in its own PID namespace and
INSTANCE 8 random hex digits drawn when the process starts (again in a forked child). Two processes
never share a file, even with the same pid in two containers that share the directory, and a
reader of one server globs that server's files only: the /metrics collector never opens another
server's reports, however many the directory holds.

Pruning: when a process registers, report files (``overlay-*.json``) not written for
``PRUNE_AFTER_S`` (24 h) and temporary files (``.overlay-*.tmp``) older than ``TMP_PRUNE_AFTER_S``
are removed from its directory. A live process rewrites its report at least every
``REFRESH_S`` (1 h), so only the files of processes that are gone get old enough. Where more than
``MAX_FILES`` report files remain, the oldest of those not written for ``2 * REFRESH_S`` go too, so
the directory holds at most about ``MAX_FILES`` files plus those of live processes, however often
servers restart.
"""

from __future__ import annotations

import glob
import os
import time

PREFIX = "overlay-"
PRUNE_AFTER_S = 24 * 3600.0
TMP_PRUNE_AFTER_S = 600.0
REFRESH_S = 3600.0
MAX_FILES = 512


def name(key: str, pid: int, instance: str) -> str:
    return f"{PREFIX}{key}-{pid}-{instance}.json"


def server_glob(directory: str, key: str) -> str:
    return os.path.join(glob.escape(directory), f"{PREFIX}{key}-*.json")


def all_glob(directory: str) -> str:
    return os.path.join(glob.escape(directory), f"{PREFIX}*.json")


def prune(directory: str, now: float | None = None) -> list[str]:
    """Remove the stale files of ``directory`` (see the module docstring); returns their paths."""
    now = time.time() if now is None else now
    removed: list[str] = []
    kept: list[tuple[float, str]] = []  # report files left by age: (mtime, path)
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        if entry.name.startswith(PREFIX) and entry.name.endswith(".json"):
            limit = PRUNE_AFTER_S
        elif entry.name.startswith("." + PREFIX) and entry.name.endswith(".tmp"):
            limit = TMP_PRUNE_AFTER_S
        else:
            continue
        try:
            mtime = entry.stat(follow_symlinks=False).st_mtime
            if now - mtime > limit:
                os.unlink(entry.path)
                removed.append(entry.path)
            elif limit == PRUNE_AFTER_S:
                kept.append((mtime, entry.path))
        except OSError:
            continue  # gone already, or not ours to remove
    idle = sorted((m, p) for m, p in kept if now - m > 2 * REFRESH_S)  # no live process writes these
    for _, path in idle[:max(0, len(kept) - MAX_FILES)]:
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            continue
    return removed
