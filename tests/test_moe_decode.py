"""The routed-experts decode kernel (kernels/moe_decode.py) and its launch configs (moe_decode_table.py).

The kernel runs under Triton's interpreter on the CPU (tests/interpreted/check_moe_decode.py); its
speed and its outputs against vLLM's fused_experts are measured on a GPU by bench/moe_decode_kernel.py."""

from __future__ import annotations

import subprocess
import sys

from vllm_overlay.moe_decode_table import MAX_TOKENS, heuristic


def test_kernel_under_the_interpreter(run_interpreted) -> None:  # type: ignore[no-untyped-def]
    run_interpreted("check_moe_decode.py")


def test_heuristic_keeps_two_programs_a_sm_where_it_can() -> None:
    for n, k, rows in [(512, 2048, 8), (2048, 512, 1), (2048, 512, 4), (64, 64, 1), (1, 4096, 1)]:
        cfg = heuristic(n, k, rows, 132)
        assert cfg.block_n * cfg.block_k <= 1024 and 128 <= cfg.block_k <= 1024
        assert cfg.block_n == 1 or rows * -(-n // cfg.block_n) >= 2 * 132, (n, k, rows, cfg)
    assert MAX_TOKENS == 4


def test_bench_names_itself_without_a_gpu() -> None:
    p = subprocess.run([sys.executable, "bench/moe_decode_kernel.py", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert "fused_experts" in p.stdout and "--budget-s" in p.stdout


def test_bench_rehearses_on_the_cpu(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """bench/moe_decode_kernel.py end to end on a small geometry under Triton's interpreter (--device cpu,
    --no-stock: vLLM's CPU build would replace Triton once imported): the file it writes has every
    token count's floor, heuristic and best configs and the errors (the interpreter truncates to bf16, so
only the relative L2 error is bounded here)."""
    import importlib.util
    import json
    import os

    import pytest

    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs Triton (runs the kernel with TRITON_INTERPRET=1 on the CPU)")
    out = tmp_path / "mdk.json"
    p = subprocess.run([sys.executable, "bench/moe_decode_kernel.py", "--device", "cpu", "--no-stock", "--model",
                        "tiny-moe-dense", "--tokens", "1,3", "--layers", "1", "--reps", "1", "--budget-s", "3",
                        "--out", str(out)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["stock_left_out"] == "--no-stock" and res["geometry"]["top_k"] == 2
    assert sorted(res["tokens"]) == ["1", "3"]
    for row in res["tokens"].values():
        assert row["floor_us"] > 0 and row["overlay_best"]["failed"] == []
        assert len(row["overlay_best"]["up"]) == 4 and row["overlay_error"]["rel_l2_vs_exact"] < 0.1
        assert "stock_us" not in row and row["per_step_ms"]["overlay"] > 0
    assert "wrote" in p.stdout


def test_the_patch_is_opt_in_and_declared() -> None:
    import pytest

    from vllm_overlay import settings
    from vllm_overlay.patches import moe_decode as patch

    assert settings.value("VLLM_OVERLAY_MOE_DECODE", {}) is False
    assert settings.value("VLLM_OVERLAY_MOE_DECODE", {"VLLM_OVERLAY_MOE_DECODE": "on"}) is True
    with pytest.raises(Exception) as exc:
        settings.value("VLLM_OVERLAY_MOE_DECODE", {"VLLM_OVERLAY_MOE_DECODE": "2"})
    assert "VLLM_OVERLAY_MOE_DECODE" in str(exc.value) and "1 or 0" in str(exc.value)
    assert not patch.SPEC.default and patch.SPEC.enabled_by == "VLLM_OVERLAY_MOE_DECODE"
    assert patch.SPEC.platforms == ("cuda",) and patch.SPEC.shown_by == ("moe_decode_calls",)
