"""Server mode's first contact: is there a vLLM server at --url, and which server is it?

Before any traffic the harness asks ``/v1/models`` (a vLLM OpenAI-compatible server serves at
least one model) and ``/metrics`` (Prometheus text; with the overlay's series it names the
server id, which ties report files to this server). Anything else is a ``ServerError``: exit 4,
one line saying what answered and how.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass

from vllm_overlay.errors import OverlayError
from vllm_overlay.stress import metrics_text

PROBE_TIMEOUT_S = 10.0


class ServerError(OverlayError):
    """The server at --url is unreachable, is not a vLLM server, or stopped answering (exit code 4)."""


@dataclass
class Target:
    base: str
    model: str
    scrape: metrics_text.Scrape | None  # /metrics, parsed (None: /metrics answered with an HTTP error)
    metrics_error: str | None = None

    @property
    def server_id(self) -> str | None:
        """The server id /metrics names (the overlay's engine_config_info series), if any."""
        if self.scrape is None or not self.scrape.found:
            return None
        sid = self.scrape.engine_config.get("server_id")
        return str(sid) if sid not in (None, "") else None


def _get(base: str, path: str, timeout: float) -> bytes:
    try:
        with urllib.request.urlopen(f"{base}{path}", timeout=timeout) as resp:
            return resp.read()
    except urllib.error.HTTPError:
        raise
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ServerError(f"nothing answers at {base} (GET {path}: {reason})") from None


def probe(base: str, timeout: float = PROBE_TIMEOUT_S) -> Target:
    try:
        body = _get(base, "/v1/models", timeout)
    except urllib.error.HTTPError as exc:
        raise ServerError(f"{base} is not a vLLM server: GET /v1/models answered HTTP {exc.code}") from None
    try:
        data = json.loads(body)
        models = [m["id"] for m in data["data"]]
    except (ValueError, KeyError, TypeError):
        raise ServerError(f"{base} is not a vLLM server: GET /v1/models did not answer an OpenAI model "
                          f"list ({body[:80]!r})") from None
    if not models or not isinstance(models[0], str):
        raise ServerError(f"{base} serves no model: GET /v1/models answered an empty list")
    try:
        text = _get(base, "/metrics", timeout).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return Target(base, models[0], None, f"GET /metrics answered HTTP {exc.code}")
    try:
        scrape = metrics_text.parse(text)
    except Exception as exc:  # noqa: BLE001 - the parser raises ValueError and others on junk
        raise ServerError(f"{base} is not a vLLM server: GET /metrics is not Prometheus text "
                          f"({type(exc).__name__}: {str(exc)[:120]})") from None
    return Target(base, models[0], scrape)
