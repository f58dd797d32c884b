"""The moe-configs patch against the installed vLLM (CPU build 0.32.0): vLLM's real
get_moe_configs / get_config_file_name / try_get_optimal_moe_config, wrapped and reverted.

The CPU build has no CUDA device, so the device name vLLM puts in the file name is faked by
monkeypatching the one function vLLM 0.32 uses for it (fused_moe.get_device_name_as_file_name).
Nothing else is faked."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

from vllm_overlay import core
from vllm_overlay.patches import moe_configs as patch
from vllm_overlay.mechanisms.install import install
from vllm_overlay.mechanisms.wrap import installing
from vllm_overlay.report import STATE

fm = pytest.importorskip("vllm.model_executor.layers.fused_moe.fused_moe")

TUNED = {"triton_version": "3.5.0",
         "1": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 256, "GROUP_SIZE_M": 1,
               "num_warps": 4, "num_stages": 5},
         "64": {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
                "num_warps": 4, "num_stages": 3}}


def fake_device(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setattr(fm, "get_device_name_as_file_name", lambda device_id=0: name)


@pytest.fixture
def tuned_dir(tmp_path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:  # type: ignore[no-untyped-def]
    d = tmp_path / "moe-configs"
    d.mkdir()
    monkeypatch.setenv("VLLM_OVERLAY_MOE_CONFIG_DIR", str(d))
    monkeypatch.setenv("VLLM_OVERLAY_REPORT_DIR", str(tmp_path / "reports"))
    monkeypatch.delenv("VLLM_TUNED_CONFIG_FOLDER", raising=False)
    fm.get_moe_configs.cache_clear()
    yield str(d)
    fm.get_moe_configs.cache_clear()


@pytest.fixture
def applied(tuned_dir: str) -> Iterator[str]:
    """The patch's own install on the imported module, undone in teardown (proves it comes off)."""
    original = fm.get_moe_configs
    STATE.reset()
    patch.reset()
    with installing(patch.PATCH_ID):
        installed = install(patch.SPEC, patch, patch.FUSED_MOE, "0.32.0")  # as core installs it from SPEC
    yield tuned_dir
    for inst in reversed(installed):
        inst.undo()
    patch.on_revert()
    assert fm.get_moe_configs is original
    STATE.reset()


def write(folder: str, name: str, data: dict[str, Any]) -> str:
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        json.dump(data, f)
    return path


