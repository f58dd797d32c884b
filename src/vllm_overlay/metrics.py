"""The overlay's Prometheus series, served on vLLM's own /metrics.

A collector in the API server process reads, at scrape time, the JSON reports of this server's
processes (same VLLM_OVERLAY_REPORT_DIR, same VLLM_OVERLAY_SERVER_ID) and turns them into metric
families. The engine core and the workers flush their reports every second while something
changed, so the series trail the processes by about a second; there is no second HTTP server,
and nothing depends on prometheus_client's multiprocess files: every API server process of a
multi-process server (api-server-count > 1, PROMETHEUS_MULTIPROC_DIR set) computes the same
values from the same files. In that mode /metrics is answered from a registry built for each
request around prometheus_client's MultiProcessCollector (prometheus-fastapi-instrumentator's
handler), so the collector is added wherever a MultiProcessCollector is created, and to the
default registry that a single API server serves (patch prometheus-metrics).

Series (all prefixed ``vllm_overlay_``):

- ``forward_scheduled_tokens`` histogram: scheduled tokens per real model forward, summed over
  the server's engines, tensor-parallel rank 0 only (the other ranks run the same forwards).
  Buckets: every power of two from 1 to 2**20, plus this server's own band edges
  (max_num_batched_tokens and half of it, the profile cap, the explicit token budgets, the GDN
  buffer rows, the inner quarter edges of each default band), so that the forwards in the stress
  harness's default band, and in each of its quarters, are an exact difference of two buckets. Exact per-size counts stay in the JSON reports: one series per
  size would be thousands of series.
- ``forward_max_scheduled_tokens`` gauge: the largest real forward since the server started.
- ``guard_checks_total`` / ``guard_trips_total`` counters, per process (``role``, ``pid``).
- ``gdn_buffer_rows`` / ``gdn_buffer_bytes`` gauges, per buffer and process.
- ``patch_info`` (``patch``, ``status``, ``role``, ``pid``): one series per patch and process.
- ``engine_config_info``: the live limits the workers saw, and the server id.
- ``processes``: how many overlay processes of this server reported, by role.
- ``rank_missing_info`` (``engine_pid``, ``rank``, ``why``): a worker rank its engine core expected
  and got no report from (patch rank-reports).

Worker reports also arrive inside the engine core's report (``ranks``: gathered through vLLM's
executor, patch rank-reports), for workers whose report directory is on another host; a process
readable both ways is counted once (``reports.dedupe``).
"""

from __future__ import annotations

import glob
import json
import os
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

from vllm_overlay import report_files, server_id, settings
from vllm_overlay.report import LOG, STATE
from vllm_overlay.reports import dedupe, expand, gone_before, missing_ranks, problem
from vllm_overlay.telemetry import merge_sizes

PREFIX = "vllm_overlay_"
POW2_EDGES: tuple[int, ...] = tuple(2**i for i in range(21))  # 1 .. 1048576 (TOKEN_MAX)
HIST = PREFIX + "forward_scheduled_tokens"


# ---- the serving side: reports -> metric families -------------------------------------------


def process_started() -> float | None:
    """This process's start time (psutil, a vLLM dependency), or None where it cannot be read."""
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # noqa: BLE001 - without it earlier servers' files are kept until pruned
        return None


class ReportCache:
    """Parsed reports of one directory, re-read only when a file changed. ``started``: reports of this
    host written before it by processes that are gone are an earlier server's (reports.gone_before)."""

    def __init__(self, started: float | None = None) -> None:
        self.started = started
        self._lock = threading.Lock()
        self._files: dict[str, tuple[int, int, dict[str, Any] | None]] = {}
        self.skipped: dict[str, str] = {}  # path -> why it is not a report (named on /metrics)

    def reports(self, directory: str, server: str | None) -> list[dict[str, Any]]:
        """This server's reports: only its own files are listed (their names carry the server
        id's key), so memory and time follow this server's processes, not the directory."""
        out = []
        with self._lock:
            seen = set()
            for path in glob.glob(report_files.server_glob(directory, server_id.file_key(server))):
                seen.add(path)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                cached = self._files.get(path)
                if cached is None or cached[:2] != (st.st_mtime_ns, st.st_size):
                    rep, why = None, None
                    try:
                        with open(path) as f:
                            rep = json.load(f)
                    except OSError:
                        pass  # removed since the listing
                    except ValueError as exc:  # the writers rename whole files: never half-written
                        why = f"not JSON: {exc}"
                    if rep is not None and (why := problem(rep)) is not None:
                        rep = None
                    self._note(path, why)
                    if rep is not None:
                        rep["_path"] = path
                    self._files[path] = (st.st_mtime_ns, st.st_size, rep)
                    cached = self._files[path]
                rep = cached[2]
                if rep is not None and rep.get("server_id") == server and not gone_before(rep, self.started):
                    out.append(rep)
            for gone in set(self._files) - seen:
                del self._files[gone]
                self.skipped.pop(gone, None)
        return sorted(out, key=lambda r: int(r.get("pid", 0)))

    def _note(self, path: str, why: str | None) -> None:
        """Keep why ``path`` is skipped; one WARNING each time that changes."""
        if why is None:
            if self.skipped.pop(path, None) is not None:
                LOG.info("/metrics: report %s is readable again", path)
            return
        if self.skipped.get(path) != why:
            LOG.warning("/metrics: skipped %s: not a report (%s); the other reports' series stay "
                        "(series %sreport_skipped_info)", path, why, PREFIX)
        self.skipped[path] = why


