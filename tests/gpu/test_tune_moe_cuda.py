"""GPU check of `vllm-overlay tune-moe`'s CUDA backend: vLLM's own fused-MoE kernel timed in a CUDA
graph for two batch sizes of E=256,N=512 bf16, the config file written in vLLM's format, and the
moe-configs patch handing that file to vLLM's get_moe_configs on this very device. On the GPU machine:

  export PYTHONPATH=/tmp/site; python -m pytest tests/gpu -q

Skipped without a CUDA device or without vLLM's Triton fused-MoE kernel (about 1-3 minutes: each
candidate config compiles once).
"""

from __future__ import annotations

import json
import math

import pytest

from vllm_overlay.tools.tune import cuda

SKIP = cuda.cuda_problem()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=f"tune-moe needs a CUDA GPU: {SKIP}")


def test_tunes_two_batch_sizes_and_the_patch_uses_the_file(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    import importlib

    from vllm_overlay.tools.output import Out
    from vllm_overlay.patches import moe_configs
    from vllm_overlay.report import STATE
    from vllm_overlay.tools.tune import run as tunerun
    from vllm_overlay.tools.tune.space import Shape

    fm = importlib.import_module("vllm.model_executor.layers.fused_moe.fused_moe")
    backend = cuda.backend(iters=3)
    shape = Shape(256, 512, 2048, 8, "bf16")
    res = tunerun.execute(tunerun.Options(shapes=[shape], batch_sizes=[1, 64], out_dir=str(tmp_path)),
                          backend, Out(force_plain=True))
    assert res["exit_code"] == tunerun.DONE, res
    for row in res["rows"]:
        assert math.isfinite(row["before_us"]) and 0 < row["after_us"] <= row["before_us"] * 1.0001
    (path,) = res["written"]
    data = json.load(open(path))
    tuned = {k for k, v in data.items() if k != "triton_version"}
    assert {"1", "64"} <= tuned and tuned == {str(b) for b in tunerun.file_batch_sizes([1, 64])}

    monkeypatch.setenv("VLLM_OVERLAY_MOE_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_OVERLAY_REPORT_DIR", str(tmp_path / "reports"))
    monkeypatch.delenv("VLLM_TUNED_CONFIG_FOLDER", raising=False)
    STATE.reset()
    moe_configs.reset()
    fm.get_moe_configs.cache_clear()
    import vllm

    from vllm_overlay.mechanisms.install import install
    from vllm_overlay.mechanisms.wrap import installing

    with installing(moe_configs.PATCH_ID):  # as the plugin does: the patch's declared wrapper on this release
        installed = install(moe_configs.SPEC, moe_configs, moe_configs.FUSED_MOE, vllm.__version__.split("+")[0])
    try:
        got = fm.get_moe_configs(256, 512, None)
        if backend.vllm_file(shape):  # vLLM ships its own file for this device: it stays in charge
            assert got is not None and STATE.patches["moe-configs"]["moe_configs"]
        else:
            assert got == {int(k): v for k, v in data.items() if k != "triton_version"}
    finally:
        for inst in reversed(installed):
            inst.undo()
        moe_configs.on_revert()
        fm.get_moe_configs.cache_clear()
        STATE.reset()
