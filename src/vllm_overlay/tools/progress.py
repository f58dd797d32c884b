"""Progress of long work (stress waves, tuning): a bar on a terminal; in a pipe or a log a plain
line every 10 % or 30 s (also on a terminal without rich, the tools extra)."""

from __future__ import annotations

import time
from typing import Any

from vllm_overlay.tools.output import Out


class Ticker:
    def __init__(self, out: Out, total: int, label: str = "configs timed") -> None:
        self.out, self.total, self.label = out, total, label
        self.done, self.t0 = 0, time.perf_counter()
        self.last = (0, self.t0)
        self.progress: Any = None  # a rich Progress on a terminal
        out.say_no_rich()
        if not out.plain:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), console=out.console, transient=False)
            self.task = self.progress.add_task(label, total=total)

    def __enter__(self) -> Ticker:
        if self.progress is not None:
            self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.progress is not None:
            self.progress.__exit__(*exc)

    def note(self, text: str) -> None:
        if self.progress is not None:
            self.progress.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            self.out.line(text)

    def advance(self, n: int = 1) -> None:
        self(self.done + n, self.total)

    def __call__(self, done: int, total: int) -> None:
        """``done`` of ``total`` finished (the callback the stress runners call)."""
        self.done, self.total = done, total
        if self.progress is not None:
            self.progress.update(self.task, completed=done, total=total)
            return
        now = time.perf_counter()
        if done >= total or done - self.last[0] >= max(1, total // 10) or now - self.last[1] >= 30:
            self.out.line(f"{self.label}: {done}/{total} ({now - self.t0:.1f} s)")
            self.last = (done, now)
