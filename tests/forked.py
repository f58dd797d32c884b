"""Running a function in a forked child of the test process (the report's fork handling)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any


def in_child(fn: Callable[[], Any]) -> Any:
    """Run ``fn()`` in a forked child; its JSON result comes back through a pipe ({"error": ...} where it
    raised)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        try:
            os.close(r)
            data = json.dumps(fn()).encode()
        except BaseException as exc:  # noqa: BLE001
            data = json.dumps({"error": repr(exc)}).encode()
        os.write(w, data)
        os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks))
