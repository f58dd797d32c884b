"""decode-gemv: its kernel and op (under Triton's interpreter, in a process of their own), its config
table, what it does with the GEMM vLLM chose for a real UnquantizedLinearMethod of the installed
(CPU) build, and the bad inputs of its two bench scripts.

The CUDA path itself (vLLM choosing default_unquantized_gemm) cannot run here: where a test needs it,
vLLM's dispatch is made to return that function, and the test says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_overlay import settings
from vllm_overlay.patches import decode_gemv as patch
from vllm_overlay.report import STATE

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def test_kernel_and_op_under_the_interpreter(run_interpreted) -> None:
    run_interpreted("check_decode_gemv.py")


# ---- the config table -------------------------------------------------------------------------------


def _write(tmp_path, data) -> str:
    path = str(tmp_path / "t.json")
    with open(path, "w") as f:
        f.write(data if isinstance(data, str) else json.dumps(data))
    return path


@pytest.mark.parametrize("data,message", [
    ("{not json", "cannot read a JSON config table"),
    ({"shapes": {}}, 'expected {"devices"'),
    ({"devices": {"NVIDIA H200": [1, 2]}}, "expected an object of \"NxK\" -> config"),
    ({"devices": {"NVIDIA H200": {"2048-4096": [4, 1024, 4, 1]}}}, "key '2048-4096': expected \"NxK\""),
    ({"devices": {"NVIDIA H200": {"2048x4096": [4, 1000, 4, 1]}}}, "the first three powers of two"),
    ({"devices": {"NVIDIA H200": {"2048x4096": [4, 1024, 4]}}}, "expected [BLOCK_N, BLOCK_K, num_warps, num_stages]"),
])
def test_a_bad_table_is_one_clear_error(tmp_path, data, message) -> None:
    path = _write(tmp_path, data)
    with pytest.raises(ValueError) as exc:
        patch.load_table(path, "VLLM_OVERLAY_DECODE_GEMV_CONFIGS")
    assert str(exc.value).startswith(f"VLLM_OVERLAY_DECODE_GEMV_CONFIGS={path}: ")
    assert message in str(exc.value)


def test_user_table_before_shipped_then_heuristic(tmp_path, monkeypatch) -> None:
    path = _write(tmp_path, {"devices": {"NVIDIA H200": {"2048x4096": [8, 512, 8, 3]}}})
    monkeypatch.setenv("VLLM_OVERLAY_DECODE_GEMV_CONFIGS", path)
    patch._TABLES.clear()
    try:
        table, source = patch.table_for("NVIDIA H200")
        assert source == path and table["2048x4096"].as_list() == [8, 512, 8, 3]
        table, source = patch.table_for("Some Other GPU")
        assert source.startswith("heuristic") and not table
        # a user's table that does not name the device is said, with the names it has
        assert any(f"VLLM_OVERLAY_DECODE_GEMV_CONFIGS={path} names the devices 'NVIDIA H200', not this process's "
                   "'Some Other GPU'" in e for e in STATE.events)
    finally:
        patch._TABLES.clear()


def test_a_cublas_entry_keeps_linear_for_that_shape(tmp_path, monkeypatch) -> None:
    import torch

    path = _write(tmp_path, {"devices": {"cpu (Triton interpreter)": {"8x16": "cublas"}}})
    monkeypatch.setenv("VLLM_OVERLAY_DECODE_GEMV_CONFIGS", path)
    patch._TABLES.clear()
    patch._CONFIGS.clear()
    try:
        assert patch.config_for(8, 16, torch.device("cpu")) is None
        assert patch.config_for(8, 32, torch.device("cpu")).as_list() == [1, 32, 4, 1]  # not listed: heuristic
        assert patch.report.patch_entry(patch.PATCH_ID)["configs"]["8x16"]["config"] == "cublas"
    finally:
        patch._TABLES.clear()
        patch._CONFIGS.clear()


def test_the_shipped_table_loads() -> None:
    tables = patch.load_table(patch.SHIPPED, "decode-gemv shipped table")
    assert isinstance(tables, dict)


def test_settings_are_declared() -> None:
    assert settings.value("VLLM_OVERLAY_DECODE_GEMV", {}) == "auto"
    assert settings.value("VLLM_OVERLAY_DECODE_GEMV", {"VLLM_OVERLAY_DECODE_GEMV": "AUTO"}) == "auto"
    assert settings.value("VLLM_OVERLAY_DECODE_GEMV", {"VLLM_OVERLAY_DECODE_GEMV": "1"}) is True
    assert settings.value("VLLM_OVERLAY_DECODE_GEMV", {"VLLM_OVERLAY_DECODE_GEMV": "off"}) is False
    with pytest.raises(Exception) as exc:
        settings.value("VLLM_OVERLAY_DECODE_GEMV", {"VLLM_OVERLAY_DECODE_GEMV": "maybe"})
    assert "VLLM_OVERLAY_DECODE_GEMV" in str(exc.value) and "auto, 1 or 0" in str(exc.value)
    assert settings.value("VLLM_OVERLAY_DECODE_GEMV_CONFIGS", {}) is None
    assert patch.SPEC.disabled_by == "VLLM_OVERLAY_DECODE_GEMV" and patch.SPEC.default
    assert patch.SPEC.changes_traced_code and patch.SPEC.platforms == ("cuda",)


def test_auto_is_on_only_where_a_table_was_measured(tmp_path, monkeypatch) -> None:
    assert patch.shipped_proven() == {"NVIDIA H200": ["0.33.0"]}
    assert patch.auto_refusal("NVIDIA H200", "0.33.0") is None
    why = patch.auto_refusal("NVIDIA H200", "0.27.1")
    assert why.startswith("VLLM_OVERLAY_DECODE_GEMV=auto and no GEMV table was measured for NVIDIA H200 on vLLM 0.27.1")
    assert "the shipped table covers NVIDIA H200 on vLLM 0.33.0" in why and "VLLM_OVERLAY_DECODE_GEMV=1" in why
    assert patch.auto_refusal("NVIDIA A100-SXM4-80GB", "0.33.0")
    path = _write(tmp_path, {"devices": {"NVIDIA A100-SXM4-80GB": {"2048x4096": [4, 1024, 4, 1]}}})
    monkeypatch.setenv("VLLM_OVERLAY_DECODE_GEMV_CONFIGS", path)
    patch._TABLES.clear()  # tables are read once per process and device
    try:
        assert patch.auto_refusal("NVIDIA A100-SXM4-80GB", "0.33.0") is None  # the user's own table covers it
    finally:
        patch._TABLES.clear()


# ---- a real UnquantizedLinearMethod of the installed vLLM ---------------------------------------------


def _method_through_the_wrapper():
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    method = UnquantizedLinearMethod.__new__(UnquantizedLinearMethod)
    patch._init(lambda: UnquantizedLinearMethod.__init__(method), method, (), {})
    return method


def test_stands_aside_loudly_where_vllm_chose_another_gemm(caplog) -> None:
    pytest.importorskip("vllm")
    patch._NOTED.clear()
    before = STATE.counters.get("decode_gemv_stood_aside", 0)
    method = _method_through_the_wrapper()  # the CPU build: cpu_unquantized_gemm
    assert method._gemm_impl is not patch.overlay_gemm
    assert STATE.counters.get("decode_gemv_stood_aside", 0) == before + 1
    assert any("decode-gemv: stands aside: vLLM chose cpu_unquantized_gemm" in e for e in STATE.events)


def test_auto_without_a_cuda_device_stands_aside(monkeypatch) -> None:
    """vLLM's dispatch is made to return default_unquantized_gemm (CUDA's choice): under the default
    VLLM_OVERLAY_DECODE_GEMV=auto, a process without a CUDA device (this one) keeps vLLM's GEMM, loudly."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers import linear, utils

    monkeypatch.delenv("VLLM_OVERLAY_DECODE_GEMV", raising=False)
    monkeypatch.setattr(linear, "dispatch_unquantized_gemm", lambda *a, **k: utils.default_unquantized_gemm)
    patch._NOTED.clear()
    method = _method_through_the_wrapper()
    assert method._gemm_impl is utils.default_unquantized_gemm
    assert any("no GEMV table was measured for no CUDA device" in e for e in STATE.events)


