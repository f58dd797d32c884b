"""`vllm-overlay tune-gemv`'s loop: per one-row projection shape, time cuBLAS (torch.nn.functional.linear,
what vLLM's CUDA GEMM runs for these layers) and the decode-gemv kernel over a bounded config space, keep
the GEMV's fastest config where it beats cuBLAS and "cublas" where it does not, within a time budget.

The config space is the one bench/decode_gemv_h200.py searches: the heuristic's config, then tile shapes
(BLOCK_N 1-32 x BLOCK_K 128-2048, 1,024 to 16,384 elements a tile) at 4 warps and 1 stage, then 2, 4 or 8
warps and 1 or 3 stages around the three fastest. Each shape gets an equal share of the budget left when
it starts; cuBLAS and the heuristic are timed first, so a shape that starts is always decided. A shape the
budget does not reach is not written (the run says which, exit 3).

Everything that needs a GPU comes in through ``Timer`` (``gemv_cuda.py`` builds the real one), so the
loop, the budget and the decisions run on a CPU with a stand-in timer.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from vllm_overlay import gemv_table
from vllm_overlay.tools.output import Out
from vllm_overlay.tools.progress import Ticker
from vllm_overlay.tools.tune.gemv_shapes import GemvShape

DONE, BUDGET_SPENT = 0, 3  # exit codes: every shape decided / the budget ran out first (rerun with more)
CUBLAS = "cublas"
Cfg = tuple[int, int, int, int]  # BLOCK_N, BLOCK_K, num_warps, num_stages


class Timer(Protocol):
    """The GPU side: microseconds of one call (median of its replays); raises for a config that does
    not compile or run."""

    device: str
    sms: int
    versions: dict[str, str]

    def cublas_us(self, shape: GemvShape) -> float: ...

    def gemv_us(self, shape: GemvShape, cfg: Cfg) -> float: ...


def round_one(k: int) -> list[Cfg]:
    """Tile shapes at 4 warps and 1 stage (bench/decode_gemv_h200.py's first round)."""
    kmax = max(128, gemv_table.pow2_at_least(k))
    return [(bn, bk, 4, 1) for bn in (1, 2, 4, 8, 16, 32) for bk in (128, 256, 512, 1024, 2048)
            if bk <= kmax and 1024 <= bn * bk <= 16384]


def round_two(top: list[Cfg]) -> list[Cfg]:
    """2, 4 or 8 warps and 1 or 3 stages around the fastest tiles."""
    return [(bn, bk, w, s) for bn, bk, _, _ in top for w in (2, 4, 8) for s in (1, 3)]


def heuristic(n: int, k: int, sms: int) -> Cfg:
    """The kernel's heuristic config (gemv_table.heuristic) as a tuple."""
    return tuple(gemv_table.heuristic(n, k, sms).as_list())  # type: ignore[return-value]


@dataclass
class Decision:
    shape: GemvShape
    cublas_us: float
    best: Cfg | None  # the fastest GEMV config that ran (None: none ran)
    best_us: float
    heuristic: Cfg
    heuristic_us: float | None
    timed: int
    failed: list[Cfg] = field(default_factory=list)
    cut: bool = False  # its share of the budget ended the search early
    seconds: float = 0.0

    @property
    def entry(self) -> list[int] | str:
        """The table's entry: the GEMV's config where it beat cuBLAS, else "cublas"."""
        if self.best is None or not self.best_us < self.cublas_us:
            return CUBLAS
        return list(self.best)

    def as_json(self) -> dict[str, Any]:
        return {"n": self.shape.n, "k": self.shape.k, "names": self.shape.names, "per_step": self.shape.per_step,
                "entry": self.entry, "cublas_us": round(self.cublas_us, 3),
                "gemv_us": round(self.best_us, 3) if math.isfinite(self.best_us) else None,
                "gemv_config": list(self.best) if self.best else None, "heuristic": list(self.heuristic),
                "heuristic_us": round(self.heuristic_us, 3) if self.heuristic_us is not None else None,
                "configs_timed": self.timed, "configs_failed": [list(c) for c in self.failed],
                "search_cut_by_budget": self.cut, "seconds": round(self.seconds, 1)}


def _time(fn: Callable[[], float]) -> float | None:
    try:
        t = float(fn())
    except Exception:  # noqa: BLE001 - a config that cannot compile or launch is skipped, counted as failed
        return None
    return t if t > 0 and math.isfinite(t) else None


def tune(shapes: list[GemvShape], timer: Timer, budget_s: float, out: Out | None = None,
         clock: Callable[[], float] = time.monotonic) -> tuple[list[Decision], list[GemvShape], list[GemvShape]]:
    """(the decided shapes, the shapes the budget did not reach, the shapes where cuBLAS did not run)."""
    out = out or Out()
    t0 = clock()
    deadline = t0 + budget_s
    decided: list[Decision] = []
    skipped: list[GemvShape] = []
    unrun: list[GemvShape] = []
    planned = sum(1 + 1 + len(round_one(s.k)) + 6 * 3 for s in shapes)
    out.line(f"tune-gemv on {timer.device} ({timer.sms} SMs): {len(shapes)} shape(s), at most {planned} timings, "
             f"budget {budget_s:g} s")
    with Ticker(out, planned, label="timings") as tick:
        for i, shape in enumerate(shapes):
            now = clock()
            if now >= deadline:
                skipped.extend(shapes[i:])
                break
            share_end = now + (deadline - now) / (len(shapes) - i)
            label = f"{shape.key} ({shape.names}" + (f", {shape.per_step} per step)" if shape.per_step else ")")
            tick.note(f"shape {i + 1}/{len(shapes)} {label}: timing cuBLAS and the GEMV, "
                      f"{share_end - now:.0f} s of the budget")
            cub = _time(lambda: timer.cublas_us(shape))
            tick.advance()
            if cub is None:
                tick.note(f"  {shape.key}: cuBLAS did not run (out of memory?); not written")
                unrun.append(shape)
                continue
            tried: dict[Cfg, float] = {}
            failed: list[Cfg] = []
            heur = heuristic(shape.n, shape.k, timer.sms)

            def attempt(cfg: Cfg, shape: GemvShape = shape) -> None:
                t = _time(lambda: timer.gemv_us(shape, cfg))
                tick.advance()
                if t is None:
                    failed.append(cfg)
                else:
                    tried[cfg] = t

            def search(cfgs: list[Cfg]) -> bool:
                """Times the configs not timed yet; True where the shape's share of the budget ended first."""
                for cfg in cfgs:
                    if cfg in tried or cfg in failed:
                        continue
                    if clock() >= share_end:
                        return True
                    attempt(cfg)
                return False

            attempt(heur)  # always: with cuBLAS, the least a shape that starts is decided on
            cut = search(round_one(shape.k))
            if not cut:
                cut = search(round_two(sorted(tried, key=tried.__getitem__)[:3]))
            best = min(tried, key=tried.__getitem__) if tried else None
            d = Decision(shape, cub, best, tried[best] if best else math.inf, heur, tried.get(heur),
                         len(tried) + len(failed), failed, cut, clock() - now)
            decided.append(d)
            gemv = f"GEMV {d.best_us:.2f} us {list(best)}" if best else "no GEMV config ran"
            verdict = "GEMV kept" if d.entry != CUBLAS else "cuBLAS kept"
            ratio = f" (x{cub / d.best_us:.2f})" if best else ""
            tick.note(f"  {shape.key}: cuBLAS {cub:.2f} us, {gemv}{ratio}: {verdict}; {d.timed} configs timed"
                      + (", cut short by its share of the budget" if cut else "") + f" [{d.seconds:.1f} s]")
    return decided, skipped, unrun


def per_step(decided: list[Decision]) -> dict[str, float] | None:
    """One decode step's time in these shapes (calls one after another): cuBLAS everywhere, the table's
    choice, the heuristic's configs everywhere. None where a shape's count per step is not known."""
    if not decided or any(d.shape.per_step <= 0 for d in decided):
        return None
    cub = sum(d.cublas_us * d.shape.per_step for d in decided)
    chosen = sum(min(d.best_us, d.cublas_us) * d.shape.per_step for d in decided)
    heur = sum((d.heuristic_us if d.heuristic_us is not None else math.inf) * d.shape.per_step for d in decided)
    return {"cublas_us": round(cub, 1), "table_us": round(chosen, 1),
            "heuristic_us": round(heur, 1) if math.isfinite(heur) else None}
