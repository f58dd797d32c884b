"""An overlay process without an engine: the second server of the report-directory tests.

Run as ``python tests/overlay_process.py OUT.json [--forward SIZE:COUNT ...] [--engine-config K=V ...]
[--hold SECONDS] [--children N]``. It calls the overlay's register() as every vLLM process does
(settings from the environment), records forwards as a worker's telemetry would, writes its
report and OUT.json (pid, server id, report path); ``--children N`` starts N more such processes
with subprocess first (a launcher that loaded vLLM's plugins), ``--hold`` keeps it alive.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--forward", action="append", default=[], metavar="SIZE:COUNT")
    ap.add_argument("--engine-config", action="append", default=[], metavar="KEY=INT")
    ap.add_argument("--hold", type=float, default=0.0)
    ap.add_argument("--children", type=int, default=0)
    ap.add_argument("--mp-child", action="store_true", help="also start one multiprocessing (spawn) child")
    args = ap.parse_args()
    from vllm_overlay import core, flush
    from vllm_overlay.patches.forward_telemetry import ENGINE_CONFIG
    from vllm_overlay.telemetry import TELEMETRY

    core.register()
    for item in args.forward:
        size, count = (int(x) for x in item.split(":"))
        for _ in range(count):
            TELEMETRY.record(size)
    for item in args.engine_config:
        key, value = item.split("=")
        ENGINE_CONFIG.note(**{key: int(value)})
    path = flush()
    result = {"pid": os.getpid(), "server_id": os.environ.get("VLLM_OVERLAY_SERVER_ID"), "report": path,
              "children": []}
    for i in range(args.children):
        child_out = f"{args.out}.child{i}.json"
        subprocess.run([sys.executable, os.path.abspath(__file__), child_out], check=True, timeout=120)
        with open(child_out) as f:
            result["children"].append(json.load(f))
    if args.mp_child:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=_mp_child, args=(queue,))
        proc.start()
        result["mp_child"] = queue.get(timeout=120)
        proc.join(60)
    with open(args.out, "w") as f:
        json.dump(result, f)
    time.sleep(args.hold)
    return 0


def _mp_child(queue) -> None:  # type: ignore[no-untyped-def]
    from vllm_overlay import core, flush

    core.register()
    queue.put({"pid": os.getpid(), "server_id": os.environ.get("VLLM_OVERLAY_SERVER_ID"), "report": flush()})


if __name__ == "__main__":
    sys.exit(main())