def test_replaces_default_unquantized_gemm(monkeypatch) -> None:
    """vLLM's dispatch is made to return default_unquantized_gemm, what it returns on CUDA (no GPU
    here), and VLLM_OVERLAY_DECODE_GEMV=1: the method then calls the overlay's op, which the op's CPU
    key runs as F.linear for a float32 weight (the GEMV is for bf16/fp16)."""
    pytest.importorskip("vllm")
    import torch
    from vllm.model_executor.layers import linear, utils

    monkeypatch.setenv("VLLM_OVERLAY_DECODE_GEMV", "1")
    monkeypatch.setattr(linear, "dispatch_unquantized_gemm", lambda *a, **k: utils.default_unquantized_gemm)
    before = STATE.counters.get("decode_gemv_methods", 0)
    method = _method_through_the_wrapper()
    assert method._gemm_impl is patch.overlay_gemm
    assert STATE.counters.get("decode_gemv_methods", 0) == before + 1
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(8, 16), requires_grad=False)
    x = torch.randn(3, 16)
    assert torch.equal(method.apply(layer, x), torch.nn.functional.linear(x, layer.weight))


# ---- the bench scripts' bad inputs ------------------------------------------------------------------


def test_microbenchmark_refuses_bad_arguments() -> None:
    script = os.path.join(ROOT, "bench", "decode_gemv_h200.py")
    for args, message in ((["--reps", "0"], "--reps 0: expected an integer >= 1"),
                          (["--model", "nope"], "--model nope: no such file"),
                          (["--budget-s", "0"], "--budget-s 0.0: expected seconds > 0")):
        p = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and message in p.stderr, (args, p.stderr)