def test_user_tuned_file_is_used_for_its_device_only(applied: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_device(monkeypatch, "NVIDIA_H200")
    path = write(applied, "E=256,N=512,device_name=NVIDIA_H200.json", TUNED)
    got = fm.get_moe_configs(256, 512, None, None, None)
    assert got == {1: TUNED["1"], 64: TUNED["64"]}
    # vLLM's own caller picks the nearest batch size from our file
    cfg = fm.try_get_optimal_moe_config((256, 1024, 2048), (256, 2048, 512), 8, None, 48)
    assert cfg == TUNED["64"]
    entry = STATE.patches["moe-configs"]["moe_configs"]
    assert entry == {"E=256,N=512,dtype=bf16/fp16,device=NVIDIA_H200": path}

    # another device: vLLM's default behaviour (no file for it anywhere -> None -> vLLM's heuristic)
    patch.reset()
    fake_device(monkeypatch, "NVIDIA_GeForce_RTX_4090")
    assert fm.get_moe_configs(256, 512, None, None, None) is None
    default = fm.get_default_config(48, 256, 512, 2048, 8, None)
    assert fm.try_get_optimal_moe_config((256, 1024, 2048), (256, 2048, 512), 8, None, 48) == default
    assert STATE.patches["moe-configs"]["moe_configs"][
        "E=256,N=512,dtype=bf16/fp16,device=NVIDIA_GeForce_RTX_4090"] == "vLLM default"


def test_dtype_and_block_shape_are_part_of_the_match(applied: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_device(monkeypatch, "NVIDIA_RTX_A5000")
    fp8 = write(applied, "E=256,N=256,device_name=NVIDIA_RTX_A5000,dtype=fp8_w8a8.json", TUNED)
    assert fm.get_moe_configs(256, 256, None, None, None) is None  # bf16: no file
    assert fm.get_moe_configs(256, 256, "fp8_w8a8", None, None) == {1: TUNED["1"], 64: TUNED["64"]}
    assert fm.get_moe_configs(256, 256, "fp8_w8a8", 128, 128) is None  # block-wise fp8: another file
    seen = STATE.patches["moe-configs"]["moe_configs"]
    assert seen["E=256,N=256,dtype=fp8_w8a8,device=NVIDIA_RTX_A5000"] == fp8
    assert seen["E=256,N=256,dtype=bf16/fp16,device=NVIDIA_RTX_A5000"] == "vLLM default"
    assert seen["E=256,N=256,dtype=fp8_w8a8,block_shape=[128,128],device=NVIDIA_RTX_A5000"] == "vLLM default"


def test_vllm_own_file_wins(applied: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM 0.32 ships E=256,N=512 for the H100: vLLM answers with its own file, ours is not read
    fake_device(monkeypatch, "NVIDIA_H100_80GB_HBM3")
    write(applied, "E=256,N=512,device_name=NVIDIA_H100_80GB_HBM3.json", TUNED)
    got = fm.get_moe_configs(256, 512, None, None, None)
    assert got is not None and got != {1: TUNED["1"], 64: TUNED["64"]}
    (source,) = STATE.patches["moe-configs"]["moe_configs"].values()
    assert source.endswith("fused_moe/configs/E=256,N=512,device_name=NVIDIA_H100_80GB_HBM3.json")


def test_vllm_tuned_config_folder_still_wins(applied: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    fake_device(monkeypatch, "NVIDIA_H200")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    other = {**TUNED, "1": {**TUNED["1"], "num_warps": 8}}
    path = write(str(theirs), "E=256,N=512,device_name=NVIDIA_H200.json", other)
    write(applied, "E=256,N=512,device_name=NVIDIA_H200.json", TUNED)
    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(theirs))
    assert fm.get_moe_configs(256, 512, None, None, None)[1]["num_warps"] == 8
    assert list(STATE.patches["moe-configs"]["moe_configs"].values()) == [path]


def test_a_broken_user_file_falls_back_loudly(applied: str, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    fake_device(monkeypatch, "NVIDIA_H200")
    with open(os.path.join(applied, "E=256,N=512,device_name=NVIDIA_H200.json"), "w") as f:
        f.write('{"1": {"BLOCK_SIZE_M": 16}}')
    with caplog.at_level("WARNING", logger="vllm_overlay"):
        assert fm.get_moe_configs(256, 512, None, None, None) is None
    (msg,) = [r.getMessage() for r in caplog.records if "moe-configs" in r.getMessage()]
    assert "E=256,N=512" in msg and "batch size 1: expected an object with" in msg


def test_no_shipped_config_is_said(applied: str, monkeypatch: pytest.MonkeyPatch,
                                   caplog: pytest.LogCaptureFixture) -> None:
    assert patch.shipped_files() == []  # nothing measured yet, so nothing ships
    fake_device(monkeypatch, "NVIDIA_H200")
    with caplog.at_level("INFO", logger="vllm_overlay"):
        fm.get_moe_configs(256, 512, None, None, None)
        fm.get_moe_configs(256, 512, None, None, None)
    lines = [r.getMessage() for r in caplog.records if "moe-configs" in r.getMessage()]
    assert len(lines) == 1, lines  # one line per shape
    assert "no shipped config for device NVIDIA_H200" in lines[0] and applied in lines[0]


def test_register_and_revert_through_core(tuned_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    original = fm.get_moe_configs
    STATE.reset()
    core.revert()
    try:
        core.register()
        assert STATE.patches["moe-configs"]["status"] == "applied"
        assert fm.get_moe_configs is not original
        fake_device(monkeypatch, "NVIDIA_H200")
        path = write(tuned_dir, "E=256,N=256,device_name=NVIDIA_H200.json", TUNED)
        assert fm.get_moe_configs(256, 256, None) == {1: TUNED["1"], 64: TUNED["64"]}
        with open(STATE.report_path()) as f:
            assert json.load(f)["patches"]["moe-configs"]["moe_configs"] == {
                "E=256,N=256,dtype=bf16/fp16,device=NVIDIA_H200": path}
    finally:
        core.revert()
        STATE.reset()
    assert fm.get_moe_configs is original
    fm.get_moe_configs.cache_clear()
    assert fm.get_moe_configs(256, 256, None) is None  # vLLM alone again


def test_load_config_file_errors(tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "x.json"
    bad.write_text('{"one": {}}')
    with pytest.raises(ValueError, match="key 'one': expected a batch size"):
        patch.load_config_file(str(bad))
    bad.write_text("[1]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        patch.load_config_file(str(bad))


def test_user_dir_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", "/c")
    assert patch.user_dir() == "/c/vllm-overlay/moe-configs"
    monkeypatch.setenv("VLLM_OVERLAY_MOE_CONFIG_DIR", "/t/m")
    assert patch.user_dir() == "/t/m"


def test_a_failing_lookup_never_breaks_vllm(applied: str, monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    def broken(device_id: int = 0) -> str:
        raise RuntimeError("no device")

    # vLLM's own lookup raises the same error: the patch adds no new failure and logs one line
    monkeypatch.setattr(fm, "get_device_name_as_file_name", broken)
    with caplog.at_level("WARNING", logger="vllm_overlay"), pytest.raises(RuntimeError, match="no device"):
        fm.get_moe_configs(256, 512, None, None, None)
    assert any("lookup failed (RuntimeError: no device); vLLM decides alone" in r.getMessage()
               for r in caplog.records)


def test_user_file_before_shipped_file_before_default(applied: str, tmp_path, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """The lookup order below vLLM's own: the user's tuned folder, then the configs that ship with the
    package (a temporary folder stands in for src/vllm_overlay/moe_configs/), then vLLM's default."""
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(patch, "SHIPPED_DIR", str(shipped))
    fake_device(monkeypatch, "NVIDIA_H200")
    ours = write(str(shipped), "E=256,N=512,device_name=NVIDIA_H200.json", TUNED)
    with caplog.at_level("INFO", logger="vllm_overlay"):
        assert fm.get_moe_configs(256, 512, None, None, None) == {1: TUNED["1"], 64: TUNED["64"]}
    assert STATE.patches["moe-configs"]["moe_configs"] == {"E=256,N=512,dtype=bf16/fp16,device=NVIDIA_H200": ours}
    assert STATE.patches["moe-configs"]["shipped_configs"] == ["E=256,N=512,device_name=NVIDIA_H200.json"]
    assert any("(shipped with vllm-overlay, 2 batch sizes)" in r.getMessage() for r in caplog.records)

    # a user file of the same name wins over the shipped one
    patch.reset()
    fm.get_moe_configs.cache_clear()
    user = write(applied, "E=256,N=512,device_name=NVIDIA_H200.json", {**TUNED, "1": {**TUNED["1"], "num_warps": 8}})
    assert fm.get_moe_configs(256, 512, None, None, None)[1]["num_warps"] == 8
    assert STATE.patches["moe-configs"]["moe_configs"]["E=256,N=512,dtype=bf16/fp16,device=NVIDIA_H200"] == user

    # a shape the shipped configs do not cover: vLLM's default, and the line says what ships for the device
    patch.reset()
    caplog.clear()
    with caplog.at_level("INFO", logger="vllm_overlay"):
        assert fm.get_moe_configs(256, 256, None, None, None) is None
    (line,) = [r.getMessage() for r in caplog.records if "moe-configs: E=256,N=256" in r.getMessage()]
    assert "vllm-overlay ships 1 config(s) for NVIDIA_H200, none for this shape" in line


# ---- vLLM 0.34.0's down-projection lookup (get_moe_configs(..., down_moe=True)) ------------------------
#
# vLLM 0.34.0's Triton experts ask get_moe_configs(E, N, dtype, 128, 128, down_moe=True) for a separate
# down-projection config (block-FP8 weights), read from the file vLLM names with "_down.json" at the end.
# The installed 0.32.0 get_moe_configs has no down_moe parameter, so these tests drive the patch's wrapper
# directly with a stand-in for vLLM 0.34.0's function (it records how it was called and returns a marker);
# the file names still come from the real fused_moe module of the installed build (device name faked as
# above).

DOWN = {**TUNED, "1": {**TUNED["1"], "num_warps": 8}, "64": {**TUNED["64"], "BLOCK_SIZE_N": 128}}
DEVICE = "NVIDIA_RTX_A5000"  # vLLM 0.32.0 ships no E=256,N=512 config for it
FP8_BLOCK = f"E=256,N=512,device_name={DEVICE},dtype=fp8_w8a8,block_shape=[128,128]"
KEY = f"E=256,N=512,dtype=fp8_w8a8,block_shape=[128,128],device={DEVICE}"


class VllmStandIn:
    """Stands for vLLM 0.34.0's get_moe_configs under the wrapper: records each call, answers a marker."""

    ANSWER = {"vllm": "0.34.0 stand-in"}

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((args, kwargs))
        return self.ANSWER


@pytest.fixture
def wrapper_only(tuned_dir: str) -> Iterator[str]:
    STATE.reset()
    patch.reset()
    yield tuned_dir
    patch.reset()
    STATE.reset()


def lookup(vllm: VllmStandIn, down_moe: bool | None) -> Any:
    """The call vLLM 0.34.0 makes: positional shape, down_moe by keyword (absent for gate/up)."""
    kwargs = {} if down_moe is None else {"down_moe": down_moe}
    return patch._get_moe_configs(vllm, None, (256, 512, "fp8_w8a8", 128, 128), kwargs)


def test_a_gate_up_file_is_never_handed_to_the_down_projection(wrapper_only: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    fake_device(monkeypatch, DEVICE)
    assert fm.get_config_file_name(256, 512, "fp8_w8a8", [128, 128]) == f"{FP8_BLOCK}.json"
    gate_up = write(wrapper_only, f"{FP8_BLOCK}.json", TUNED)
    vllm = VllmStandIn()
    # down_moe=True: no _down.json anywhere, so vLLM decides, and is asked with down_moe on
    assert lookup(vllm, True) is VllmStandIn.ANSWER
    assert vllm.calls == [((256, 512, "fp8_w8a8", 128, 128), {"down_moe": True})]
    # the same shape without down_moe: the user's gate/up file, vLLM not asked
    assert lookup(vllm, None) == {1: TUNED["1"], 64: TUNED["64"]}
    assert lookup(vllm, False) == {1: TUNED["1"], 64: TUNED["64"]}
    assert len(vllm.calls) == 1
    # a second down lookup is decided from the cache: vLLM is asked again, still with down_moe on
    assert lookup(vllm, True) is VllmStandIn.ANSWER
    assert vllm.calls[-1] == ((256, 512, "fp8_w8a8", 128, 128), {"down_moe": True}) and len(vllm.calls) == 2
    assert STATE.patches["moe-configs"]["moe_configs"] == {f"{KEY},down": "vLLM default", KEY: gate_up}


def test_a_down_file_is_used_for_the_down_projection_only(wrapper_only: str, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    fake_device(monkeypatch, DEVICE)
    gate_up = write(wrapper_only, f"{FP8_BLOCK}.json", TUNED)
    down = write(wrapper_only, f"{FP8_BLOCK}_down.json", DOWN)
    assert patch.down_name(f"{FP8_BLOCK}.json") == f"{FP8_BLOCK}_down.json"
    vllm = VllmStandIn()
    with caplog.at_level("INFO", logger="vllm_overlay"):
        assert lookup(vllm, True) == {1: DOWN["1"], 64: DOWN["64"]}
        # decided separately: a later gate/up lookup of the same shape still gets the gate/up file
        assert lookup(vllm, None) == {1: TUNED["1"], 64: TUNED["64"]}
        assert lookup(vllm, True) == {1: DOWN["1"], 64: DOWN["64"]}
        assert lookup(vllm, False) == {1: TUNED["1"], 64: TUNED["64"]}
    assert vllm.calls == []  # both answered from the user's folder
    entry = STATE.patches["moe-configs"]["moe_configs"]
    assert entry == {f"{KEY},down": down, KEY: gate_up}
    assert [k for k in entry if k.endswith(",down")] == [f"{KEY},down"]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("moe-configs: E=256")]
    assert lines == [f"moe-configs: {KEY},down: {down} (user-tuned, 2 batch sizes)",
                     f"moe-configs: {KEY}: {gate_up} (user-tuned, 2 batch sizes)"]


def test_a_down_file_alone_leaves_the_gate_up_lookup_to_vllm(wrapper_only: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    fake_device(monkeypatch, DEVICE)
    down = write(wrapper_only, f"{FP8_BLOCK}_down.json", DOWN)
    vllm = VllmStandIn()
    assert lookup(vllm, None) is VllmStandIn.ANSWER
    assert vllm.calls == [((256, 512, "fp8_w8a8", 128, 128), {})]
    assert lookup(vllm, True) == {1: DOWN["1"], 64: DOWN["64"]}
    assert STATE.patches["moe-configs"]["moe_configs"] == {KEY: "vLLM default", f"{KEY},down": down}


def test_vllms_own_down_file_wins(wrapper_only: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """VLLM_TUNED_CONFIG_FOLDER holding the _down.json name: vLLM's own lookup finds it, the wrapper
    hands the call to vLLM (down_moe on) and records vLLM's file under the ",down" key."""
    fake_device(monkeypatch, DEVICE)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    path = write(str(theirs), f"{FP8_BLOCK}_down.json", DOWN)
    write(wrapper_only, f"{FP8_BLOCK}_down.json", TUNED)
    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(theirs))
    vllm = VllmStandIn()
    assert lookup(vllm, True) is VllmStandIn.ANSWER
    assert vllm.calls == [((256, 512, "fp8_w8a8", 128, 128), {"down_moe": True})]
    assert STATE.patches["moe-configs"]["moe_configs"] == {f"{KEY},down": path}


def test_vllms_shipped_gate_up_file_is_not_the_down_config(wrapper_only: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM ships a block-FP8 gate/up config for E=256,N=512 on the H200 and no _down.json: a down lookup
    finds nothing of vLLM's, nothing in the user's folder, and leaves the choice to vLLM (down_moe on)."""
    fake_device(monkeypatch, "NVIDIA_H200")
    shipped = os.path.join(os.path.dirname(fm.__file__), "configs",
                           "E=256,N=512,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json")
    assert os.path.exists(shipped)
    vllm = VllmStandIn()
    assert lookup(vllm, True) is VllmStandIn.ANSWER
    assert lookup(vllm, None) is VllmStandIn.ANSWER  # vLLM's own file: vLLM answers
    assert vllm.calls == [((256, 512, "fp8_w8a8", 128, 128), {"down_moe": True}),
                          ((256, 512, "fp8_w8a8", 128, 128), {})]
    h200 = "E=256,N=512,dtype=fp8_w8a8,block_shape=[128,128],device=NVIDIA_H200"
    entry = STATE.patches["moe-configs"]["moe_configs"]
    assert entry[f"{h200},down"] == "vLLM default"
    assert os.path.realpath(entry[h200]) == os.path.realpath(shipped)
