"""`vllm-overlay stress`: force single forwards into a band and prove it from telemetry."""

from __future__ import annotations

import argparse
import math
import os

from vllm_overlay.tools.stress.plan import UsageError


def band(text: str) -> tuple[int, int]:
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"--band {text!r}: expected LO,HI (two integers, LO < HI)")
    return int(parts[0]), int(parts[1])


def positive(flag: str):  # type: ignore[no-untyped-def]
    def parse(text: str) -> int:
        if not text.strip().isascii() or not text.strip().isdigit() or int(text) < 1:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: expected an integer >= 1")
        return int(text)

    return parse


def fraction(flag: str):  # type: ignore[no-untyped-def]
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not 0 < value <= 1:  # nan fails too
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: expected a number in (0, 1]")
        return value

    return parse


def seconds(flag: str):  # type: ignore[no-untyped-def]
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: expected a finite number of seconds > 0")
        return value

    return parse


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (offline mode; spelled as `vllm serve` spells them)")
    g.add_argument("--max-num-batched-tokens", type=positive("--max-num-batched-tokens"), default=None)
    g.add_argument("--max-model-len", type=positive("--max-model-len"), default=None)
    g.add_argument("--max-num-seqs", type=positive("--max-num-seqs"), default=None)
    g.add_argument("--kv-cache-dtype", default=None)
    g.add_argument("--tensor-parallel-size", type=positive("--tensor-parallel-size"), default=None,
                   help="worker processes (GPUs); telemetry counts each forward once, at rank 0")
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument("--gpu-memory-utilization", type=fraction("--gpu-memory-utilization"), default=None)
    g.add_argument("--gdn-prefill-backend", default=None,
                   help="vLLM's additional_config gdn_prefill_backend (use 'triton' on Hopper without FlashInfer)")


def engine_args(args: argparse.Namespace) -> dict[str, object]:
    out: dict[str, object] = {}
    for key in ("max_num_batched_tokens", "max_model_len", "max_num_seqs", "kv_cache_dtype",
                "gpu_memory_utilization", "tensor_parallel_size"):
        if getattr(args, key) is not None:
            out[key] = getattr(args, key)
    if args.enforce_eager:
        out["enforce_eager"] = True
    if args.gdn_prefill_backend:
        out["additional_config"] = {"gdn_prefill_backend": args.gdn_prefill_backend}
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("stress", help="force forwards into (LO, HI] and prove it from telemetry",
                       description="Exit codes: 0 passed, 1 failed (a request or the engine failed), "
                                   "2 bad usage (before any traffic), 3 did not test (band not reached), "
                                   "4 unreachable (server mode: nothing answers at --url, it is not a vLLM "
                                   "server, it does not answer completely within 60 s before traffic, or it "
                                   "stopped answering or went away during the run).")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--model", metavar="DIR", help="offline: boot an in-process engine on this model")
    target.add_argument("--url", metavar="URL", help="server: a running `vllm serve` with the overlay")
    p.add_argument("--allow-remote", action="store_true", help="allow a --url that is not loopback")
    p.add_argument("--band", type=band, default=None, metavar="LO,HI",
                   help="default: (profile cap, or a budget below max_num_batched_tokens, or half of it; "
                        "max_num_batched_tokens]")
    p.add_argument("--min-band-forwards", type=int, default=10, metavar="N")
    p.add_argument("--requests", type=int, default=None, metavar="N", help="band prefill requests to send")
    p.add_argument("--duration", type=seconds("--duration"), default=None, metavar="SECONDS", help="stop sending after this many seconds of timed waves (server mode: the warm-up wave before the "
                        "clock and the timed waves each end within SECONDS + 30 s, else exit 4; decode streams "
                        "then get 30 s more)")
    p.add_argument("--out", default="stress-out", metavar="DIR", help="where stress.json and the PNG go")
    p.add_argument("--report-dir", default=None, metavar="DIR",
                   help="server mode: the server's VLLM_OVERLAY_REPORT_DIR (default: this shell's)")
    p.add_argument("--server-id", default=None, metavar="ID",
                   help="server mode: the server's VLLM_OVERLAY_SERVER_ID; only reports carrying it are counted "
                        "(default: the id the server's /metrics names)")
    p.add_argument("--telemetry", choices=("auto", "reports", "metrics"), default="auto",
                   help="server mode: where the verdict's forward counts come from: the server's report "
                        "files, or its /metrics (no shared directory needed; the band's edges must be "
                        "bucket edges). auto: the reports with --report-dir, else /metrics when it has "
                        "vllm_overlay_ series, else this shell's VLLM_OVERLAY_REPORT_DIR")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="server mode: the API key the server was started with (vLLM's --api-key); default: "
                        "VLLM_API_KEY, as vLLM reads it. It is sent, never written to stress.json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--allow-partial-band", action="store_true",
                   help="PASSED even without a forward in the band's top quarter (the verdict names it a "
                        "partial band); without it such a run is DID NOT TEST")
    add_engine_args(p)
    p.set_defaults(func=run)


def options(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from vllm_overlay.tools.stress.run import Options

    return Options(model=args.model, url=args.url, allow_remote=args.allow_remote, band=args.band,
                   min_band_forwards=args.min_band_forwards, requests=args.requests,
                   duration=args.duration, out=args.out, report_dir=args.report_dir, seed=args.seed,
                   server_id=args.server_id,
                   telemetry=args.telemetry, allow_partial_band=args.allow_partial_band,
                   api_key=args.api_key or os.environ.get("VLLM_API_KEY") or None,
                   engine_args=engine_args(args))


def run(args: argparse.Namespace) -> int:
    from vllm_overlay.tools.stress.run import execute

    try:
        result = execute(options(args))
    except UsageError as exc:
        print(f"vllm-overlay stress: bad usage: {exc}")
        return 2
    return int(result["exit_code"])