def test_microbenchmark_shapes_of_the_geometry() -> None:
    from bench import decode_gemv_h200 as bench  # the project root is on the tests' path (pyproject.toml)
    cfg = json.load(open(os.path.join(ROOT, "bench", "models", "qwen36-35b-a3b-geometry.json")))
    got = [(s["n"], s["k"], s["per_step"]) for s in bench.shapes(cfg)]
    assert got == [(12288, 2048, 30), (64, 2048, 30), (2048, 4096, 40), (9216, 2048, 10), (256, 2048, 40),
                   (1024, 2048, 40), (2048, 512, 40), (1, 2048, 40)]


@pytest.mark.parametrize("env,message", [
    ({"MODEL": "nope"}, "MODEL 'nope': expected a name of bench/models/*.json or tiny"),
    ({"REPS": "0"}, "REPS '0': expected a whole number > 0"),
    ({"MICRO": "2"}, "MICRO '2': expected 0 or 1"),
    ({"STAGGER": "x"}, "STAGGER 'x': expected whole seconds >= 0"),
    ({"GEMV_CONFIGS": "/nonexistent.json"}, "GEMV_CONFIGS '/nonexistent.json': expected an existing config table"),
    ({"GEMV": "yes"}, "GEMV 'yes': expected 0 or 1"),
    ({"TUNE_MOE": "2"}, "TUNE_MOE '2': expected 0 or 1"),
    ({"TUNE_BATCHES": "1,x"}, "TUNE_BATCHES '1,x': expected batch sizes such as 1,16,64"),
    ({"TUNE_LIMIT": "0"}, "TUNE_LIMIT '0': expected whole seconds > 0"),
    ({"MICRO_BUDGET": "x"}, "MICRO_BUDGET 'x': expected whole seconds > 0"),
    ({"BASE": "x"}, "BASE 'x': expected stock or overlay"),
])
def test_ab_script_refuses_bad_settings(tmp_path, env, message) -> None:
    p = subprocess.run(["bash", os.path.join(ROOT, "bench", "decode_gemv_ab.sh"), str(tmp_path / "out")],
                       capture_output=True, text=True, env={**os.environ, **env}, timeout=60)
    assert p.returncode == 2 and message in p.stderr, p.stderr


def test_before_0_29_apply_is_replaced_on_the_instance(monkeypatch) -> None:
    """vLLM < 0.29 has no _gemm_impl: apply() asks dispatch_unquantized_gemm() on every call. A method
    object without _gemm_impl stands for such a release's method (the installed build is 0.32.0), and
    vLLM's dispatch is made to return default_unquantized_gemm (CUDA's choice; no GPU here)."""
    pytest.importorskip("vllm")
    import torch
    from vllm.model_executor.layers import linear, utils

    class OldMethod:
        def apply(self, layer, x, bias=None):
            raise AssertionError("the overlay's apply should run")

    monkeypatch.setenv("VLLM_OVERLAY_DECODE_GEMV", "1")
    monkeypatch.setattr(linear, "dispatch_unquantized_gemm", lambda *a, **k: utils.default_unquantized_gemm)
    method = OldMethod()
    assert patch.adopted(method) and patch.adopted(method)  # decided once, then read back
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(8, 16), requires_grad=False)
    x = torch.randn(2, 16)
    assert torch.equal(method.apply(layer, x), torch.nn.functional.linear(x, layer.weight))
    monkeypatch.setattr(linear, "dispatch_unquantized_gemm", lambda *a, **k: utils.cpu_unquantized_gemm)
    assert not patch.adopted(OldMethod())


