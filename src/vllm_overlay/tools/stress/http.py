"""HTTP GETs of the harness's server mode, each bounded as a whole: a deadline for the request and
its whole answer (not per read: a server that trickles a byte every few seconds is cut off), a cap
on the answer's size, and the API key the server wants (``--api-key`` or vLLM's own VLLM_API_KEY),
sent as ``Authorization: Bearer``."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

MAX_BYTES = 64 * 2**20  # a /metrics text is well under a megabyte


class Deadline(TimeoutError):
    """No complete answer within the deadline."""


def headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def get(url: str, api_key: str | None, timeout: float, limit: int = MAX_BYTES) -> bytes:
    """The body of GET ``url``, complete within ``timeout`` seconds or ``Deadline``; an HTTP error
    status raises urllib.error.HTTPError, a connection failure OSError."""
    result: dict[str, object] = {}
    end = time.monotonic() + timeout

    def fetch() -> None:
        try:
            req = urllib.request.Request(url, headers=headers(api_key))
            with urllib.request.urlopen(req, timeout=max(0.1, end - time.monotonic())) as resp:
                chunks, size = [], 0
                while time.monotonic() < end:
                    chunk = resp.read1(1 << 16)
                    if not chunk:
                        result["body"] = b"".join(chunks)
                        return
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > limit:
                        raise ValueError(f"GET {url}: the answer is larger than {limit} bytes")
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            result["error"] = exc

    # a daemon thread: a server that never finishes its answer cannot keep the harness alive
    worker = threading.Thread(target=fetch, name="vllm-overlay-http", daemon=True)
    worker.start()
    worker.join(max(0.0, end - time.monotonic()) + 0.5)
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    if "body" not in result:
        raise Deadline(f"GET {url}: no complete answer within {timeout:g} s")
    return result["body"]  # type: ignore[return-value]
