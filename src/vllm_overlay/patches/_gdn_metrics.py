"""gdn-output-prealloc's series on /metrics: ``vllm_overlay_gdn_buffer_rows`` and
``vllm_overlay_gdn_buffer_bytes``, one per buffer and process, built from the ``buffers`` each
process's report lists, and the buffers' rows as edges of the forward-size histogram (a forward
larger than a buffer trips its guard: the edge tells those forwards apart). The patch declares the
hooks ``metric_families`` and ``bucket_edges``; the API server's collector (metrics.py) calls them at
every scrape with the server's reports."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

PREFIX = "vllm_overlay_"
LABELS = ["role", "pid", "engine", "device", "dtype", "shape", "source"]


def buffer_labels(buf: dict[str, Any]) -> list[str]:
    """(engine, device, dtype, shape, source) of a GDN buffer's report entry. Its key is
    (engine, device, dtype, heads, head_dim); the engine is the config id (``config-<hex>``)."""
    key = [str(k) for k in (buf.get("key") or [])]
    if len(key) == 4:  # reports written before the key named its engine
        key = [str(buf.get("engine", "")), *key]
    key = (key + ["", "", "", "", ""])[:5]
    return [key[0], key[1], key[2], f"{key[3]}x{key[4]}", str(buf.get("source", ""))]


def bucket_edges(reports: list[dict[str, Any]]) -> set[int]:
    """The rows of every buffer the reports list (a buffer without rows gives none)."""
    return {int(b["rows"]) for rep in reports for b in rep.get("buffers", []) if b.get("rows")}


def families(reports: list[dict[str, Any]]) -> Iterator[Any]:
    from prometheus_client.core import GaugeMetricFamily

    rows = GaugeMetricFamily(PREFIX + "gdn_buffer_rows", "Token rows of a preallocated GDN output buffer.",
                             labels=LABELS)
    size = GaugeMetricFamily(PREFIX + "gdn_buffer_bytes", "Bytes of a preallocated GDN output buffer.",
                             labels=LABELS)
    for rep in reports:
        role, pid = str(rep.get("role", "")), str(rep.get("pid", ""))
        for b in rep.get("buffers", []):
            labels = [role, pid, *buffer_labels(b)]
            rows.add_metric(labels, int(b.get("rows", 0)))
            size.add_metric(labels, int(b.get("bytes", 0)))
    yield rows
    yield size
