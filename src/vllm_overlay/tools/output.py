"""Output that reads right in a terminal, a pipe, a log and CI.

On a terminal wide enough, a table is a rich table whose identifier columns never wrap. Anywhere
else (stdout piped or redirected, CI logs, a terminal too narrow for the identifiers) the same
table becomes plain lines, one per row: ``ID: column=value; column=value``. No identifier
(setting name, patch id, module:qualname, path) is ever broken across lines, and no markup or
colour reaches a file.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TextIO

from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

STYLES = {"error": "red", "warning": "yellow", "info": "cyan", "ok": "green", "dim": "dim"}


class Out:
    """One command's output. ``plain`` is True when stdout is not a terminal."""

    def __init__(self, file: TextIO | None = None, force_plain: bool | None = None) -> None:
        self.file = file or sys.stdout
        self.console = Console(file=self.file, highlight=False, soft_wrap=True)
        self.plain = (not self.console.is_terminal) if force_plain is None else force_plain

    def line(self, text: str = "", style: str | None = None) -> None:
        """One line, never wrapped; ``style`` is a key of STYLES (colour on a terminal only)."""
        if self.plain or not style:
            print(text, file=self.file, flush=True)
        else:
            self.console.print(f"[{STYLES.get(style, style)}]{escape(text)}[/]", soft_wrap=True)

    def heading(self, text: str) -> None:
        if self.plain:
            print(f"== {text} ==", file=self.file, flush=True)
        else:
            self.console.rule(escape(text))

    def table(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[str]],
              ids: Sequence[int] = (0,), row_styles: Sequence[str | None] | None = None) -> None:
        """``ids``: the columns that hold identifiers (never wrapped, never truncated)."""
        rows = [[("" if c is None else str(c)).replace("\n", ", ") for c in r] for r in rows]
        if not self.plain:
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
