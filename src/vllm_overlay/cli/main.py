"""`vllm-overlay` entry point: plan, matrix, verify, doctor, report, stress, demo."""

from __future__ import annotations

import argparse
import os
import sys

from vllm_overlay.errors import OverlayError


def build_parser() -> argparse.ArgumentParser:
    from vllm_overlay.cli import demo, doctor, matrix, plan, report, stress, verify

    parser = argparse.ArgumentParser(
        prog="vllm-overlay",
        description="Declared, reversible in-memory patches for vLLM hybrid (GDN) models.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for mod in (plan, matrix, verify, doctor, report, stress, demo):
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except OverlayError as exc:
        print(f"vllm-overlay: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `vllm-overlay matrix | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
