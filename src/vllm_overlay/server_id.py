"""The server id: which processes' reports belong to one server (one `vllm serve`, one LLM()).

The first overlay process of a server sets VLLM_OVERLAY_SERVER_ID in its environment; the engine
core, the workers and the extra API servers vLLM starts (with multiprocessing) inherit it and write
it into their reports. The /metrics collector of the API server reads only the reports that carry
its own id, so several servers (and old runs) may share one report directory.

An id the overlay made itself (``HOST:PID:TIME:RANDOM``) belongs to the process tree of that PID.
A program's main process (one not started by multiprocessing: ``vllm serve`` started by a launcher
that had loaded vLLM's plugins itself) that inherits such an id from another process makes its own,
so two servers started by one launcher never share an id. An id set by hand is always kept.
A Ray worker process (vLLM's Ray executors start the workers as Ray actors and pass them the
driver's environment) is not a program's main process: it keeps the id it is given.

The server tree (VLLM_OVERLAY_SERVER_TREE, ``HOST:PID:RANDOM``) names one server's process tree
whatever its id: a program's main process always makes its own, the processes it starts inherit
it. Live reports of one server id with two trees are two servers sharing a hand-set id
(``reports.servers``), said on /metrics and refused by `vllm-overlay stress`.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import re
import socket
import sys
import time

from vllm_overlay import settings

NAME = "VLLM_OVERLAY_SERVER_ID"
TREE = "VLLM_OVERLAY_SERVER_TREE"
_AUTO = re.compile(r"^[A-Za-z0-9.-]+:(\d+):\d+(:[0-9a-f]{8})?$")


def current() -> str | None:
    return settings.value(NAME)


def make() -> str:
    host = "".join(c if c.isalnum() or c in ".-" else "-" for c in socket.gethostname())[:64] or "host"
    return f"{host}:{os.getpid()}:{int(time.time())}:{os.urandom(4).hex()}"


def inherited_from_another_program(sid: str) -> bool:
    """Whether ``sid`` is an id the overlay made in another program, inherited by this program's
    own main process (a launcher's id, not this server's)."""
    m = _AUTO.match(sid)
    if m is None or int(m.group(1)) == os.getpid():
        return False
    return multiprocessing.parent_process() is None and not in_ray_worker()


def in_ray_worker() -> bool:
    """Whether this process is a Ray worker (an actor or task process, not a Ray driver): Ray is
    imported already there, before any of vLLM's code runs."""
    ray = sys.modules.get("ray")
    if ray is None:
        return False
    try:
        return bool(ray._private.worker.global_worker.mode == ray.WORKER_MODE)
    except Exception:  # noqa: BLE001 - another Ray layout: treated as not a Ray worker
        return False


def ensure() -> str:
    """This process's server id; sets a new one when none is inherited from this server."""
    have = current()
    if have and not inherited_from_another_program(have):
        return have
    new = make()
    os.environ[NAME] = new
    return new


def ensure_tree() -> str:
    """This process's server tree: inherited from the process that started it, made anew in a
    program's main process (unless it made the one it has)."""
    have = settings.value(TREE)
    if have:
        m = _AUTO.match(have)
        main = multiprocessing.parent_process() is None and not in_ray_worker()
        if not main or (m is not None and int(m.group(1)) == os.getpid()):
            return str(have)
    new = make()
    os.environ[TREE] = new
    return new


def is_auto(sid: str | None) -> bool:
    """Whether ``sid`` is an id the overlay made (not one set by hand)."""
    return bool(sid) and _AUTO.match(str(sid)) is not None


def file_key(sid: str | None) -> str:
    """The part of a report's file name that names its server: 12 hex digits of the id's hash
    (``none`` without an id), so a reader globs its own server's files and parses no other."""
    if not sid:
        return "none"
    return hashlib.sha256(sid.encode()).hexdigest()[:12]
