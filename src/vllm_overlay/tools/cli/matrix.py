"""`vllm-overlay matrix`: what every patch does on every vLLM release of the matrix, and why."""

from __future__ import annotations

import argparse

from vllm_overlay.tools import matrix


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("matrix", help="the support matrix: every release x every patch, with reasons")
    p.add_argument("--markdown", action="store_true", help="print the Markdown table of docs/support.md instead of plain lines")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.markdown:
        print(matrix.markdown(), end="")
    else:
        for line in matrix.plain_lines():
            print(line)
    return 0
