"""Output that reads right in a terminal, a pipe, a log and CI.

On a terminal wide enough, a table is a rich table whose identifier columns never wrap. Anywhere
else (stdout piped or redirected, CI logs, a terminal too narrow for the identifiers) the same
table becomes plain lines, one per row: ``ID: column=value; column=value``. No identifier
(setting name, patch id, module:qualname, path) is ever broken across lines, and no markup or
colour reaches a file.

``rich`` comes with the ``tools`` extra (``pip install 'vllm-overlay[tools]'``). Without it every table
is plain lines, as in a pipe, and on a terminal the first table, heading or progress bar says once, on stderr, how
to install it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, TextIO

STYLES = {"error": "red", "warning": "yellow", "info": "cyan", "ok": "green", "dim": "dim"}


NO_RICH = ("plain output: the package rich is not installed (tables and progress bars come with the tools extra: "
           "pip install 'vllm-overlay[tools]')")
_said: list[bool] = [False]  # NO_RICH printed in this process


def have_rich() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


class Out:
    """One command's output. ``plain`` is True when stdout is not a terminal, or rich is not installed
    (``console`` is then None)."""

    def __init__(self, file: TextIO | None = None, force_plain: bool | None = None) -> None:
        self.file = file or sys.stdout
        self.console: Any = None
        self.no_rich = False  # on a terminal without rich: plain lines, and NO_RICH said once
        if have_rich():
            from rich.console import Console

            self.console = Console(file=self.file, highlight=False, soft_wrap=True)
            self.plain = (not self.console.is_terminal) if force_plain is None else force_plain
        else:
            terminal = _isatty(self.file) if force_plain is None else not force_plain
            self.plain, self.no_rich = True, terminal

    def say_no_rich(self) -> None:
        """On a terminal without rich: NO_RICH on stderr, once per process."""
        if self.no_rich and not _said[0]:
            _said[0] = True
            print(NO_RICH, file=sys.stderr, flush=True)

    def line(self, text: str = "", style: str | None = None) -> None:
        """One line, never wrapped; ``style`` is a key of STYLES (colour on a terminal only)."""
        if self.plain or not style:
            print(text, file=self.file, flush=True)
        else:
            from rich.markup import escape

            self.console.print(f"[{STYLES.get(style, style)}]{escape(text)}[/]", soft_wrap=True)

    def heading(self, text: str) -> None:
        self.say_no_rich()
        if self.plain:
            print(f"== {text} ==", file=self.file, flush=True)
        else:
            from rich.markup import escape

            self.console.rule(escape(text))

    def table(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[str]],
              ids: Sequence[int] = (0,), row_styles: Sequence[str | None] | None = None) -> None:
        """``ids``: the columns that hold identifiers (never wrapped, never truncated)."""
        rows = [[("" if c is None else str(c)).replace("\n", ", ") for c in r] for r in rows]
        self.say_no_rich()
        if not self.plain:
            from rich.markup import escape
            from rich.measure import Measurement
            from rich.table import Table

            t = Table(title=escape(title))
            for i, col in enumerate(columns):
                t.add_column(escape(col), no_wrap=i in ids, overflow="fold")
            for i, r in enumerate(rows):
                style = STYLES.get(row_styles[i] or "", None) if row_styles else None
                t.add_row(*[escape(c) for c in r], style=style)
            unbounded = self.console.options.update(max_width=1 << 20)
            if Measurement.get(self.console, unbounded, t).minimum <= self.console.width:
                self.console.print(t)
                return
        print(f"{title}:", file=self.file)
        for r in rows:
            rest = "; ".join(f"{col}={val}" for col, val in zip(columns[1:], r[1:]) if val != "")
            print(f"  {r[0]}: {rest}" if rest else f"  {r[0]}", file=self.file)
        self.file.flush()


def _isatty(file: TextIO) -> bool:
    try:
        return bool(file.isatty())
    except (AttributeError, ValueError):
        return False
