"""`vllm-overlay demo`: boot the embedded tiny hybrid model, run a short band stress, report."""

from __future__ import annotations

import argparse

from vllm_overlay.tools.output import Out
from vllm_overlay.tools.cli.stress import add_engine_args, engine_args


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="tiny hybrid model + band traffic + report (the README's first command)")
    p.add_argument("--model", metavar="DIR", default=None, help="your own model directory instead")
    p.add_argument("--out", default="demo-out", metavar="DIR",
                   help="where stress.json, the PNG and the reports go (default: demo-out, which holds a "
                        ".gitignore of its own so that git never lists it)")
    p.add_argument("--min-band-forwards", type=int, default=10, metavar="N")
    p.add_argument("--compile", action="store_true",
                   help="on CPU: use vLLM's torch.compile path (slower first boot) instead of eager")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from vllm_overlay.tools.cli.report import load, print_reports
    from vllm_overlay.tools.models import tiny_hybrid_dir
    from vllm_overlay.tools.stress.run import Options, execute
    from vllm_overlay.versions import installed_vllm

    out = Out()
    inst = installed_vllm()
    if inst is None:
        out.line("vLLM is not installed: run the README's setup command first", "error")
        return 2
    eargs = engine_args(args)
    eargs.setdefault("max_num_batched_tokens", 2048)
    eargs.setdefault("max_model_len", 4096)
    eargs.setdefault("max_num_seqs", 32)
    if inst.platform == "cpu":
        eargs.setdefault("gpu_memory_utilization", 0.3)  # the CPU build reads it as a share of RAM
        if not args.compile:
            eargs.setdefault("enforce_eager", True)
    else:
        eargs.setdefault("gpu_memory_utilization", 0.5)
    model = args.model or tiny_hybrid_dir()
    mnbt = int(eargs["max_num_batched_tokens"])
    out.heading(f"vllm-overlay demo on {inst.distribution} {inst.version} ({inst.platform})")
    out.line(f"model: {model}")
    result = execute(Options(model=model, band=(mnbt // 2, mnbt), min_band_forwards=args.min_band_forwards,
                             out=args.out, engine_args=eargs), out)
    if result.get("report_dir"):
        out.heading("overlay reports (one per vLLM process)")
        print_reports(out, load(result["report_dir"]))
    out.heading(f"verdict: {result['verdict']}")
    out.line(result.get("why", ""))
    if "png" in result:
        out.line(f"histogram: {result['png']}")
        out.line(f"result: {result['json']}")
    return int(result["exit_code"])
