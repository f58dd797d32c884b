"""A series' servers side by side on one GPU: the stagger gate (the next boot once the previous one
sized its KV cache), the profiling windows (one server profiling at a time) and the quiet GPU for
speed measurements."""

from __future__ import annotations

import threading
import time
from typing import Any

from .server import alive, save_state, say, series_state, serve_log


KV_SIZED = " KV cache size: "  # vLLM's log line once a server's KV cache is sized ("GPU KV cache size: N tokens")
STAGGER_MAX_S = 420  # a server that logged no KV cache size by then does not hold the next one back


def window_closed(label: str, stagger: float) -> bool:
    """Whether the server of ``label`` started ``stagger`` seconds ago and, unless its KV cache has a fixed
    size, has sized its KV cache or stopped (or STAGGER_MAX_S passed: said once)."""
    st = series_state(label)
    if st is None:
        return False
    age = time.time() - st["started"]
    sized = ((st.get("vllm_args") or {}).get("kv_cache_memory_bytes") or KV_SIZED in serve_log(label)
             or not alive(st["pid"]))
    if age >= stagger and not sized and age >= STAGGER_MAX_S and not st.get("stagger_said"):
        say(f"series: {label} has not sized its KV cache after {age:.0f} s; the next server starts anyway")
        st["stagger_said"] = True
        save_state(label, st)
    return age >= stagger and (sized or age >= STAGGER_MAX_S)


def stagger_gate(prev: str, stagger: float, t_end: float) -> bool:
    """Wait until the server of ``prev`` (the label before this one on the same GPU) started ``stagger``
    seconds ago and, unless its KV cache has a fixed size, has sized its KV cache or stopped: vLLM's
    memory profiling reads the GPU's free memory, so another server's allocations during it move its KV
    budget. False when the deadline comes first (the next run waits on)."""
    said = False
    while time.time() < t_end - 5:
        if window_closed(prev, stagger):
            return True
        if not said:
            say(f"series: waiting for {prev} (started {stagger:.0f} s before, KV cache sized) before the next boot "
                "on its GPU")
            said = True
        time.sleep(2)
    return False


class GpuWindows:
    """Series with "profile_alone", servers side by side on one GPU: one server at a time is in its profiling
    window (from its start until window_closed), and none while another server of the series there sends
    traffic or stops; traffic waits while a window is open or a boot is due there (``due``: labels waiting to
    boot), so the windows run back to back. The waits end at the series' deadline (False)."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.open: dict[str | None, str] = {}  # GPU -> the label in its window
        self.traffic: dict[str | None, int] = {}  # GPU -> traffic steps and stops running
        self.due: dict[str | None, set[str]] = {}
        self.stagger = 0.0

    def _closed(self, gpu: str | None) -> bool:
        label = self.open.get(gpu)
        if label is not None and window_closed(label, self.stagger):
            del self.open[gpu]
        return gpu not in self.open

    def _wait(self, ready: Any, t_end: float) -> bool:
        while not ready():
            if time.time() >= t_end - 5:
                return False
            self.cv.wait(timeout=2)
        return True

    def expect(self, label: str, gpu: str | None) -> None:
        with self.cv:
            self.due.setdefault(gpu, set()).add(label)

    def boot(self, label: str, gpu: str | None, t_end: float) -> bool:
        with self.cv:
            self.due.setdefault(gpu, set()).add(label)
            ok = self._wait(lambda: self._closed(gpu) and not self.traffic.get(gpu), t_end)
            if ok:
                self.due[gpu].discard(label)
                self.open[gpu] = label
            return ok

    def unbooked(self, label: str, gpu: str | None) -> None:  # a boot that never started
        with self.cv:
            self.due.get(gpu, set()).discard(label)
            if self.open.get(gpu) == label:
                del self.open[gpu]
            self.cv.notify_all()

    def traffic_start(self, label: str, gpu: str | None, t_end: float) -> bool:
        with self.cv:
            ok = self._wait(lambda: self._closed(gpu) and not self.due.get(gpu, set()) - {label}, t_end)
            if ok:
                self.traffic[gpu] = self.traffic.get(gpu, 0) + 1
            return ok

    def traffic_end(self, gpu: str | None) -> None:
        with self.cv:
            self.traffic[gpu] -= 1
            self.cv.notify_all()


class GpuQuiet:
    """Speed measurements of a series run alone on their GPU: ``alone`` waits until no other server of the
    series on that GPU boots, serves traffic or is being stopped, and boots, traffic and stops there wait
    while it measures. The waits end at the series' deadline (False: the next run goes on)."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.busy: dict[str, str | None] = {}  # label -> its GPU, while it boots or serves traffic
        self.alone_on: dict[str | None, str] = {}  # GPU -> the label measuring alone there

    def start(self, label: str, gpu: str | None, t_end: float) -> bool:
        with self.cv:
            ok = self.cv.wait_for(lambda: self.alone_on.get(gpu, label) == label, timeout=self.timeout(t_end))
            if ok:
                self.busy[label] = gpu
            return ok

    @staticmethod
    def timeout(t_end: float) -> float | None:
        return None if t_end == float("inf") else max(0.0, t_end - time.time() - 5)

    def end(self, label: str) -> None:
        with self.cv:
            self.busy.pop(label, None)
            self.cv.notify_all()

    def alone(self, label: str, gpu: str | None, t_end: float) -> bool:
        def free() -> bool:
            return gpu not in self.alone_on and not any(g == gpu and x != label for x, g in self.busy.items())

        with self.cv:
            if not free():
                say(f"series: {label}: waiting until no other server on GPU {gpu or 'as visible'} boots or serves "
                    f"traffic ({', '.join(sorted(x for x, g in self.busy.items() if g == gpu and x != label)) or '-'}"
                    f"{'; ' + self.alone_on[gpu] + ' measures' if gpu in self.alone_on else ''})")
            ok = self.cv.wait_for(free, timeout=self.timeout(t_end))
            if ok:
                self.alone_on[gpu] = label
            return ok

    def end_alone(self, label: str, gpu: str | None) -> None:
        with self.cv:
            if self.alone_on.get(gpu) == label:
                del self.alone_on[gpu]
            self.cv.notify_all()
