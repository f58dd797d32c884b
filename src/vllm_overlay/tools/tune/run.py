"""The tuning loop: per shape and batch size, time vLLM's own choice, then every candidate config,
keep the fastest, re-time it against vLLM's choice in alternating rounds (the fastest of many single
timings is biased low: the search alone overstates the gain), record it and rewrite the config file;
stop cleanly at the time limit.

Everything that needs a GPU comes in through ``Backend`` (``cuda.py`` builds the real one from
vLLM's fused-MoE kernel), so the loop, the resume and the files are tested on a CPU with a fake.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_overlay.tools.output import Out
from vllm_overlay.tools.tune import space
from vllm_overlay.tools.progress import Ticker
from vllm_overlay.tools.tune.space import Shape
from vllm_overlay.tools.tune.state import TuneState, atomic_write_json

DONE, TIME_LIMIT = 0, 3  # exit codes: every batch size tuned / stopped by --time-limit (rerun resumes)


@dataclass
class Backend:
    """The GPU side. ``bench(shape, batch, config)`` returns microseconds of one fused-MoE call
    (both GEMMs) and raises for a config that cannot run; ``vllm_choice(shape, batch)`` is the
    config vLLM uses today without a tuned file (its shipped file or its default heuristic)."""

    device: str  # as vLLM writes it in config file names
    bench: Callable[[Shape, int, dict[str, int]], float]
    vllm_choice: Callable[[Shape, int], dict[str, int]]
    file_name: Callable[[Shape], str]
    smem_bytes: int | None = None
    versions: dict[str, str] = field(default_factory=dict)  # vllm, triton, torch
    vllm_file: Callable[[Shape], str | None] = lambda shape: None  # vLLM's own file for this shape, if any


@dataclass
class Options:
    shapes: list[Shape]
    batch_sizes: list[int]
    out_dir: str
    search: str = "quick"
    time_limit: float | None = None
    fresh: bool = False
    confirm: int = 5  # alternating re-timing rounds of vLLM's config and the winner (0: none)


@dataclass
class Row:
    shape: str
    batch: int
    before_us: float
    after_us: float
    tried: int
    resumed: bool
    confirm: dict[str, Any] | None = None  # the re-timing, when there was one (see _confirm)

    def speedup(self) -> float:
        return self.before_us / self.after_us if self.after_us > 0 else math.nan

    def retimed(self) -> str:
        c = self.confirm
        if not c:
            return "-"
        if c["default_median"] is None or c["tuned_median"] is None:
            return f"{c['rounds']} rounds; {c['verdict']}"
        d, t = c["default_us"], c["tuned_us"]
        return (f"{c['rounds']} rounds: vLLM's {min(d):.1f}-{max(d):.1f}, tuned {min(t):.1f}-{max(t):.1f} us; "
                f"{c['verdict']}")


def row(shape: str, batch: int, rec: dict[str, Any], resumed: bool) -> Row:
    """One table row from a state record: the re-timed medians where the winner was re-timed (the
    search's single timings otherwise)."""
    c = rec.get("confirm")
    search_before = float(rec["default_us"] or math.nan)
    if c and c["kept"] == "vllm":  # the file holds vLLM's config: no change at this size
        before = float(c["default_median"]) if c["default_median"] is not None else search_before
        after = before
    elif c and c["default_median"] is not None and c["tuned_median"] is not None:
        before, after = float(c["default_median"]), float(c["tuned_median"])
    else:  # no re-timing, or vLLM's config failed in it: the search's figures
        before, after = search_before, float(rec["us"])
    return Row(shape, batch, before, after, int(rec["tried"]), resumed, c)


def _confirm(backend: Backend, shape: Shape, batch: int, default_cfg: dict[str, int], tuned_cfg: dict[str, int],
             rounds: int) -> dict[str, Any]:
    """Times vLLM's config and the search's winner alternately, ``rounds`` times each, on the same
    inputs: the winner is kept only if its median is lower. ``verdict`` says whether the two ranges
    are apart (every tuned timing below every vLLM timing) or overlap."""
    d: list[float] = []
    t: list[float] = []
    for _ in range(rounds):
        d.append(_bench(backend, shape, batch, default_cfg))
        t.append(_bench(backend, shape, batch, tuned_cfg))
    d_ran, t_ran = all(map(math.isfinite, d)), all(map(math.isfinite, t))
    if not (d_ran and t_ran):  # a config that ran once and then failed is not trusted
        kept = "tuned" if t_ran else "vllm"
        verdict = "a re-timing failed to run: keeps " + ("the tuned config" if kept == "tuned" else "vLLM's config")
    else:
        kept = "tuned" if statistics.median(t) < statistics.median(d) else "vllm"
        if kept == "vllm":
            verdict = "not faster on re-timing: keeps vLLM's config"
        elif max(t) < min(d):
            verdict = "faster beyond the spread"
        else:
            verdict = "faster by the median, within the spread"
    us = lambda xs: [round(x, 3) if math.isfinite(x) else None for x in xs]  # noqa: E731 - None: failed to run
    return {"rounds": rounds, "default_us": us(d), "tuned_us": us(t),
            "default_median": round(statistics.median(d), 3) if d_ran else None,
            "tuned_median": round(statistics.median(t), 3) if t_ran else None, "kept": kept, "verdict": verdict}


def _bench(backend: Backend, shape: Shape, batch: int, cfg: dict[str, int]) -> float:
    try:
        t = float(backend.bench(shape, batch, cfg))
    except Exception:  # noqa: BLE001 - a config that cannot launch (e.g. out of resources) is skipped
        return math.inf
    return t if t > 0 and math.isfinite(t) else math.inf


def execute(opts: Options, backend: Backend, out: Out | None = None,
            clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    out = out or Out()
    t0 = clock()
    deadline = t0 + opts.time_limit if opts.time_limit else math.inf
    plans = []
    for shape in opts.shapes:
        name = backend.file_name(shape)
        meta = {"device": backend.device, "shape": shape.label(), "hidden": shape.hidden, "topk": shape.topk,
                "search": opts.search, "vllm": backend.versions.get("vllm"), "triton": backend.versions.get("triton")}
        state_path = os.path.join(opts.out_dir, "tune-state", name.removesuffix(".json") + ".state.json")
        state, how = TuneState.load_or_new(state_path, meta, opts.fresh)
        out.line(f"{shape.label()} on {backend.device}: {how}")
        theirs = backend.vllm_file(shape)
        if theirs:
            out.line(f"note: vLLM ships its own {theirs}; the moe-configs patch leaves vLLM's file in charge, so set "
                     f"VLLM_TUNED_CONFIG_FOLDER={opts.out_dir} to serve with the tuned one", "warning")
        todo = [b for b in opts.batch_sizes if not state.done(b)]
        cands = {b: space.candidates(shape, b, opts.search, backend.smem_bytes) for b in todo}
        plans.append((shape, name, state, todo, cands))
    total = sum(len(c) + 1 for *_, cands in plans for c in cands.values())
    out.line(f"{total} kernel timings planned ({opts.search} search) over {len(opts.shapes)} shape(s) x "
             f"{len(opts.batch_sizes)} batch sizes" + (f"; time limit {opts.time_limit:g} s" if opts.time_limit else ""))

    stopped: str | None = None
    written: list[str] = []
    with Ticker(out, total) as tick:
        for shape, name, state, todo, cands in plans:
            for batch in todo:
                if clock() >= deadline:
                    stopped = f"before {shape.label()} batch {batch}"
                    break
                t_batch = clock()
                before_cfg = backend.vllm_choice(shape, batch)
                before = _bench(backend, shape, batch, before_cfg)
                tick.advance()
                best_cfg, best = dict(before_cfg), before
                seen = {space.key(before_cfg)}
                tried = 1
                for cfg in cands[batch]:
                    if clock() >= deadline:
                        stopped = f"during {shape.label()} batch {batch} (its partial search is not recorded)"
                        break
                    tick.advance()
                    if space.key(cfg) in seen:
                        continue
                    seen.add(space.key(cfg))
                    t = _bench(backend, shape, batch, cfg)
                    tried += 1
                    if t < best:
                        best_cfg, best = cfg, t
                if stopped:
                    break
                if not math.isfinite(best):
                    tick.note(f"{shape.label()} batch {batch}: no config ran (not even vLLM's own); not recorded")
                    continue
                rec: dict[str, Any] = {"config": best_cfg, "us": round(best, 3),
                                       "default_us": round(before, 3) if math.isfinite(before) else None,
                                       "default_config": before_cfg, "tried": tried}
                if opts.confirm and math.isfinite(before) and space.key(best_cfg) != space.key(before_cfg):
                    # runs to its end past the time limit: 2 x confirm timings of two compiled configs
                    rec["confirm"] = _confirm(backend, shape, batch, before_cfg, best_cfg, opts.confirm)
                    if rec["confirm"]["kept"] == "vllm":
                        rec["config"] = dict(before_cfg)
                rec["seconds"] = round(clock() - t_batch, 1)
                rec["utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                state.record(batch, rec)
                path = _write_config(opts, backend, shape, name, state)
                if path not in written:
                    written.append(path)
                gain = f"{before / best:.2f} x" if math.isfinite(before) else "vLLM's own config failed to run"
                c = rec.get("confirm")
                again = ""
                if c and c["default_median"] is not None and c["tuned_median"] is not None:
                    again = (f"; re-timed {c['rounds']} rounds alternately: vLLM's {c['default_median']:.1f} us, "
                             f"tuned {c['tuned_median']:.1f} us ({c['default_median'] / c['tuned_median']:.2f} x), "
                             f"{c['verdict']}")
                elif c:
                    again = f"; re-timed: {c['verdict']}"
                tick.note(f"{shape.label()} batch {batch}: vLLM's config {before:.1f} us -> tuned {best:.1f} us "
                          f"({gain}; {tried} configs timed){again}")
            if stopped:
                break

    rows = [row(shape.label(), b, rec, b not in todo)
            for shape, _, state, todo, _ in plans for b, rec in sorted(state.batches.items())]
    out.table("fused-MoE kernel time per call, vLLM's config (before) vs the config kept (after); medians of the "
              "re-timing where there was one",
              ("shape", "batch", "before us", "after us", "speedup", "re-timed", "configs timed"),
              [[r.shape, str(r.batch), f"{r.before_us:.1f}", f"{r.after_us:.1f}", f"{r.speedup():.2f} x",
                r.retimed(), f"{r.tried}" + (" (earlier run)" if r.resumed else "")] for r in rows], ids=(0,))
    for shape, name, state, _, _ in plans:
        path = os.path.join(opts.out_dir, name)
        done = sum(1 for b in opts.batch_sizes if state.done(b))
        if os.path.exists(path):
            rest = "" if done == len(opts.batch_sizes) else "; the others hold vLLM's default for that size"
            held = file_batch_sizes(opts.batch_sizes)
            tuned = sum(1 for b in held if state.done(b))
            if tuned < len(held):
                rest += (f"; the file holds {len(held)} batch sizes, {tuned} tuned (in this run or an earlier one), "
                         "the others vLLM's own config for that size")
            out.line(f"{path}: {done} of {len(opts.batch_sizes)} batch sizes tuned{rest}")
    from vllm_overlay.patches.moe_configs import user_dir

    if os.path.abspath(opts.out_dir) != os.path.abspath(user_dir()):
        out.line(f"the moe-configs patch reads {user_dir()}: set VLLM_OVERLAY_MOE_CONFIG_DIR={opts.out_dir} "
                 "for vLLM to use these files", "warning")
    if stopped:
        out.line(f"time limit reached {stopped}; run the same command again to resume", "warning")
    return {"exit_code": TIME_LIMIT if stopped else DONE, "written": written, "stopped": stopped,
            "rows": [r.__dict__ for r in rows], "elapsed_s": clock() - t0}


def file_batch_sizes(batch_sizes: list[int]) -> list[int]:
    """The batch sizes a written config file holds: the ones asked for plus vLLM's grid
    (space.DEFAULT_BATCH_SIZES). vLLM runs every forward with the config of the nearest batch size in
    the file, so a file of decode sizes alone (1-128) would run an 8192-token prefill with the tile
    tuned for 128 tokens; with the grid there, a size not tuned holds vLLM's own config for it."""
    return sorted(set(batch_sizes) | set(space.DEFAULT_BATCH_SIZES))


def _write_config(opts: Options, backend: Backend, shape: Shape, name: str, state: TuneState) -> str:
    path = os.path.join(opts.out_dir, name)
    data = state.vllm_config(file_batch_sizes(opts.batch_sizes), lambda b: backend.vllm_choice(shape, b),
                             backend.versions.get("triton"))
    atomic_write_json(path, data)
    return path
