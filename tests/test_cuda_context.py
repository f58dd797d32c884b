"""bench/cuda_context.py's parts that run without a GPU: nvidia-smi's per-process output and the
arguments (the measurement itself needs a CUDA device and its driver)."""

from __future__ import annotations

import os
import subprocess
import sys

from bench import cuda_context  # the project root is on the tests' path (pyproject.toml)

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def test_parse_apps_keeps_pid_and_mib_rows() -> None:
    text = "1234, 530\n[N/A], [N/A]\n99, 4096\n\n"
    assert cuda_context.parse_apps(text) == {1234: 530, 99: 4096}


def test_bad_procs_is_one_clear_error() -> None:
    r = subprocess.run([sys.executable, os.path.join(BENCH, "cuda_context.py"), "--procs", "0,2"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "--procs '0,2': expected process counts >= 1" in r.stderr