def bucket_edges(reports: list[dict[str, Any]]) -> list[int]:
    """Powers of two plus this server's own band edges (see the module docstring)."""
    edges = set(POW2_EDGES)
    tops: set[int] = set()
    for rep in reports:
        mnbt = (rep.get("engine_config") or {}).get("max_num_batched_tokens")
        if isinstance(mnbt, int) and mnbt > 0:
            edges.update((mnbt, mnbt // 2))
            tops.add(mnbt)
        edges.update(int(b["rows"]) for b in rep.get("buffers", []) if b.get("rows"))
    lows = {t // 2 for t in tops}
    for name in ("VLLM_OVERLAY_PROFILE_RUN_CAP", "VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET",
                 "VLLM_OVERLAY_GDN_MAX_BATCHED_TOKENS"):
        try:
            value = settings.value(name)
        except Exception:  # noqa: BLE001 - a bad value stopped start-up already; not our job here
            continue
        if value:
            edges.add(int(value))
            lows.add(int(value))
    # the quarter edges of the stress's default bands, (low, mnbt], so /metrics counts each quarter
    for top in tops:
        for low in lows:
            if 0 <= low < top:
                edges.update(low + (top - low) * i // 4 for i in (1, 2, 3))
    return sorted(e for e in edges if e > 0)


def buffer_labels(buf: dict[str, Any]) -> list[str]:
    """(engine, device, dtype, shape, source) of a GDN buffer's report entry. Its key is
    (engine, device, dtype, heads, head_dim); the engine is the config id (``config-<hex>``)."""
    key = [str(k) for k in (buf.get("key") or [])]
    if len(key) == 4:  # reports written before the key named its engine
        key = [str(buf.get("engine", "")), *key]
    key = (key + ["", "", "", "", ""])[:5]
    return [key[0], key[1], key[2], f"{key[3]}x{key[4]}", str(buf.get("source", ""))]


def families(reports: list[dict[str, Any]], server: str | None,
             skipped: dict[str, str] | None = None,
             missing: list[dict[str, Any]] | None = None) -> Iterator[Any]:
    from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                        InfoMetricFamily)

    from prometheus_client.utils import floatToGoString

    sizes = merge_sizes(reports)
    total = sum(sizes.values())
    cumulative, acc, ordered = [], 0, sorted(sizes.items())
    i = 0
    for edge in bucket_edges(reports):
        while i < len(ordered) and ordered[i][0] <= edge:
            acc += ordered[i][1]
            i += 1
        cumulative.append((floatToGoString(edge), acc))  # "8192.0", as Prometheus 3 stores `le`
    cumulative.append(("+Inf", total))
    hist = HistogramMetricFamily(
        HIST, "Scheduled tokens per real model forward (summed over engines, tensor-parallel rank 0 only).",
        buckets=cumulative, sum_value=sum(s * c for s, c in sizes.items()))
    yield hist
    yield GaugeMetricFamily(PREFIX + "forward_max_scheduled_tokens",
                            "The largest real model forward since the server started, in scheduled tokens.",
                            value=max(sizes) if sizes else 0)

    checks = CounterMetricFamily(PREFIX + "guard_checks", "Capacity guard checks before a model forward.",
                                 labels=["role", "pid"])
    trips = CounterMetricFamily(PREFIX + "guard_trips",
                                "Capacity guard trips: a forward larger than the GDN buffer, refused.",
                                labels=["role", "pid"])
    rows = GaugeMetricFamily(PREFIX + "gdn_buffer_rows", "Token rows of a preallocated GDN output buffer.",
                             labels=["role", "pid", "engine", "device", "dtype", "shape", "source"])
    size = GaugeMetricFamily(PREFIX + "gdn_buffer_bytes", "Bytes of a preallocated GDN output buffer.",
                             labels=["role", "pid", "engine", "device", "dtype", "shape", "source"])
    info = InfoMetricFamily(PREFIX + "patch", "One series per patch and process: its status there.",
                            labels=["patch", "status", "role", "pid"])
    age = GaugeMetricFamily(PREFIX + "report_age_seconds",
                            "Seconds since a process of this server last wrote its report (a live process "
                            "rewrites it when it changes and at least hourly: older means stale).",
                            labels=["role", "pid"])
    now = time.time()
    processes: dict[str, int] = {}
    config: dict[str, str] = {}
    for rep in reports:
        role, pid = str(rep.get("role", "")), str(rep.get("pid", ""))
        processes[role] = processes.get(role, 0) + 1
        if isinstance(rep.get("written"), (int, float)):
            age.add_metric([role, pid], max(0.0, round(now - float(rep["written"]), 1)))
        counters = rep.get("counters") or {}
        checks.add_metric([role, pid], int(counters.get("guard_checks", 0)))
        trips.add_metric([role, pid], int(counters.get("guard_trips", 0)))
        for b in rep.get("buffers", []):
            labels = [role, pid, *buffer_labels(b)]
            rows.add_metric(labels, int(b.get("rows", 0)))
            size.add_metric(labels, int(b.get("bytes", 0)))
        for patch_id, rec in sorted((rep.get("patches") or {}).items()):
            info.add_metric([patch_id, str(rec.get("status", "")), role, pid], {})
        for k, v in (rep.get("engine_config") or {}).items():
            if k != "unknown":
                config[k] = str(v)
        if rep.get("vllm_version"):
            config.setdefault("vllm_version", str(rep["vllm_version"]))
    yield from (checks, trips, rows, size, info, age)
    cfg = InfoMetricFamily(PREFIX + "engine_config",
                           "The live engine limits the workers saw, and the server id.",
                           labels=["server_id"])
    cfg.add_metric([server or ""], config)
    yield cfg
    procs = GaugeMetricFamily(PREFIX + "processes", "Overlay processes of this server that wrote a report.",
                              labels=["role"])
    for role, n in sorted(processes.items()):
        procs.add_metric([role], n)
    yield procs
    bad = InfoMetricFamily(PREFIX + "report_skipped",
                           "A file of this server's reports that is not a report, skipped: its name and why.",
                           labels=["file", "why"])
    for path, why in sorted((skipped or {}).items()):
        bad.add_metric([os.path.basename(path), why[:200]], {})
    yield bad
    gone = InfoMetricFamily(PREFIX + "rank_missing",
                            "A worker rank its engine core expected and got no overlay report from: dead, "
                            "unreachable, or without the overlay (why).", labels=["engine_pid", "rank", "why"])
    for m in missing or []:
        gone.add_metric([str(m.get("engine_pid", "")), str(m.get("rank", "")), str(m.get("why", ""))[:200]], {})
    yield gone
    yield from write_families()


def write_families() -> Iterator[Any]:
    """This process's own report writing: failing (1) or not (0), and its consecutive failures."""
    from prometheus_client.core import GaugeMetricFamily

    failing = GaugeMetricFamily(PREFIX + "report_write_failing",
                                "1 while this process cannot write its report (the reports are stale).",
                                labels=["role", "pid", "path"])
    if STATE.registered:
        err = STATE.write_error
        failing.add_metric([STATE.role(), str(STATE.pid), err[0] if err else STATE.report_path()], 1 if err else 0)
    yield failing


class OverlayCollector:
    """A prometheus_client collector: this server's reports, read at every scrape."""

    def __init__(self, directory: str | None = None, server: str | None = None) -> None:
        self.directory = directory
        self.server = server
        # the serving side (no directory given): an earlier server's files under the same server id are
        # not counted (written before this process started, by processes that are gone)
        self.cache = ReportCache(started=None if directory else process_started())
        self._warned: str | None = None  # the last error logged: a new one is logged again

    def describe(self) -> list[Any]:
        return []  # no name checks at registration: our names never clash with vLLM's "vllm:" ones

    def collect(self) -> Iterator[Any]:
        server = self.server or settings.value("VLLM_OVERLAY_SERVER_ID")
        try:
            directory = self.directory or settings.value("VLLM_OVERLAY_REPORT_DIR")
            reports = self.cache.reports(directory, server) if os.path.isdir(directory) else []
            if self.directory is None and STATE.registered:  # this process: fresher than its file
                own = STATE.to_json()
                reports = [r for r in reports if r.get("instance") != own["instance"]] + [own]
            reports = dedupe([r for rep in reports for r in expand(rep)])
            out = list(families(reports, server, self.cache.skipped, missing_ranks(reports)))
        except Exception as exc:  # noqa: BLE001 - never break vLLM's own /metrics
            text = f"{type(exc).__name__}: {exc}"
            if self._warned != text:
                LOG.warning("the /metrics collector could not read the reports: %s", text)
                self._warned = text
            return
        yield from out


_collector: OverlayCollector | None = None
_attached: weakref.WeakSet[Any] = weakref.WeakSet()  # registries we added it to (some per request)
_attach_lock = threading.Lock()


def attach(registry: Any) -> bool:
    """Register the one collector of this process on ``registry`` once; True when this call did."""
    global _collector
    with _attach_lock:
        if registry in _attached:
            return False
        if _collector is None:
            _collector = OverlayCollector()
        registry.register(_collector)
        _attached.add(registry)
        return True


def detach_all() -> None:
    with _attach_lock:
        for registry in list(_attached):
            try:
                registry.unregister(_collector)
            except KeyError:
                pass
        _attached.clear()
