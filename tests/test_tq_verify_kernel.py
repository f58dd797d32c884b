"""The verify kernel under Triton's interpreter, in a process of its own.

vLLM's CPU build replaces the `triton` module with a placeholder once vLLM is imported (it has no
CPU backend), which other tests in this session do; so the kernel checks in
tests/interpreted/check_tq_verify_kernel.py run in a fresh interpreter where `triton` is the real
package and TRITON_INTERPRET=1 runs the Triton program on the CPU."""

from __future__ import annotations


def test_verify_kernel_under_the_interpreter(run_interpreted) -> None:
    run_interpreted("check_tq_verify_kernel.py")
