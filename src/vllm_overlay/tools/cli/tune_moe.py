"""`vllm-overlay tune-moe`: tune vLLM's fused-MoE Triton configs for the hybrid MoE shapes on this GPU.

Exit codes: 0 every batch size tuned, 2 bad usage or no CUDA GPU (one line saying which), 3 stopped
by --time-limit (the same command resumes).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from vllm_overlay.errors import OverlayError
from vllm_overlay.tools.tune import space

BAD_USAGE, NO_CUDA = 2, 2
MAX_BATCH = 65536


class TuneUsageError(OverlayError, ValueError):
    """A tune-moe argument is outside what it accepts."""


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "tune-moe", help="tune fused-MoE kernel configs for the hybrid MoE shapes on this GPU",
        description="Times vLLM's fused-MoE kernel with each candidate Triton config at each batch size, keeps "
                    "the fastest if re-timing against vLLM's own config confirms it (--confirm), and writes vLLM's "
                    "config file where the moe-configs patch reads it. Exit codes: "
                    "0 all tuned, 2 bad usage or no CUDA GPU, 3 stopped by --time-limit (rerun to resume).")
    p.add_argument("--experts", default=str(space.DEFAULT_EXPERTS), metavar="E", help="number of experts (default 256)")
    p.add_argument("--intermediate", default=",".join(map(str, space.DEFAULT_INTERMEDIATE)), metavar="N[,N...]",
                   help="N of vLLM's file name: moe_intermediate_size / tensor parallel size (default 512,256: "
                        "Qwen3.6-35B-A3B at one GPU and at tensor parallel 2)")
    p.add_argument("--hidden", default=str(space.DEFAULT_HIDDEN), metavar="K", help="hidden size (default 2048)")
    p.add_argument("--topk", default=str(space.DEFAULT_TOPK), metavar="K", help="experts per token (default 8)")
    p.add_argument("--dtype", default="bf16", metavar="D[,D...]",
                   help=f"weight dtypes to tune: {', '.join(space.DTYPES)} (default bf16)")
    p.add_argument("--batch-sizes", default=",".join(map(str, space.DEFAULT_BATCH_SIZES)), metavar="B[,B...]",
                   help="tokens per forward to tune (default: decode sizes 1-128, prefill chunks up to 8192)")
    p.add_argument("--search", default="quick", metavar="NAME",
                   help=f"search space: {', '.join(space.SEARCH)} (default quick)")
    p.add_argument("--time-limit", default=None, metavar="SECONDS",
                   help="stop cleanly after this many seconds; finished batch sizes are kept and a rerun resumes")
    p.add_argument("--out-dir", default=None, metavar="DIR",
                   help="where the config files go (default: the folder the moe-configs patch reads, "
                        "VLLM_OVERLAY_MOE_CONFIG_DIR or ~/.cache/vllm-overlay/moe-configs)")
    p.add_argument("--iters", default="5", metavar="N", help="timed CUDA-graph replays per config (default 5)")
    p.add_argument("--confirm", default="5", metavar="N",
                   help="rounds of re-timing vLLM's config and each batch size's winner alternately; the winner is "
                        "kept only if its median is lower (default 5; 0: keep the search's fastest as timed once)")
    p.add_argument("--fresh", action="store_true", help="ignore earlier results for these shapes and start over")
    p.set_defaults(func=run)


def _int(flag: str, text: str, lo: int, hi: int) -> int:
    t = str(text).strip()
    if not t.isdigit() or not lo <= int(t) <= hi:
        raise TuneUsageError(f"{flag} {text!r}: expected an integer in [{lo}, {hi}]")
    return int(t)


def _int_list(flag: str, text: str, lo: int, hi: int, sort: bool = True) -> list[int]:
    parts = [p.strip() for p in str(text).split(",")]
    if not parts or any(not p for p in parts):
        raise TuneUsageError(f"{flag} {text!r}: expected comma-separated integers in [{lo}, {hi}], e.g. 1,2,4")
    bad = [p for p in parts if not p.isdigit() or not lo <= int(p) <= hi]
    if bad:
        raise TuneUsageError(f"{flag} {text!r}: {bad[0]!r} is not an integer in [{lo}, {hi}]")
    values = [int(p) for p in parts]
    dup = sorted({v for v in values if values.count(v) > 1})
    if dup:
        raise TuneUsageError(f"{flag} {text!r}: {dup[0]} is given twice; expected each value once")
    return sorted(values) if sort else values


def options(args: argparse.Namespace) -> Any:
    """Validate every argument (one TuneUsageError naming the flag, the value and what is accepted)."""
    from vllm_overlay.patches.moe_configs import user_dir
    from vllm_overlay.tools.tune.run import Options

    experts = _int("--experts", args.experts, 1, 1024)
    inter = _int_list("--intermediate", args.intermediate, 16, 65536, sort=False)
    hidden = _int("--hidden", args.hidden, 16, 65536)
    topk = _int("--topk", args.topk, 1, experts)
    dtypes = [d.strip() for d in str(args.dtype).split(",")]
    for d in dtypes:
        if d not in space.DTYPES:
            raise TuneUsageError(f"--dtype {args.dtype!r}: {d!r} is not one of {', '.join(space.DTYPES)}")
    if len(set(dtypes)) != len(dtypes):
        raise TuneUsageError(f"--dtype {args.dtype!r}: a dtype is given twice; expected each once")
    batches = _int_list("--batch-sizes", args.batch_sizes, 1, MAX_BATCH)
    if args.search not in space.SEARCH:
        raise TuneUsageError(f"--search {args.search!r}: expected one of {', '.join(space.SEARCH)}")
    limit = None
    if args.time_limit is not None:
        try:
            limit = float(args.time_limit)
        except ValueError:
            limit = -1.0
        if not limit > 0 or limit != limit or limit == float("inf"):
            raise TuneUsageError(f"--time-limit {args.time_limit!r}: expected seconds > 0, e.g. 3600")
    _int("--iters", args.iters, 1, 1000)
    confirm = _int("--confirm", args.confirm, 0, 100)
    out_dir = os.path.abspath(os.path.expanduser(args.out_dir)) if args.out_dir else user_dir()
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise TuneUsageError(f"--out-dir {out_dir!r}: exists and is not a directory; expected a directory path")
    probe = out_dir
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.access(probe, os.W_OK):
        raise TuneUsageError(f"--out-dir {out_dir!r}: {probe!r} is not writable; expected a directory you can write")
    shapes = [space.Shape(experts, n, hidden, topk, d) for d in dtypes for n in inter]
    return Options(shapes=shapes, batch_sizes=batches, out_dir=out_dir, search=args.search, time_limit=limit,
                   fresh=bool(args.fresh), confirm=confirm)


def run(args: argparse.Namespace, backend_factory: Callable[[], Any] | None = None) -> int:
    """``backend_factory``: the GPU side (tests pass a fake; default: vLLM's kernel on CUDA)."""
    from vllm_overlay.tools.output import Out
    from vllm_overlay.tools.tune import run as tunerun

    try:
        opts = options(args)
    except TuneUsageError as exc:
        print(f"vllm-overlay tune-moe: bad usage: {exc}", file=sys.stderr)
        return BAD_USAGE
    if backend_factory is None:
        from vllm_overlay.tools.tune import cuda

        problem = cuda.cuda_problem()
        if problem:
            print(f"vllm-overlay tune-moe: tune-moe needs a CUDA GPU: {problem}", file=sys.stderr)
            return NO_CUDA
        old_gpu = cuda.fp8_problem() if any(s.dtype == "fp8_w8a8" for s in opts.shapes) else None
        if old_gpu:
            print(f"vllm-overlay tune-moe: bad usage: --dtype {args.dtype!r}: fp8_w8a8 needs compute capability "
                  f">= 8.9 and {old_gpu}; tune bf16 on it", file=sys.stderr)
            return BAD_USAGE
        iters = int(args.iters)
        backend_factory = lambda: cuda.backend(iters=iters)  # noqa: E731
    os.makedirs(opts.out_dir, exist_ok=True)
    result = tunerun.execute(opts, backend_factory(), Out())
    return int(result["exit_code"])