def test_auto_keeps_cublas_without_cuda_graphs(monkeypatch) -> None:
    """Under auto, an engine built without CUDA graphs keeps cuBLAS (the GEMV's host-side launch would
    be paid on every call). The engine config is a stand-in with the two fields read (building a real
    one needs a model); vLLM's dispatch is made to return CUDA's choice."""
    pytest.importorskip("vllm")
    import types

    import vllm.config
    from vllm.model_executor.layers import linear, utils

    monkeypatch.delenv("VLLM_OVERLAY_DECODE_GEMV", raising=False)
    monkeypatch.setattr(linear, "dispatch_unquantized_gemm", lambda *a, **k: utils.default_unquantized_gemm)
    for cfg, why in ((types.SimpleNamespace(model_config=types.SimpleNamespace(enforce_eager=True)),
                      "enforce_eager is set"),
                     (types.SimpleNamespace(model_config=types.SimpleNamespace(enforce_eager=False),
                                            compilation_config=types.SimpleNamespace(
                                                cudagraph_mode=types.SimpleNamespace(name="NONE"))),
                      "cudagraph_mode is NONE")):
        monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda cfg=cfg: cfg)
        assert patch.graphs_off() == why
        patch._NOTED.clear()
        method = _method_through_the_wrapper()
        assert method._gemm_impl is utils.default_unquantized_gemm
        assert any(f"VLLM_OVERLAY_DECODE_GEMV=auto and {why}" in e for e in STATE.events)


# ---- vLLM 0.34.0: cuda_unquantized_gemm and vLLM's skinny-GEMM plans ----------------------------------


def _skinny_stand_ins(monkeypatch, plans: set[tuple[int, int]]):  # type: ignore[no-untyped-def]
    """vLLM 0.34.0's CUDA pieces, which the installed 0.32.0 lacks: ``cuda_unquantized_gemm`` (F.linear
    outside a skinny plan) and ``maybe_use_skinny_gemm`` (marks a bf16 layer without bias whose weight
    shape has a plan; ``plans`` stands for its SM 12.1 plan table), set on the real
    vllm.model_executor.layers.utils, and the real linear module's dispatch made to return the former,
    as 0.34.0's does on CUDA."""
    import torch
    from vllm.model_executor.layers import linear, utils

    def cuda_unquantized_gemm(layer, x, weight, bias=None):  # type: ignore[no-untyped-def]
        return torch.nn.functional.linear(x, weight, bias)

    def maybe_use_skinny_gemm(layer):  # type: ignore[no-untyped-def]
        weight = layer.weight
        if weight.ndim != 2:
            return
        if (weight.dtype == torch.bfloat16 and getattr(layer, "bias", None) is None
                and tuple(weight.shape) in plans):
            layer.use_skinny_gemm = True

    monkeypatch.setattr(utils, "cuda_unquantized_gemm", cuda_unquantized_gemm, raising=False)
    monkeypatch.setattr(utils, "maybe_use_skinny_gemm", maybe_use_skinny_gemm, raising=False)
    monkeypatch.setattr(linear, "dispatch_unquantized_gemm", lambda *a, **k: utils.cuda_unquantized_gemm)
    return cuda_unquantized_gemm


def _after_loading_034(method):  # type: ignore[no-untyped-def]
    """vLLM 0.34.0's process_weights_after_loading on CUDA (a stand-in: the installed one is the CPU
    build's): it marks skinny layers only while _gemm_impl is cuda_unquantized_gemm."""
    from vllm.model_executor.layers import utils

    def body(layer):  # type: ignore[no-untyped-def]
        if method._gemm_impl is utils.cuda_unquantized_gemm:
            utils.maybe_use_skinny_gemm(layer)

    return body


def _layer(n: int, k: int, dtype):  # type: ignore[no-untyped-def]
    import torch

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(n, k).to(dtype), requires_grad=False)
    layer.bias = None
    return layer


