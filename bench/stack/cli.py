"""The bug report's serving stack through `vllm serve`, driven in steps (a server started with
`boot` runs on in its own process session until `stop`, so the steps may come from several commands).

The command line: the steps' options and main(); bench/stack.py's docstring says what each step does,
the configurations, and where state and results go.
"""

from __future__ import annotations

import argparse
import os
import types

from .. import serve_measure as sm  # bench/serve_measure.py (stdlib only)
from .. import memory_serve  # bench/memory_serve.py: the `memory` step (stdlib only)
from .server import (
    alive, cmd_boot, cmd_stop, CONFIGS, GEOMETRY, healthy, load_state, ROOT, say, sdir, wait, write_json)
from .collect import collect
from .measure import log_number, served_model, cmd_compare, cmd_continuation, cmd_decode, cmd_logprobs, cmd_steps, cmd_stress
from .series import cmd_series, SERIES
from .merge import cmd_merge


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="step", required=True)
    common_opts = argparse.ArgumentParser(add_help=False)
    common_opts.add_argument("--compact", action="store_true",
                             help="write one file per label, $OUT/LABEL.json, for copying results off a host "
                                  "(as STACK_COMPACT=1)")
    b = sub.add_parser("boot", parents=[common_opts])
    b.add_argument("label")
    b.add_argument("--config", choices=tuple(CONFIGS), default="overlay")
    b.add_argument("--tp", type=int, default=1)
    b.add_argument("--ep", action="store_true", help="--enable-expert-parallel")
    b.add_argument("--kv", default="turboquant_k8v4", help="--kv-cache-dtype (auto: the model's dtype)")
    b.add_argument("--mtp", type=int, default=3, help="speculative tokens of qwen3_next_mtp (0: no MTP)")
    b.add_argument("--spec-method", default="qwen3_next_mtp",
                   help="speculative method when --mtp > 0 (qwen3_next_mtp adds one MTP layer to the config; "
                        "ngram for the CPU build)")
    b.add_argument("--mnbt", type=int, default=8192)
    b.add_argument("--max-model-len", type=int, default=262144)
    b.add_argument("--mem", type=float, default=0.82)
    b.add_argument("--port", type=int, default=8011)
    b.add_argument("--gpu", default=None, help="CUDA_VISIBLE_DEVICES for this server (nvidia-smi's numbering)")
    b.add_argument("--model", default=GEOMETRY, help="bench/models/NAME.json, 'tiny', or a model directory")
    b.add_argument("--max-num-seqs", type=int, default=None, help="--max-num-seqs (default: vLLM's)")
    b.add_argument("--overlay-env", default=None, metavar='"NAME=VALUE ..."',
                   help="overlay settings for this server, added to STACK_OVERLAY_ENV's")
    b.add_argument("--env", default=None, metavar='"NAME=VALUE ..."',
                   help="other variables for this server (the caller's pass through too), e.g. "
                        "VLLM_USE_V2_MODEL_RUNNER=1")
    b.add_argument("--max-capture", type=int, default=None,
                   help="--max-cudagraph-capture-size (default: vLLM's; fewer graphs to capture at boot)")
    b.add_argument("--kv-bytes", type=int, default=None,
                   help="--kv-cache-memory-bytes: a KV cache of this size, no memory profiling of it (default: "
                        "vLLM sizes it from --mem and its profiling)")
    b.add_argument("--additional-config", default='{"gdn_prefill_backend":"triton"}',
                   help="--additional-config JSON ('' leaves it out)")
    b.add_argument("--extra", default="",
                   help="more `vllm serve` arguments, one shell-quoted string (one flag alone: --extra=--flag)")
    b.add_argument("--wait", type=float, default=0, help="seconds to wait for /health (0: return at once)")
    for name in ("wait", "stop", "collect"):
        p = sub.add_parser(name, parents=[common_opts])
        p.add_argument("label")
        if name == "wait":
            p.add_argument("--wait", type=float, default=540)
    s = sub.add_parser("stress", parents=[common_opts])
    s.add_argument("label")
    s.add_argument("--min-band", type=int, default=1000)
    s.add_argument("--duration", type=int, default=300)
    dc = sub.add_parser("decode", parents=[common_opts])
    dc.add_argument("label")
    dc.add_argument("--streams", default="1,16")
    dc.add_argument("--tokens", type=int, default=256)
    dc.add_argument("--reps", type=int, default=3)
    sp = sub.add_parser("steps", parents=[common_opts],
                        help="decode step time per (streams, context), median of --reps rounds")
    sp.add_argument("label")
    sp.add_argument("--streams", default="1,16")
    sp.add_argument("--contexts", default="2048,32768", help="prompt tokens per stream")
    sp.add_argument("--tokens", type=int, default=64, help="decode steps measured per round")
    sp.add_argument("--reps", type=int, default=3, help="measured rounds per point (0: the warm-up only)")
    sp.add_argument("--warmup", type=int, default=1,
                    help="uncounted rounds per stream count at the smallest context, once per boot")
    sp.add_argument("--budget-s", type=float, default=None,
                    help="start no round after this many seconds (default: no limit; <= 0: none at all)")
    sp.add_argument("--out", default="steps", help="result file NAME.json in the label's folder")
    sp.add_argument("--fresh", action="store_true", help="measure points again that NAME.json already has")
    lp = sub.add_parser("logprobs", parents=[common_opts], help="top-k logprobs of the first generated tokens")
    lp.add_argument("label")
    lp.add_argument("--prompts", type=int, default=8)
    lp.add_argument("--lengths", default="", help="prompt lengths, cycled (default: "
                    + ",".join(map(str, sm.LOGPROB_LENGTHS)) + ")")
    lp.add_argument("--top", type=int, default=20)
    lp.add_argument("--max-tokens", type=int, default=4)
    lp.add_argument("--seed", type=int, default=0)
    lp.add_argument("--out", default="logprobs", help="result file NAME.json in the label's folder")
    co = sub.add_parser("continuation", parents=[common_opts],
                        help="a prefill continuing from cached context beside a fresh prompt, against each alone")
    co.add_argument("label")
    co.add_argument("--trials", type=int, default=3)
    co.add_argument("--prefix", type=int, default=1024,
                    help="tokens of the cached prefix (rounded up to whole KV cache blocks of the server)")
    co.add_argument("--cont", type=int, default=512, help="new tokens after the prefix")
    co.add_argument("--fresh", type=int, default=2048, help="tokens of the fresh prompt (>= prefix + cont)")
    co.add_argument("--top", type=int, default=20)
    co.add_argument("--max-tokens", type=int, default=4)
    co.add_argument("--seed", type=int, default=0)
    co.add_argument("--out", default="continuation", help="result file NAME.json in the label's folder")
    memory_serve.add_parser(sub, [common_opts])
    m = sub.add_parser("merge")
    m.add_argument("result")
    m.add_argument("runs", nargs="+", help="NAME=DIR holding a summary.json, or NAME=LABEL.json (compact)")
    m.add_argument("--note", default="", help="date, machine and conditions of the runs")
    se = sub.add_parser("series", parents=[common_opts],
                        help="a named series of configurations: boot, steps, logprobs, stop, one after another")
    se.add_argument("name", choices=tuple(SERIES))
    se.add_argument("--deadline", type=float, default=None,
                    help="return after about this many seconds with exit 10 (NOT DONE); the same command goes "
                         "on (default: run until done)")
    se.add_argument("--labels", default="", help="which labels, in this order (default: the series' own)")
    se.add_argument("--gpus", default="", help="GPUs side by side: labels go round-robin, one queue per entry; "
                    "an entry repeated (0,0,0) runs that many servers side by side on that GPU")
    se.add_argument("--stagger", type=float, default=60,
                    help="servers side by side on one GPU: seconds between their starts, each also waiting until "
                         "the one before has sized its KV cache (default 60)")
    se.add_argument("--fixed-kv", type=int, default=None, metavar="BYTES",
                    help="servers side by side on one GPU: every one but the first gets a KV cache of BYTES "
                         "(--kv-bytes), so none of their sizes depends on another server's allocations")
    se.add_argument("--fixed-kv-mem", type=float, default=None, metavar="FRACTION",
                    help="with --fixed-kv: those servers' --mem (vLLM then only checks that this fraction of the "
                         "GPU is free when each starts; default: the series' or --boot-extra's)")
    se.add_argument("--base-port", type=int, default=8011, help="a label's port: this + its index in the series")
    se.add_argument("--boot-extra", default="", help="more `boot` options for every label (one string)")
    se.add_argument("--steps", default=None, help="`steps` options instead of the series' own (one string)")
    se.add_argument("--logprobs", default=None, help="`logprobs` options instead of the series' own (one string)")
    se.add_argument("--memory", default=None, help="`memory` options instead of the series' own (one string)")
    se.add_argument("--stress", default=None, help="`stress` options instead of the series' own (one string)")
    se.add_argument("--guard-stress", default=None,
                    help="`stress` options for a label expected to stop with CapacityError, should it serve")
    se.add_argument("--expect-runner", default=None,
                    help="the model runner every worker must build (V1, V2; '' checks nothing; default: the "
                         "series' own)")
    se.add_argument("--no-logprobs", action="store_true")
    se.add_argument("--no-warm-up", action="store_true",
                    help="servers side by side on one GPU: no warm-up boots before the profiling windows (by "
                         "default a series with warm groups first boots one label of each group that needs it side "
                         "by side, with a fixed KV cache, to fill the compile caches, when two or more groups do)")
    c = sub.add_parser("compare", help="two logprob runs (PATH.json, DIR/NAME.json or BUNDLE.json#NAME)")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--top", type=int, default=20)
    c.add_argument("--out", default="", help="write the comparison as JSON")
    return ap


