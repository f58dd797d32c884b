"""`vllm-overlay demo`: boot the embedded tiny hybrid model, run a short band stress, report."""

from __future__ import annotations

import argparse

from rich.console import Console

from vllm_overlay.cli.stress import add_engine_args, engine_args


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="tiny hybrid model + band traffic + report (the README's first command)")
    p.add_argument("--model", metavar="DIR", default=None, help="your own model directory instead")
    p.add_argument("--out", default="demo-out", metavar="DIR")
    p.add_argument("--min-band-forwards", type=int, default=10, metavar="N")
    p.add_argument("--compile", action="store_true",
                   help="on CPU: use vLLM's torch.compile path (slower first boot) instead of eager")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from vllm_overlay.cli.report import load, print_reports
    from vllm_overlay.models import tiny_hybrid_dir
    from vllm_overlay.stress.run import Options, execute
    from vllm_overlay.versions import installed_vllm

    console = Console()
    inst = installed_vllm()
    if inst is None:
        console.print("[red]vLLM is not installed[/]: run the README's setup command first")
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
    console.rule(f"vllm-overlay demo on {inst.distribution} {inst.version} ({inst.platform})")
    console.print(f"model: {model}")
    result = execute(Options(model=model, band=(mnbt // 2, mnbt), min_band_forwards=args.min_band_forwards,
                             out=args.out, engine_args=eargs), console)
    if result.get("report_dir"):
        console.rule("overlay reports (one per vLLM process)")
        print_reports(console, load(result["report_dir"]))
    console.rule(f"verdict: {result['verdict']}")
    console.print(result.get("why", ""))
    if "png" in result:
        console.print(f"histogram: {result['png']}\nresult:    {result['json']}")
    return int(result["exit_code"])
