"""Forward-size histogram: exact counts per scheduled-token size, plus power-of-two buckets; and
the report's ``telemetry`` section (``TELEMETRY``), which patch forward-telemetry records into."""

from __future__ import annotations

import threading
from typing import Any

from vllm_overlay import report


def bucket_of(n: int) -> str:
    """Power-of-two bucket label "(lo, hi]" holding ``n`` (n >= 1)."""
    hi = 1
    while hi < n:
        hi *= 2
    lo = hi // 2
    return f"({lo}, {hi}]" if hi > 1 else "(0, 1]"


def bucket_counts(sizes: dict[int, int]) -> dict[str, int]:
    """Exact size counts folded into power-of-two buckets, smallest bucket first."""
    buckets: dict[str, int] = {}
    for size in sorted(sizes):
        label = bucket_of(size)
        buckets[label] = buckets.get(label, 0) + sizes[size]
    return buckets


def in_band(sizes: dict[int, int], lo: int, hi: int) -> int:
    """How many forwards had a size in (lo, hi]."""
    return sum(c for s, c in sizes.items() if lo < s <= hi)


class Histogram:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sizes: dict[int, int] = {}
        self.count = 0
        self.tokens = 0
        self.min: int | None = None
        self.max: int | None = None

    def record(self, n: int) -> None:
        with self._lock:
            self.sizes[n] = self.sizes.get(n, 0) + 1
            self.count += 1
            self.tokens += n
            self.min = n if self.min is None else min(self.min, n)
            self.max = n if self.max is None else max(self.max, n)

    def to_json(self) -> dict[str, Any]:
        with self._lock:
            return {
                "count": self.count,
                "tokens": self.tokens,
                "min": self.min,
                "max": self.max,
                "sizes": {str(k): self.sizes[k] for k in sorted(self.sizes)},
                "buckets": bucket_counts(self.sizes),
            }


class Forwards(report.Section):
    """The report's ``telemetry``: the real forwards' sizes, the dummy forwards' (profiling, warm-up,
    graph capture) and the profiling forwards' token counts in order. A forked child starts at zero."""

    def reset(self) -> None:
        self.forwards = Histogram()
        self.dummy_forwards = Histogram()
        self.profile_forward_tokens: list[int] = []

    def to_json(self) -> dict[str, Any]:
        return {"forwards": self.forwards.to_json(), "dummy_forwards": self.dummy_forwards.to_json(),
                "profile_forward_tokens": self.profile_forward_tokens}

    def record(self, n: int) -> None:
        """A real forward of ``n`` scheduled tokens (the flusher writes it within a second)."""
        with self.changing(start_flusher=True):
            self.forwards.record(n)

    def record_dummy(self, n: int, is_profile: bool) -> None:
        with self.changing():
            self.dummy_forwards.record(n)
            if is_profile:
                self.profile_forward_tokens.append(n)


TELEMETRY = report.section("telemetry", Forwards)


def merge_sizes(reports: list[dict[str, Any]], key: str = "forwards") -> dict[int, int]:
    """Sum the exact size counts of ``key`` over several process reports. Tensor-parallel ranks
    other than 0 run the same forwards as rank 0 and are not counted again."""
    total: dict[int, int] = {}
    for rep in reports:
        if rep.get("tp_rank") not in (None, 0):
            continue
        for size, count in ((rep.get("telemetry") or {}).get(key) or {}).get("sizes", {}).items():
            total[int(size)] = total.get(int(size), 0) + int(count)
    return total