def memory_host() -> types.SimpleNamespace:
    """What bench/memory_serve.py's `memory` step uses of the stack: a server's state, wait and collect."""
    return types.SimpleNamespace(ROOT=ROOT, alive=alive, collect=collect, healthy=healthy, load_state=load_state,
                                 log_number=log_number, say=say, sdir=sdir, served_model=served_model, wait=wait,
                                 write_json=write_json)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if getattr(a, "compact", False):
        os.environ["STACK_COMPACT"] = "1"
    if a.step == "merge":
        return cmd_merge(a)
    if a.step == "compare":
        return cmd_compare(a)
    if a.step == "boot":
        return cmd_boot(a)
    if a.step == "wait":
        rc = wait(a.label, a.wait)
        collect(a.label)
        return rc
    if a.step == "stress":
        return cmd_stress(a)
    if a.step == "decode":
        return cmd_decode(a)
    if a.step == "steps":
        return cmd_steps(a)
    if a.step == "logprobs":
        return cmd_logprobs(a)
    if a.step == "continuation":
        return cmd_continuation(a)
    if a.step == "stop":
        return cmd_stop(a)
    if a.step == "memory":
        return memory_serve.cmd_memory(a, memory_host())
    if a.step == "series":
        return cmd_series(a)
    collect(a.label)
    return 0