def test_adopts_cuda_unquantized_gemm_and_remembers_vllms(monkeypatch) -> None:
    """vLLM 0.34.0 on CUDA chooses cuda_unquantized_gemm (stand-in): with VLLM_OVERLAY_DECODE_GEMV=1 a
    real UnquantizedLinearMethod runs the overlay's GEMM, and keeps vLLM's choice for a skinny plan."""
    pytest.importorskip("vllm")
    import torch

    monkeypatch.setenv("VLLM_OVERLAY_DECODE_GEMV", "1")
    cuda_gemm = _skinny_stand_ins(monkeypatch, set())
    before = STATE.counters.get("decode_gemv_methods", 0)
    method = _method_through_the_wrapper()
    assert method._gemm_impl is patch.overlay_gemm
    assert getattr(method, patch.VLLM_GEMM) is cuda_gemm
    assert STATE.counters.get("decode_gemv_methods", 0) == before + 1
    layer = _layer(8, 16, torch.float32)
    x = torch.randn(3, 16)
    assert torch.equal(method.apply(layer, x), torch.nn.functional.linear(x, layer.weight))


def test_a_layer_vllm_plans_a_skinny_gemm_for_gets_vllms_gemm_back(tmp_path, monkeypatch) -> None:
    """After loading, the patch asks vLLM's maybe_use_skinny_gemm (stand-in, one planned shape): the
    planned layer goes back to cuda_unquantized_gemm and is counted; a layer of another shape keeps the
    overlay's GEMM (the table keeps F.linear for that shape, so no kernel is compiled here)."""
    pytest.importorskip("vllm")
    import torch

    monkeypatch.setenv("VLLM_OVERLAY_DECODE_GEMV", "1")
    table = _write(tmp_path, {"devices": {"cpu (Triton interpreter)": {"32x16": "cublas"}}})
    monkeypatch.setenv("VLLM_OVERLAY_DECODE_GEMV_CONFIGS", table)
    monkeypatch.setattr(patch, "_TABLES", {})
    monkeypatch.setattr(patch, "_CONFIGS", {})
    cuda_gemm = _skinny_stand_ins(monkeypatch, {(64, 16)})
    counters = ("decode_gemv_weights_kept_skinny", "decode_gemv_weights_kept_cublas", "decode_gemv_weights_warmed")
    before = {c: STATE.counters.get(c, 0) for c in counters}

    planned, planned_layer = _method_through_the_wrapper(), _layer(64, 16, torch.bfloat16)
    patch._after_loading(_after_loading_034(planned), planned, (planned_layer,), {})
    assert planned_layer.use_skinny_gemm is True
    assert planned._gemm_impl is cuda_gemm and not patch.adopted(planned)

    other, other_layer = _method_through_the_wrapper(), _layer(32, 16, torch.bfloat16)
    patch._after_loading(_after_loading_034(other), other, (other_layer,), {})
    assert not getattr(other_layer, "use_skinny_gemm", False)
    assert other._gemm_impl is patch.overlay_gemm and patch.adopted(other)

    after = {c: STATE.counters.get(c, 0) - before[c] for c in counters}
    assert after == {"decode_gemv_weights_kept_skinny": 1, "decode_gemv_weights_kept_cublas": 1,
                     "decode_gemv_weights_warmed": 0}
    x = torch.randn(1, 16).to(torch.bfloat16)
    assert torch.equal(planned.apply(planned_layer, x), torch.nn.functional.linear(x, planned_layer.weight))
    assert torch.equal(other.apply(other_layer, x), torch.nn.functional.linear(x, other_layer.weight))


def test_before_0_34_no_skinny_question_is_asked(monkeypatch) -> None:
    """Where vLLM chose default_unquantized_gemm (0.29.0 to 0.33.0 on CUDA), the patch never gives a layer
    back, even if a maybe_use_skinny_gemm exists: its plans are for cuda_unquantized_gemm only."""
    pytest.importorskip("vllm")
    import torch
    from vllm.model_executor.layers import linear, utils

    monkeypatch.setenv("VLLM_OVERLAY_DECODE_GEMV", "1")
    _skinny_stand_ins(monkeypatch, {(64, 16)})
    monkeypatch.setattr(linear, "dispatch_unquantized_gemm", lambda *a, **k: utils.default_unquantized_gemm)
    method = _method_through_the_wrapper()
    layer = _layer(64, 16, torch.bfloat16)
    assert not patch._keeps_skinny(method, layer)
    assert method._gemm_impl is patch.overlay_gemm and not hasattr(layer, "use_skinny_gemm")
