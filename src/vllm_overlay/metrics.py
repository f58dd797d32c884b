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
  Buckets: every power of two from 1 to 2**20, plus this server's own band edges as its processes'
  reports record them (max_num_batched_tokens and half of it, the profile cap, the token budgets a
  setting requested, the GDN buffer rows, the inner quarter edges of each default band), so that the forwards in the stress
  harness's default band, and in each of its quarters, are an exact difference of two buckets. Exact per-size counts stay in the JSON reports: one series per
  size would be thousands of series.
- ``forward_max_scheduled_tokens`` gauge: the largest real forward since the server started.
- ``guard_checks_total`` / ``guard_trips_total`` counters, per process (``role``, ``pid``).
- ``gdn_buffer_rows`` / ``gdn_buffer_bytes`` gauges, per buffer and process: the families of patch
  gdn-output-prealloc (``patches/_gdn_metrics.py``), like every patch's own, come from the patch's
  hook ``metric_families(reports)`` (``PatchSpec.hooks``), called at each scrape; the histogram's
  edges from the data a patch owns (the GDN buffer rows) from its hook ``bucket_edges(reports)``.
  This module reads no section a patch owns: it reaches patches through the registry and their
  declared hooks, never by importing one.
- ``patch_info`` (``patch``, ``status``, ``role``, ``pid``, ``waiting_for``): one series per patch and
  process; ``worker-only`` where a process that is no worker holds a patch armed for modules only
  workers import (``reports.shown_status``), ``waiting_for`` the modules an armed patch waits for.
- ``engine_config_info``: the live limits the workers saw, and the server id.
- ``processes``: how many overlay processes of this server reported, by role.
- ``reports_gone``: report files of this server id whose process is gone from this host, left out.
- ``server_id_servers``: live servers (process trees) reporting this server id; above 1 they share it.
- ``rank_missing_info`` (``engine_pid``, ``rank``, ``why``): a worker rank its engine core expected
  and got no report from (patch rank-reports).

Worker reports also arrive inside the engine core's report (``ranks``: gathered through vLLM's
executor, patch rank-reports), for workers whose report directory is on another host; a process
readable both ways is counted once (``reports.dedupe``).
"""

from __future__ import annotations

import importlib
import os
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

from vllm_overlay import report_files, server_id, settings
from vllm_overlay.report import LOG, STATE
from vllm_overlay.reports import (dedupe, expand, load_file, missing_ranks, process_gone, servers, shared_line,
                                  shown_status, waiting_for)
from vllm_overlay.telemetry import merge_sizes

PREFIX = "vllm_overlay_"
POW2_EDGES: tuple[int, ...] = tuple(2**i for i in range(21))  # 1 .. 1048576 (TOKEN_MAX)
HIST = PREFIX + "forward_scheduled_tokens"


# ---- the serving side: reports -> metric families -------------------------------------------


class ReportCache:
    """Parsed reports of one directory, re-read only when a file changed. Only regular files are
    read (``report_files.read``: no FIFO, device or link, never blocking, size-limited), and never
    while the lock is held: the lock guards the cache's dicts alone, so a slow file never holds up
    another scrape. ``live``: reports of processes gone from this host are left out whenever they
    were written (reports.process_gone; the serving side), and counted in ``gone``."""

    def __init__(self, live: bool = False) -> None:
        self.live = live
        self._lock = threading.Lock()
        # path -> (lstat stamp, the report or None, known gone)
        self._files: dict[str, tuple[tuple[int, ...], dict[str, Any] | None, bool]] = {}
        self.skipped: dict[str, str] = {}  # path -> why it is not a report (named on /metrics)
        self.gone = 0  # reports left out at the last read: their processes are gone

    def reports(self, directory: str, server: str | None) -> list[dict[str, Any]]:
        """This server's reports: only its own files are listed (their names carry the server
        id's key), so memory and time follow this server's processes, not the directory."""
        out, seen, gone = [], set(), 0
        for path, st in report_files.entries(directory, server_id.file_key(server)):
            seen.add(path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino, st.st_mode)
            cached = self._files.get(path)
            if cached is None or cached[0] != stamp:
                rep, why = load_file(path)  # outside the lock
                if rep is None and why is None:
                    continue  # removed since the listing
                if rep is not None:
                    rep["_path"] = path
                cached = (stamp, rep, False)
                with self._lock:
                    self._files[path] = cached
                    self._note(path, why)
            rep = cached[1]
            if rep is None or rep.get("server_id") != server:
                continue
            if self.live and (cached[2] or process_gone(rep)):
                if not cached[2]:  # a gone process stays gone: not checked again until the file changes
                    with self._lock:
                        self._files[path] = (cached[0], rep, True)
                gone += 1
                continue
            out.append(rep)
        with self._lock:
            for path in set(self._files) - seen:
                del self._files[path]
                self.skipped.pop(path, None)
            self.gone = gone
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


def recorded_edges(rep: dict[str, Any]) -> set[int]:
    """The token counts a process's report says its settings gave: the profile cap the worker ran
    with (``engine_config.profile_run_cap``) and each budget requested by a setting (``budgets``:
    ``requested`` where ``requested_source`` names the variable). Read from the report, never from
    this process's environment: the API server's may differ from the workers'."""
    out: set[int] = set()
    cap = (rep.get("engine_config") or {}).get("profile_run_cap")
    if isinstance(cap, int) and not isinstance(cap, bool) and cap > 0:
        out.add(cap)
    for b in rep.get("budgets") or []:
        if not isinstance(b, dict) or not str(b.get("requested_source", "")).startswith(("env ", "alias ")):
            continue
        requested = b.get("requested")
        if isinstance(requested, int) and not isinstance(requested, bool) and requested > 0:
            out.add(requested)
    return out


