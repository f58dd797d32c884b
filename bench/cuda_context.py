"""What a CUDA process holds on the device outside PyTorch's caching allocator (its CUDA context, the
libraries' handles and modules), per process, alone and side by side; no vLLM needed.

  python3 bench/cuda_context.py [--procs 1,4] [--out FILE]

vLLM sizes its KV cache from the caching allocator's peak and the device's free memory; what a
process holds outside the allocator is charged to nobody's budget, and servers side by side on one
GPU each hold their own. For each count in --procs, that many child processes start together and go
through the stages one after another, all children at once:

  init     torch.cuda.init() and a 1 MiB tensor (the CUDA context and the allocator's first block)
  cublas   a 4096 x 4096 bf16 matmul (cuBLAS and cuBLASLt handles; the workspace comes from the
           allocator)
  triton   one Triton kernel compiled and launched (its module loaded), if Triton imports

After each stage every child reports torch.cuda.memory_reserved() and torch.cuda.mem_get_info(), and
the parent reads `nvidia-smi --query-compute-apps=pid,used_memory` (MiB, what the driver charges each
process). Outside the allocator = the driver's figure minus memory_reserved. The device's used memory
before the children start and after they exit is recorded too (it must come back). Writes JSON to
--out (default: $OUT/cuda-context.json, else bench/results/cuda-context.json) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

if __package__:  # imported as bench.cuda_context (the tests)
    from .memory_serve import parse_apps
else:  # run as python3 bench/cuda_context.py: Python puts bench/ first on sys.path
    from memory_serve import parse_apps  # bench/memory_serve.py (stdlib only): the driver's per-process figures

HERE = os.path.dirname(os.path.abspath(__file__))
STAGES = ("init", "cublas", "triton")
MIB = 1 << 20

try:  # at module level: Triton reads a kernel's source and its globals
    import triton
    import triton.language as tl
except ImportError:  # the triton stage records it
    triton = None

if triton is not None:
    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)


def smi(*query: str) -> str:
    try:
        return subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True,
                              text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        sys.exit(f"bench/cuda_context.py: nvidia-smi {' '.join(query)} failed ({e}); it needs an NVIDIA GPU "
                 "and its driver's nvidia-smi on PATH")


def device_used_mib() -> int:
    return int(smi("--query-gpu=memory.used", "-i", "0").split()[0])


def child() -> int:
    """One process: a stage per line read from stdin, one JSON line written after each."""
    import torch

    def report(stage: str, **extra: Any) -> None:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        print(json.dumps({"stage": stage, "pid": os.getpid(), "reserved": torch.cuda.memory_reserved(),
                          "allocated": torch.cuda.memory_allocated(), "free": free, "total": total, **extra}),
              flush=True)

    for line in sys.stdin:
        stage = line.strip()
        if stage == "init":
            torch.cuda.init()
            keep = torch.empty(MIB, dtype=torch.uint8, device="cuda")  # noqa: F841
            report(stage)
        elif stage == "cublas":
            a = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
            (a @ a).sum().item()
            del a
            report(stage)
        elif stage == "triton":
            try:
                if triton is None:
                    raise ImportError("no module named 'triton'")
                x = torch.zeros(4096, device="cuda")
                add_one[(4,)](x, 4096, BLOCK=1024)
                assert float(x.sum()) == 4096.0
                report(stage, triton=triton.__version__)
            except Exception as e:  # recorded, not fatal: the other stages stand
                report(stage, error=f"{type(e).__name__}: {e}"[:300])
        else:
            return 0
    return 0


def run_count(n: int) -> dict[str, Any]:
    before = device_used_mib()
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, bufsize=1) for _ in range(n)]
    stages: dict[str, Any] = {}
    try:
        for stage in STAGES:
            for p in procs:
                assert p.stdin is not None
                p.stdin.write(stage + "\n")
                p.stdin.flush()
            rows = []
            for p in procs:
                assert p.stdout is not None
                line = p.stdout.readline()
                if not line:
                    sys.exit(f"bench/cuda_context.py: a child process (pid {p.pid}) ended in stage {stage!r} "
                             f"with {p.wait()}; its error is above")
                rows.append(json.loads(line))
            time.sleep(1.0)  # the driver's per-process figure settles
            apps = parse_apps(smi("--query-compute-apps=pid,used_memory"))
            for r in rows:
                r["driver_mib"] = apps.get(r["pid"])
                r["outside_mib"] = (None if r["driver_mib"] is None
                                    else round(r["driver_mib"] - r["reserved"] / MIB, 1))
            outside = [r["outside_mib"] for r in rows if r["outside_mib"] is not None]
            stages[stage] = {"children": rows, "device_used_mib": device_used_mib(),
                             "outside_mib_median": statistics.median(outside) if outside else None,
                             "outside_mib_range": [min(outside), max(outside)] if outside else None}
            print(f"{n} process(es), after {stage}: outside the allocator "
                  + (f"{stages[stage]['outside_mib_median']:.0f} MiB per process (median; "
                     f"{min(outside):.0f}-{max(outside):.0f})" if outside else "not reported by the driver")
                  + f", device used {stages[stage]['device_used_mib']} MiB (before: {before})", flush=True)
    finally:
        for p in procs:
            if p.stdin:
                p.stdin.close()
        for p in procs:
            p.wait(timeout=60)
    time.sleep(1.0)
    return {"procs": n, "device_used_mib_before": before, "stages": stages, "device_used_mib_after": device_used_mib()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", default="1,4", help="process counts, comma-separated (default 1,4)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child()
    try:
        counts = [int(x) for x in a.procs.split(",")]
        if not counts or min(counts) < 1:
            raise ValueError
    except ValueError:
        sys.exit(f"bench/cuda_context.py --procs {a.procs!r}: expected process counts >= 1, comma-separated "
                 "(e.g. 1,4)")
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench/cuda_context.py: needs a CUDA device (torch.cuda.is_available() is False here)")
    gpu = smi("--query-gpu=name,memory.total,driver_version", "-i", "0").strip()
    out = a.out or os.path.join(os.environ.get("OUT") or os.path.join(HERE, "results"), "cuda-context.json")
    res: dict[str, Any] = {"script": "bench/cuda_context.py", "argv": sys.argv[1:],
                           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "gpu": gpu,
                           "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
                           "runs": []}
    for n in counts:
        res["runs"].append(run_count(n))
        json.dump(res, open(out, "w"), indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
