"""Server mode's first contact: is there a vLLM server at --url, and which server is it?

Before any traffic the harness asks ``/v1/models`` (a vLLM OpenAI-compatible server serves at
least one model) and ``/metrics`` (Prometheus text; with the overlay's series it names the
server id, which ties report files to this server). Anything else is a ``ServerError``: exit 4,
one line saying what answered and how; an answer 401 or 403 (a server started with --api-key) is
bad usage without the key. Everything before traffic shares one deadline, ``PREFLIGHT_S``, for
the whole of each answer (stress/http.py), so a server that trickles its answers cannot hold the
harness.
"""

from __future__ import annotations

import json
import time
import urllib.error
from dataclasses import dataclass

from vllm_overlay.errors import OverlayError
from vllm_overlay.tools.stress import http, metrics_text
from vllm_overlay.tools.stress.plan import UsageError

PREFLIGHT_S = 60.0  # every request before traffic, answers included, ends within this


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


def _get(base: str, path: str, api_key: str | None, end: float) -> bytes:
    try:
        return http.get(f"{base}{path}", api_key, max(0.0, end - time.monotonic()))
    except urllib.error.HTTPError:
        raise
    except http.Deadline:
        raise ServerError(f"{base} did not answer GET {path} completely within the {PREFLIGHT_S:g} s the harness "
                          "gives every request before traffic (it accepts connections; is it stalled?)") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ServerError(f"nothing answers at {base} (GET {path}: {reason})") from None


def probe(base: str, api_key: str | None = None, end: float | None = None) -> Target:
    """Ask /v1/models and /metrics; ``end`` (time.monotonic()) bounds both, answers included."""
    end = time.monotonic() + PREFLIGHT_S if end is None else end
    try:
        body = _get(base, "/v1/models", api_key, end)
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            raise UsageError(
                f"{base} answered GET /v1/models with HTTP {exc.code}: it wants an API key "
                + ("and refused the one given (--api-key or VLLM_API_KEY)" if api_key
                   else "(started with --api-key); pass --api-key KEY or set VLLM_API_KEY")) from None
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
        text = _get(base, "/metrics", api_key, end).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return Target(base, models[0], None, f"GET /metrics answered HTTP {exc.code}")
    try:
        scrape = metrics_text.parse(text)
    except Exception as exc:  # noqa: BLE001 - the parser raises ValueError and others on junk
        raise ServerError(f"{base} is not a vLLM server: GET /metrics is not Prometheus text "
                          f"({type(exc).__name__}: {str(exc)[:120]})") from None
    return Target(base, models[0], scrape)