def bucket_edges(reports: list[dict[str, Any]]) -> list[int]:
    """Powers of two plus this server's own band edges (see the module docstring), all read from
    the reports: the engine limits and settings' edges here, those of the data a patch owns (the GDN
    buffers' rows) from that patch's hook ``bucket_edges`` (``patch_edges``)."""
    edges = set(POW2_EDGES)
    tops: set[int] = set()
    lows: set[int] = set()
    for rep in reports:
        mnbt = (rep.get("engine_config") or {}).get("max_num_batched_tokens")
        if isinstance(mnbt, int) and mnbt > 0:
            edges.update((mnbt, mnbt // 2))
            tops.add(mnbt)
            lows.add(mnbt // 2)
        recorded = recorded_edges(rep)
        edges.update(recorded)
        lows.update(recorded)
    edges.update(patch_edges(reports))
    # the quarter edges of the stress's default bands, (low, mnbt], so /metrics counts each quarter
    for top in tops:
        for low in lows:
            if 0 <= low < top:
                edges.update(low + (top - low) * i // 4 for i in (1, 2, 3))
    return sorted(e for e in edges if e > 0)


def families(reports: list[dict[str, Any]], server: str | None,
             skipped: dict[str, str] | None = None,
             missing: list[dict[str, Any]] | None = None, left_out: int = 0) -> Iterator[Any]:
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
    info = InfoMetricFamily(PREFIX + "patch", "One series per patch and process: its status there (worker-only: "
                            "armed in a process that is no worker, for modules only workers import; it acts in "
                            "the workers) and the modules an armed patch waits for.",
                            labels=["patch", "status", "role", "pid", "waiting_for"])
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
        for patch_id, rec in sorted((rep.get("patches") or {}).items()):
            info.add_metric([patch_id, shown_status(rep, rec), role, pid, waiting_for(rec)], {})
        for k, v in (rep.get("engine_config") or {}).items():
            if k != "unknown":
                config[k] = str(v)
        if rep.get("vllm_version"):
            config.setdefault("vllm_version", str(rep["vllm_version"]))
    yield from (checks, trips, info, age)
    yield from patch_families(reports)
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
    left = GaugeMetricFamily(PREFIX + "reports_gone",
                             "Report files of this server id whose process no longer runs on this host: left out "
                             "of every other series (a crash, an earlier boot under the same id, a planted file).")
    left.add_metric([], left_out)
    yield left
    shared = GaugeMetricFamily(PREFIX + "server_id_servers",
                               "Live servers whose processes report this server id (their process trees): 1, or more "
                               "when several servers share one hand-set VLLM_OVERLAY_SERVER_ID and these series mix.")
    shared.add_metric([], max(1, len(servers(reports))) if reports else 0)
    yield shared
    yield from write_families()


def patch_families(reports: list[dict[str, Any]]) -> Iterator[Any]:
    """The families each patch owns: every registry patch whose spec declares the hook
    ``metric_families`` is called with the reports, whatever its status in this process (it acts in
    the workers). A hook that fails is one WARNING per distinct error, naming the patch; the other
    series stay."""
    for mod in hook_modules():
        yield from _call_hook(mod, "metric_families", reports, "series")


def patch_edges(reports: list[dict[str, Any]]) -> set[int]:
    """The histogram's edges from the data each patch owns: every registry patch whose spec declares
    the hook ``bucket_edges`` is called with the reports, as ``patch_families``. A hook that fails is
    one WARNING per distinct error, naming the patch; the other edges stay."""
    out: set[int] = set()
    for mod in hook_modules("bucket_edges"):
        out.update(int(e) for e in _call_hook(mod, "bucket_edges", reports, "bucket edges"))
    return out


def _call_hook(mod: Any, hook: str, reports: list[dict[str, Any]], what: str) -> list[Any]:
    """What ``mod``'s hook gives for ``reports``, as a list; [] and one WARNING per distinct error
    when it fails."""
    try:
        return list(getattr(mod, hook)(reports))
    except Exception as exc:  # noqa: BLE001 - one patch's series never break the others
        text = f"{mod.SPEC.id}: {hook}: {type(exc).__name__}: {exc}"
        if text not in _hook_warned:
            _hook_warned.add(text)
            LOG.warning("/metrics: the %s of patch %s are left out: %s failed: %s: %s",
                        what, mod.SPEC.id, hook, type(exc).__name__, exc)
        return []


_hook_warned: set[str] = set()


def hook_modules(hook: str = "metric_families") -> list[Any]:
    """The registry's patch modules whose spec declares ``hook`` (``metric_families`` or
    ``bucket_edges``), in apply order. Patches are reached through the registry, never imported by name."""
    from vllm_overlay.registry import PATCH_MODULES

    mods = [importlib.import_module(name) for name in PATCH_MODULES]
    return [m for m in mods if hook in m.SPEC.hooks]


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
        # the serving side (no directory given): reports of processes gone from this host are not counted
        self.cache = ReportCache(live=directory is None)
        self._warned: str | None = None  # the last error logged: a new one is logged again
        self._shared: str | None = None  # the last line on a shared server id: a new one is logged again

    def describe(self) -> list[Any]:
        return []  # no name checks at registration: our names never clash with vLLM's "vllm:" ones

    def collect(self) -> Iterator[Any]:
        server = self.server or settings.value("VLLM_OVERLAY_SERVER_ID")
        try:
            if self.directory is None:
                res = settings.resolve("VLLM_OVERLAY_REPORT_DIR")
                directory = res.value
                if (why := settings.check(res)) is not None:  # a default directory replaced since start-up
                    raise ValueError(f"{why}; its reports are not read")
            else:
                directory = self.directory
            reports = self.cache.reports(directory, server) if os.path.isdir(directory) else []
            if self.directory is None and STATE.registered:  # this process: fresher than its file
                own = STATE.to_json()
                reports = [r for r in reports if r.get("instance") != own["instance"]] + [own]
            reports = dedupe([r for rep in reports for r in expand(rep)])
            self._say_shared(server, reports)
            out = list(families(reports, server, self.cache.skipped, missing_ranks(reports), self.cache.gone))
        except Exception as exc:  # noqa: BLE001 - never break vLLM's own /metrics
            text = f"{type(exc).__name__}: {exc}"
            if self._warned != text:
                LOG.warning("the /metrics collector could not read the reports: %s", text)
                self._warned = text
            return
        self._warned = None
        yield from out

    def _say_shared(self, server: str | None, reports: list[dict[str, Any]]) -> None:
        """One WARNING while several live servers report this server id (and again when they change)."""
        trees = servers(reports)
        line = shared_line(server, trees)
        key = ",".join(sorted(trees)) if line else None
        if line is not None and key != self._shared:
            LOG.warning("/metrics: %s", line)
        self._shared = key


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
