"""memory-headroom's runtime watch: once the real KV cache exists, the meter's peak against what the
correction reserved, read by a daemon thread; a harness may split it into named windows through
``memory-window.json`` in VLLM_OVERLAY_REPORT_DIR (read here, in the worker)."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from vllm_overlay import headroom, report
from vllm_overlay.report import LOG, STATE


MARK_FILE = "memory-window.json"  # in VLLM_OVERLAY_REPORT_DIR: {"seq": N, "name": "..."} opens a window
WATCH_EVERY_S = 0.5
WINDOWS_KEPT = 64


class Watch:
    """The meter's peak from the moment the real KV cache exists (CUDA graph capture, warm-up and
    every step after it included), against the budget the correction left: vLLM's reserved peak
    plus what was moved out of the KV cache (nothing in a dry run). Read every WATCH_EVERY_S by a
    daemon thread (allocator statistics only: no CUDA call, no per-step cost); the peak is never
    reset unless a harness writes VLLM_OVERLAY_REPORT_DIR/memory-window.json ({"seq": N, "name":
    "..."}, a new seq each time): then the window open until then is closed with its own peak, the
    peak statistic is reset and a window of that name opens (the harness waits until the report
    shows it). Report field ``patches.memory-headroom.runtime``; the first time the peak exceeds
    the budget, one WARNING (CUDA only: the CPU build's resident set counts more than tensors).
    Where the meter has one (CUDA), each window also keeps the allocator's reserved peak
    (``reserved_peak``, absolute bytes): what the device saw of this process's allocator, cached
    blocks included, beside the allocated peak that is compared with the budget."""

    def __init__(self, meter: Any, kv_bytes: int, baseline: int, budget: int, mark_path: str,
                 warn: bool, patch_id: str) -> None:
        self.patch_id = patch_id  # whose report entry carries the record (field runtime)
        self.meter, self.kv_bytes, self.baseline, self.budget = meter, kv_bytes, baseline, budget
        self.mark_path, self.warn = mark_path, warn
        self.peak = 0
        self.window: dict[str, Any] | None = None
        self.mark_stat: tuple[int, int] | None = None
        self.warned = False
        self.stop = threading.Event()
        self.record: dict[str, Any] = {
            "kv_bytes": kv_bytes, "baseline": baseline, "budget": budget, "meter": meter.name,
            "whole_process": bool(getattr(meter, "whole_process", False)),
            "mark_file": mark_path, "every_s": WATCH_EVERY_S, "started": time.time(), "windows": []}

    def numbers(self, peak: int) -> dict[str, int]:
        return headroom.runtime(peak=peak, kv_bytes=self.kv_bytes, baseline=self.baseline, budget=self.budget)

    def start(self) -> None:
        self.meter.reset_peak()
        self.peak = self.meter.current()
        self.publish()
        threading.Thread(target=self.loop, name="vllm-overlay-memory-watch", daemon=True).start()

    def loop(self) -> None:
        while not self.stop.wait(WATCH_EVERY_S):
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 - the watch must never disturb serving
                with STATE.lock:
                    self.record["error"] = f"{type(exc).__name__}: {exc}"[:300]
                self.publish()
                return

    def read_mark(self) -> tuple[int, str] | str | None:
        """The mark file's (seq, name) when it changed since the last read, an error text when it
        cannot be read as one, else None."""
        try:
            st = os.stat(self.mark_path)
        except OSError:
            return None
        key = (st.st_mtime_ns, st.st_size)
        if key == self.mark_stat:
            return None
        self.mark_stat = key
        try:
            with open(self.mark_path) as f:
                mark = json.load(f)
            return int(mark["seq"]), str(mark["name"])[:100]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return (f"{self.mark_path}: {type(exc).__name__}: {exc}; expected "
                    '{"seq": N, "name": "..."}')[:300]

    def tick(self) -> None:
        """One read: the peak since the last reset, and a new window if the mark file asks for one.
        The record is changed under the report's lock (the flusher serialises it meanwhile)."""
        now = time.time()
        p = self.meter.peak()
        reserved = getattr(self.meter, "peak_reserved", None)
        r = reserved() if reserved is not None else None
        mark = self.read_mark()
        with STATE.lock:
            changed = False
            if p > self.peak:
                self.peak, changed = p, True
                self.record["peak_at"] = now
            if self.window is not None and p > self.window["peak"]:
                self.window["peak"], changed = p, True
            if self.window is not None and r is not None and r > self.window.get("reserved_peak", 0):
                self.window["reserved_peak"], changed = r, True
            if isinstance(mark, str):
                self.record["mark_error"], changed = mark, True
            elif mark is not None and (self.window is None or mark[0] != self.window["seq"]):
                if self.window is not None:
                    self.window["end"] = now
                self.meter.reset_peak()
                idle = self.meter.current()
                self.window = {"seq": mark[0], "name": mark[1], "start": now, "end": None, "idle": idle,
                               "peak": idle}
                self.record["windows"] = (self.record["windows"] + [self.window])[-WINDOWS_KEPT:]
                changed = True
            if changed:
                self.publish()

    def publish(self) -> None:
        with STATE.lock:
            self.record.update(self.numbers(self.peak))
            for w in self.record["windows"]:
                w.update(self.numbers(w["peak"]), above_idle=w["peak"] - w["idle"])
            report.patch_note(self.patch_id, runtime=self.record)  # the watch changes it in place, under STATE.lock
        over = self.record["over_budget"]
        if self.warn and over > 0 and not self.warned:
            self.warned = True
            text = (f"memory-headroom: after the KV cache was allocated the allocator peaked "
                    f"{self.record['runtime_peak'] / headroom.GIB:.3f} GiB above the pre-profiling baseline "
                    f"(the KV cache left out), {over / headroom.GIB:.3f} GiB ({over} bytes) more than was "
                    f"reserved ({(self.budget - self.baseline) / headroom.GIB:.3f} GiB); the memory outside "
                    "gpu_memory_utilization absorbed it, or the next such step runs out of memory")
            STATE.event(text)
            LOG.warning(text)
