"""What the carry-over's checks cost at start-up: in fresh processes, the installed vLLM presented as a
release newer than the matrix, `core.decide()` with the checks and without them (VLLM_OVERLAY_CARRY_OVER=0),
and the checks' own time as each process records it (the report's carry.seconds).

    .venv/bin/python bench/carry_cost.py [--runs N] [--base RELEASE]

Prints one line per run and the median and maximum. The target: under 0.2 s per process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ONE = r"""
import json, time
t0 = time.perf_counter()
from vllm_overlay import core
core.specs()  # the registry import, paid by every start-up with or without the checks
t1 = time.perf_counter()
ds = core.decide()
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "decide_s": t2 - t1,
                  "checks_s": sum(d.carry.seconds for d in ds if d.carry is not None),
                  "carried": sum(1 for d in ds if d.carry is not None and d.status == "planned")}))
"""


def run(env: dict[str, str]) -> dict[str, float]:
    p = subprocess.run([sys.executable, "-c", ONE], capture_output=True, text=True, env=env, timeout=300)
    if p.returncode != 0:
        raise SystemExit(p.stderr[-2000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--base", default=None, help="the matrix release to carry (default: the newest)")
    args = ap.parse_args()
    from vllm_overlay import versions

    newer = f"0.{int(versions.RELEASES[-1].split('.')[1]) + 10}.0"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_OVERLAY")}
    env["VLLM_OVERLAY_TEST_VLLM_VERSION"] = newer
    if args.base:
        env["VLLM_OVERLAY_TEST_NEWEST_RELEASE"] = args.base
    inst = versions.installed_vllm()
    print(f"installed {inst.distribution if inst else '-'} {inst.version if inst else '-'} presented as {newer}, "
          f"carrying {args.base or versions.RELEASES[-1]}'s rows; {os.cpu_count()} CPUs")
    on, off = [], []
    for i in range(args.runs):
        a = run(env)
        b = run({**env, "VLLM_OVERLAY_CARRY_OVER": "0"})
        on.append(a)
        off.append(b)
        print(f"run {i + 1}: decide {a['decide_s']:.4f} s with the checks ({a['carried']} carried, checks "
              f"{a['checks_s']:.4f} s), {b['decide_s']:.4f} s without", flush=True)
    med = {k: statistics.median(r[k] for r in on) for k in ("decide_s", "checks_s")}
    print(f"median: checks {med['checks_s']:.4f} s, decide {med['decide_s']:.4f} s against "
          f"{statistics.median(r['decide_s'] for r in off):.4f} s without; max checks {max(r['checks_s'] for r in on):.4f} s, "
          f"max added {max(a['decide_s'] - b['decide_s'] for a, b in zip(on, off)):.4f} s (target: under 0.2 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
