"""The verify kernel under Triton's interpreter, in a process of its own.

vLLM's CPU build replaces the `triton` module with a placeholder once vLLM is imported (it has no
CPU backend), which other tests in this session do; so the kernel checks in
tests/interpreted/check_tq_verify_kernel.py run in a fresh interpreter where `triton` is the real
package and TRITON_INTERPRET=1 runs the Triton program on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def test_verify_kernel_under_the_interpreter() -> None:
    try:
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            pytest.skip("needs Triton (runs the kernel with TRITON_INTERPRET=1 on the CPU)")
    except ValueError:
        pytest.skip("triton is present only as vLLM's placeholder in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        os.path.join(HERE, "interpreted", "check_tq_verify_kernel.py")],
                       capture_output=True, text=True, env=env, timeout=900, cwd=os.path.dirname(HERE))
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert " passed" in p.stdout and " failed" not in p.stdout
