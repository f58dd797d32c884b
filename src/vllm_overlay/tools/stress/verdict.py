"""Judge a stress run from the serving processes' forward telemetry."""

from __future__ import annotations

import time

from dataclasses import dataclass, field
from typing import Any

from vllm_overlay.tools.stress.plan import quarter_edges
from vllm_overlay.telemetry import in_band

PASSED, FAILED, BAD_USAGE, DID_NOT_TEST, UNREACHABLE = 0, 1, 2, 3, 4
NAMES = {PASSED: "PASSED", FAILED: "FAILED", BAD_USAGE: "BAD USAGE", DID_NOT_TEST: "DID NOT TEST",
         UNREACHABLE: "UNREACHABLE"}


@dataclass
class Outcome:
    requests_ok: int = 0
    requests_failed: int = 0
    errors: list[str] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)  # of the wave prefills
    generated_tokens: int = 0
    wall_s: float = 0.0  # from the end of the warm-up wave
    engine_error: str | None = None
    warmup_s: float | None = None  # the warm-up wave, before the clock (kernels compiled on first use)
    wave_s: list[float] = field(default_factory=list)  # each timed wave, in order
    clock_start: float | None = None  # perf_counter() when the timed waves began
    topup_waves: int = 0  # server mode: waves added because too few forwards landed in the band
    stalled: str | None = None  # server mode: the server stopped answering (requests cancelled)
    unreachable: str | None = None  # server mode: the server went away (its /health refuses connections)


SLOW_FACTOR = 3.0  # a wave slower than this many times the median is named in the output


def slow_waves(wave_s: list[float]) -> list[dict[str, float]]:
    """Timed waves that took more than SLOW_FACTOR x the median (1-based wave numbers)."""
    med = percentile(wave_s, 50)
    if not med or len(wave_s) < 3:
        return []
    return [{"wave": i + 1, "s": round(t, 3), "median_s": round(med, 3)}
            for i, t in enumerate(wave_s) if t > SLOW_FACTOR * med]


def sizes_delta(before: dict[int, int], after: dict[int, int]) -> dict[int, int]:
    out = {}
    for size, count in after.items():
        diff = count - before.get(size, 0)
        if diff > 0:
            out[size] = diff
    return out


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[idx]


def band_quarters(sizes: dict[int, int], lo: int, hi: int,
                  bucket_edges: list[int] | None = None) -> tuple[list[dict[str, Any]], bool]:
    """Band forwards per quarter of (lo, hi], and whether the counts are exact. With
    ``bucket_edges`` (sizes keyed by /metrics bucket upper edges) a bucket that straddles a quarter
    edge counts in the lowest quarter it overlaps, so the top quarter is never claimed wrongly."""
    e = quarter_edges(lo, hi)
    counts = [0, 0, 0, 0]
    exact = True
    lower = {}
    if bucket_edges is not None:
        ordered = sorted(set(bucket_edges) | set(sizes))
        lower = {b: (ordered[i - 1] if i else 0) for i, b in enumerate(ordered)}
    for size, n in sizes.items():
        if not lo < size <= hi:
            continue
        q = next(i for i in range(4) if size <= e[i + 1])
        if bucket_edges is not None:
            low = max(lower.get(size, 0), lo)
            first = next(i for i in range(4) if low < e[i + 1])
            if first != q:
                exact = False
            q = first
        counts[q] += n
    return [{"quarter": i + 1, "range": [e[i], e[i + 1]], "forwards": counts[i]} for i in range(4)], exact


