"""Output that reads right in a terminal, a pipe, a log and CI.

On a terminal wide enough, a table is a rich table whose identifier columns never wrap and whose other
columns wrap between words only (each column at least as wide as its longest word). Anywhere else
(stdout piped or redirected, CI logs, a terminal too narrow for that) the same table becomes plain
lines, one per row: ``ID: column=value; column=value``. tests/test_widths.py renders every command
at each width from 60 to 200 columns. No identifier
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
            from rich.table import Table

            t = Table(title=escape(title))
            for i, col in enumerate(columns):
                t.add_column(escape(col), no_wrap=i in ids, overflow="fold")
            for i, r in enumerate(rows):
                style = STYLES.get(row_styles[i] or "", None) if row_styles else None
                t.add_row(*[escape(c) for c in r], style=style)
            if self._fit(t, columns, rows, ids):
                self.console.print(t)
                return
        print(f"{title}:", file=self.file)
        for r in rows:
            rest = "; ".join(f"{col}={val}" for col, val in zip(columns[1:], r[1:]) if val != "")
            print(f"  {r[0]}: {rest}" if rest else f"  {r[0]}", file=self.file)
        self.file.flush()

    def _fit(self, t: Any, columns: Sequence[str], rows: Sequence[Sequence[str]], ids: Sequence[int]) -> bool:
        """Whether the table fits the terminal with no word cut; where it is wider than the terminal, fix
        each column's width so that none is. Left to itself, rich narrows the widest columns below their
        longest word and folds it (a setting name in a reason column, at 100-103 columns), and measures an
        identifier column by its longest word although it never wraps. Each column gets its longest word
        (an identifier column its longest cell), then the columns with the most text still to wrap get
        the rest, one at a time; False where even that is wider than the terminal."""
        from rich.cells import cell_len

        pad = 2 * len(columns)  # rich's default cell padding: one column each side of every cell
        room = self.console.width - t._extra_width - pad  # noqa: SLF001 - rich's border width of this table
        cells = [[str(col), *(r[i] for r in rows)] for i, col in enumerate(columns)]
        longest = [max(cell_len(c) for c in cs) or 1 for cs in cells]
        if sum(longest) <= room:
            return True  # every row fits on one line: rich wraps nothing
        widths = [max((cell_len(c) if i in ids else max((cell_len(w) for w in c.split()), default=0)) for c in cs) or 1
                  for i, cs in enumerate(cells)]
        if sum(widths) > room:
            return False
        for _ in range(room - sum(widths)):
            i = max(range(len(widths)), key=lambda k: longest[k] - widths[k])
            if longest[i] <= widths[i]:
                break
            widths[i] += 1
        for column, width in zip(t.columns, widths):
            column.width = width
        return True


def _isatty(file: TextIO) -> bool:
    try:
        return bool(file.isatty())
    except (AttributeError, ValueError):
        return False
