"""The server id: which processes' reports belong to one server (one `vllm serve`, one LLM()).

The first overlay process of a process tree sets VLLM_OVERLAY_SERVER_ID in its environment;
the engine core and the workers it starts inherit it and write it into their reports. The
/metrics collector of the API server reads only the reports that carry its own id, so several
servers (and old runs) may share one report directory.
"""

from __future__ import annotations

import os
import socket
import time

from vllm_overlay import settings

NAME = "VLLM_OVERLAY_SERVER_ID"


def current() -> str | None:
    return settings.value(NAME)


def ensure() -> str:
    """This process's server id; sets a new one (host, pid, start time) when none is inherited."""
    have = current()
    if have:
        return have
    host = "".join(c if c.isalnum() or c in ".-" else "-" for c in socket.gethostname())[:64] or "host"
    new = f"{host}:{os.getpid()}:{int(time.time())}"
    os.environ[NAME] = new
    return new