def judge(lo: int, hi: int, min_band: int, sizes: dict[int, int], outcome: Outcome,
          reports: list[dict[str, Any]], allow_partial: bool = False,
          bucket_edges: list[int] | None = None, max_forward: int | None = None) -> dict[str, Any]:
    band = in_band(sizes, lo, hi)
    quarters, exact = band_quarters(sizes, lo, hi, bucket_edges)
    e = quarter_edges(lo, hi)
    biggest = max_forward if max_forward is not None else (max(sizes) if sizes else None)
    # a largest forward known exactly (grew during this run) that lies in the top quarter counts too
    top_hit = quarters[3]["forwards"] > 0 or (max_forward is not None and e[3] < max_forward <= hi)
    missed = [str(q["quarter"]) for q in quarters if not q["forwards"]]
    trips = sum(int(r.get("counters", {}).get("guard_trips", 0)) for r in reports)
    workers = [r for r in reports if r.get("patches", {}).get("forward-telemetry", {}).get("status") == "applied"]
    if outcome.stalled or outcome.unreachable:
        code, why = UNREACHABLE, outcome.stalled or f"the server went away during the run: {outcome.unreachable}"
    elif outcome.engine_error or outcome.requests_failed:
        code, why = FAILED, outcome.engine_error or f"{outcome.requests_failed} request(s) failed"
    elif not workers:
        code, why = DID_NOT_TEST, "no serving process reported forward telemetry (is the overlay installed there?)"
    elif band < min_band:
        code, why = DID_NOT_TEST, f"only {band} forward(s) landed in ({lo}, {hi}], {min_band} required"
    elif not top_hit and not allow_partial:
        code, why = DID_NOT_TEST, (
            f"{band} forwards in ({lo}, {hi}] but none in its top quarter ({e[3]}, {hi}] (largest forward "
            f"{biggest}): the sizes where a buffer sized below the top overflows first were not tested; "
            "--allow-partial-band accepts this")
    else:
        code, why = PASSED, f"{band} forwards in ({lo}, {hi}], every request completed"
        if not top_hit:
            why += (f"; PARTIAL BAND accepted (--allow-partial-band): none in the top quarter ({e[3]}, {hi}], "
                    f"largest forward {biggest}")
        elif missed:
            why += f"; band quarter(s) {', '.join(missed)} saw no forward"
    return {
        "exit_code": code,
        "verdict": NAMES[code],
        "why": why,
        "band": [lo, hi],
        "band_forwards": band,
        "min_band_forwards": min_band,
        "forwards": sum(sizes.values()),
        "max_forward": max(sizes) if sizes else None,
        "band_quarters": quarters,
        "band_quarters_exact": exact,
        "top_quarter_covered": top_hit,
        "partial_band_accepted": bool(allow_partial and not top_hit),
        "max_forward_share_of_hi": round(biggest / hi, 3) if biggest and hi else None,
        "guard_trips": trips,
        "requests_ok": outcome.requests_ok,
        "requests_failed": outcome.requests_failed,
        "errors": outcome.errors[:20],
        "generated_tokens": outcome.generated_tokens,
        "wall_s": round(outcome.wall_s, 3),
        "warmup_s": round(outcome.warmup_s, 3) if outcome.warmup_s is not None else None,
        "waves_timed": len(outcome.wave_s),
        "waves_topup": outcome.topup_waves,
        "wave_s_median": percentile(outcome.wave_s, 50),
        "slow_waves": slow_waves(outcome.wave_s),
        "tokens_per_s": round(outcome.generated_tokens / outcome.wall_s, 2) if outcome.wall_s else None,
        "ttft_p50_s": percentile(outcome.ttft_s, 50),
        "ttft_p99_s": percentile(outcome.ttft_s, 99),
        "sizes": {str(k): v for k, v in sorted(sizes.items())},
        "worker_reports": [r.get("_path") for r in workers],
        "worker_roles": [r.get("role") for r in workers],  # tensor parallel: one per rank
        # what the run is evidence of (bench/evidence.py matches it to a support-level cell)
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "processes": [{"role": r.get("role"), "vllm_version": r.get("vllm_version"), "platform": r.get("platform"),
                       "runner": r.get("runner") or None,
                       "patches": {pid: rec.get("status") for pid, rec in (r.get("patches") or {}).items()}}
                      for r in reports],
    }
