"""`vllm-overlay` entry point: plan, matrix, verify, doctor, report, stress, demo, tune-moe, tune-gemv,
serve."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap

from vllm_overlay.errors import OverlayError


class _Formatter(argparse.HelpFormatter):
    """argparse's formatter, wrapping at spaces only: an option name such as --time-limit or a value
    such as qwen36-35b-a3b is never split across two lines of --help."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        text = self._whitespace_matcher.sub(" ", text).strip()  # type: ignore[attr-defined]
        return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False)

    def add_argument(self, action: argparse.Action) -> None:
        """argparse measures a command's name at its parent's indent, not at the deeper one it prints it
        at, so the longest command name (tune-gemv) went to a line of its own: counted here at its own."""
        super().add_argument(action)
        subactions = getattr(action, "_get_subactions", None)
        if action.help is not argparse.SUPPRESS and subactions is not None:
            longest = max((len(self._format_action_invocation(s)) for s in subactions()), default=0)
            self._action_max_length = max(self._action_max_length,  # type: ignore[attr-defined]
                                          longest + self._current_indent + self._indent_increment)  # type: ignore[attr-defined]

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        text = self._whitespace_matcher.sub(" ", text).strip()  # type: ignore[attr-defined]
        return textwrap.fill(text, width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False,
                             break_long_words=False)


def build_parser() -> argparse.ArgumentParser:
    from vllm_overlay.tools.cli import demo, doctor, matrix, plan, report, serve, stress, tune_gemv, tune_moe, verify

    parser = argparse.ArgumentParser(
        prog="vllm-overlay",
        description="Declared, reversible in-memory patches for vLLM hybrid (GDN) models.",
        formatter_class=_Formatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for mod in (plan, matrix, verify, doctor, report, stress, demo, tune_moe, tune_gemv, serve):
        mod.add_parser(sub)
    for p in sub.choices.values():
        if p.formatter_class is argparse.HelpFormatter:  # a command's own formatter (raw text, say) stays
            p.formatter_class = _Formatter
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # every argument after `serve` is vLLM's, --help included
        from vllm_overlay.tools.cli import serve

        return serve.run(argparse.Namespace(args=argv[1:]))
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
