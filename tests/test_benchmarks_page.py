"""docs/BENCHMARKS.md is generated from bench/results and bench/notes.md, never edited by hand:
the committed page must be exactly what bench/make_table.py renders now."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_benchmarks_page_is_generated_from_the_results() -> None:
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "make_table.py"), "--check"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr + r.stdout
