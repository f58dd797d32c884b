"""The reading side of the overlay's /metrics series (``vllm_overlay.metrics`` serves them): the
Prometheus text of a server's /metrics -> what `vllm-overlay stress --url` needs (the forward-size
histogram's buckets, the processes, patches and counters, the live limits)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_overlay.metrics import HIST, PREFIX


@dataclass
class Scrape:
    buckets: dict[int, int] = field(default_factory=dict)  # cumulative count per finite `le`
    count: int = 0
    max_forward: int = 0
    processes: dict[str, dict[str, Any]] = field(default_factory=dict)  # pid -> report-shaped dict
    engine_config: dict[str, Any] = field(default_factory=dict)
    buffer_rows: list[int] = field(default_factory=list)
    found: bool = False  # any vllm_overlay_ series at all
    servers: int = 1  # live servers reporting this server id (vllm_overlay_server_id_servers)

    def band(self, lo: int, hi: int) -> int:
        """Forwards in (lo, hi] since the server started; both must be bucket edges (or lo 0)."""
        return self.buckets[hi] - (self.buckets[lo] if lo else 0)

    def sizes_since(self, before: Scrape) -> dict[int, int]:
        """Forwards per bucket since ``before``, keyed by each bucket's upper edge (not exact sizes)."""
        now, then = _per_bucket(self.buckets), _per_bucket(before.buckets)
        return {e: now[e] - then.get(e, 0) for e in sorted(now) if now[e] - then.get(e, 0) > 0}


def _per_bucket(cumulative: dict[int, int]) -> dict[int, int]:
    out, prev = {}, 0
    for edge in sorted(cumulative):
        out[edge] = cumulative[edge] - prev
        prev = cumulative[edge]
    return out


def parse(text: str) -> Scrape:
    from prometheus_client.parser import text_string_to_metric_families

    out = Scrape()
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith(PREFIX):
            continue
        out.found = True
        for s in fam.samples:
            labels = s.labels
            if s.name == HIST + "_bucket" and labels.get("le") != "+Inf":
                out.buckets[int(float(labels["le"]))] = int(s.value)
            elif s.name == HIST + "_count":
                out.count = int(s.value)
            elif s.name == PREFIX + "forward_max_scheduled_tokens":
                out.max_forward = int(s.value)
            elif s.name in (PREFIX + "guard_trips_total", PREFIX + "guard_checks_total"):
                proc = _proc(out, labels)
                proc["counters"][s.name[len(PREFIX):-len("_total")]] = int(s.value)
            elif s.name == PREFIX + "patch_info":
                _proc(out, labels)["patches"][labels["patch"]] = {"status": labels["status"]}
            elif s.name == PREFIX + "gdn_buffer_rows":
                out.buffer_rows.append(int(s.value))
            elif s.name == PREFIX + "server_id_servers":
                out.servers = int(s.value)
            elif s.name == PREFIX + "engine_config_info":
                out.engine_config = {k: (int(v) if v.isdigit() else v) for k, v in labels.items()}
    return out


def _proc(out: Scrape, labels: dict[str, str]) -> dict[str, Any]:
    return out.processes.setdefault(labels["pid"], {
        "pid": int(labels["pid"]) if labels["pid"].isdigit() else labels["pid"], "role": labels["role"],
        "patches": {}, "counters": {}, "_path": "/metrics"})


def scrape(base: str, timeout: float = 30, api_key: str | None = None) -> Scrape:
    """GET /metrics, parsed; the whole answer within ``timeout`` s (stress/http.py)."""
    from vllm_overlay.tools.stress import http

    return parse(http.get(f"{base}/metrics", api_key, timeout).decode())
