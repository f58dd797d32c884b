"""`vllm-overlay tune-moe` on the CPU build: argument handling, the no-CUDA exit, config writing,
resume after a time limit, and the moe-configs patch picking the written file up.

The kernel timing needs CUDA, which this machine does not have: a fake ``bench`` stands in for
vLLM's fused-MoE kernel timed in a CUDA graph (``vllm_overlay.tools.tune.cuda``). It returns a
deterministic time per config with one known fastest config, so the search, the files and the
resume are checked exactly. Everything else is the real code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from vllm_overlay.tools.cli.main import build_parser, main
from vllm_overlay.tools.output import Out
from vllm_overlay.tools.cli import tune_moe
from vllm_overlay.mechanisms.install import install
from vllm_overlay.mechanisms.wrap import installing
from vllm_overlay.tools.tune import run as tunerun
from vllm_overlay.tools.tune import space
from vllm_overlay.tools.tune.run import Backend, Options
from vllm_overlay.tools.tune.space import Shape

DEVICE = "NVIDIA_H200"
BEST = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4,
        "num_stages": 4}
VLLM_DEFAULT = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "SPLIT_K": 1,
                "num_warps": 4, "num_stages": 3}


class FakeGPU:
    """Stands in for the CUDA kernel timing: microseconds = 10 + distance from BEST (+ batch / 100)."""

    def __init__(self) -> None:
        self.calls: Counter[tuple[str, int]] = Counter()

    def bench(self, shape: Shape, batch: int, cfg: dict[str, int]) -> float:
        self.calls[(shape.label(), batch)] += 1
        if cfg["BLOCK_SIZE_N"] == 32 and cfg["num_warps"] == 8:
            raise RuntimeError("out of resources")  # a config that cannot launch is skipped
        dist = sum(abs(cfg[k] - BEST[k]) / BEST[k] for k in BEST)
        return 10.0 + dist + batch / 100

    def backend(self) -> Backend:
        return Backend(device=DEVICE, bench=self.bench, vllm_choice=lambda shape, b: dict(VLLM_DEFAULT),
                       file_name=lambda shape: space.config_file_name(shape, DEVICE), smem_bytes=228 * 1024,
                       versions={"vllm": "0.32.0", "triton": "3.5.0", "torch": "2.13.0"})


def parse(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["tune-moe", *argv])


def shape(n: int = 512) -> Shape:
    return Shape(256, n, 2048, 8, "bf16")


@pytest.mark.parametrize(("argv", "expected"), [
    (["--batch-sizes", "1,x,4"], "--batch-sizes '1,x,4': 'x' is not an integer in [1, 65536]"),
    (["--batch-sizes", "0"], "--batch-sizes '0': '0' is not an integer in [1, 65536]"),
    (["--batch-sizes", "1,,2"], "--batch-sizes '1,,2': expected comma-separated integers in [1, 65536], e.g. 1,2,4"),
    (["--batch-sizes", "8,8"], "--batch-sizes '8,8': 8 is given twice; expected each value once"),
    (["--experts", "many"], "--experts 'many': expected an integer in [1, 1024]"),
    (["--topk", "300"], "--topk '300': expected an integer in [1, 256]"),
    (["--intermediate", "512,8"], "--intermediate '512,8': '8' is not an integer in [16, 65536]"),
    (["--hidden", "-1"], "--hidden '-1': expected an integer in [16, 65536]"),
    (["--dtype", "bf16,int4"], "--dtype 'bf16,int4': 'int4' is not one of bf16, fp8_w8a8"),
    (["--search", "huge"], "--search 'huge': expected one of quick, full"),
    (["--time-limit", "0"], "--time-limit '0': expected seconds > 0, e.g. 3600"),
    (["--time-limit", "1h"], "--time-limit '1h': expected seconds > 0, e.g. 3600"),
    (["--iters", "0"], "--iters '0': expected an integer in [1, 1000]"),
    (["--confirm", "-1"], "--confirm '-1': expected an integer in [0, 100]"),
    (["--confirm", "many"], "--confirm 'many': expected an integer in [0, 100]"),
])
def test_every_bad_argument_is_one_clear_line(argv: list[str], expected: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune-moe", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"vllm-overlay tune-moe: bad usage: {expected}"]


def test_out_dir_that_is_a_file(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "f"
    f.write_text("")
    assert main(["tune-moe", "--out-dir", str(f)]) == 2
    assert f"--out-dir '{f}': exists and is not a directory" in capsys.readouterr().err


def test_no_cuda_exits_2_with_one_line_after_validating(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    # this CPU build has no CUDA: valid arguments reach the GPU check, which says what is missing
    assert main(["tune-moe", "--out-dir", str(tmp_path / "o"), "--batch-sizes", "1,2"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("vllm-overlay tune-moe: tune-moe needs a CUDA GPU: torch.cuda.is_available() is False")
    assert not (tmp_path / "o").exists()  # nothing written


def test_no_cuda_from_the_installed_command_in_a_pipe(tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(__file__), "..", "src")}
    p = subprocess.run([sys.executable, "-m", "vllm_overlay", "tune-moe", "--out-dir", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2, p.stderr
    assert "tune-moe needs a CUDA GPU: " in p.stderr and p.stdout == ""


def test_defaults_are_the_served_shapes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    opts = tune_moe.options(parse("--out-dir", str(tmp_path)))
    assert [(s.experts, s.intermediate, s.hidden, s.topk, s.dtype) for s in opts.shapes] == [
        (256, 512, 2048, 8, "bf16"), (256, 256, 2048, 8, "bf16")]
    assert opts.batch_sizes == list(space.DEFAULT_BATCH_SIZES) and opts.time_limit is None


def test_writes_vllm_format_and_prints_before_after(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    gpu = FakeGPU()
    out_dir = tmp_path / "tuned"
    rc = tune_moe.run(parse("--out-dir", str(out_dir), "--batch-sizes", "1,16,256", "--intermediate", "512"),
                      backend_factory=gpu.backend)
    assert rc == 0
    path = out_dir / "E=256,N=512,device_name=NVIDIA_H200.json"
    data = json.loads(path.read_text())
    assert data.pop("triton_version") == "3.5.0"
    # the sizes asked for carry their best config; the rest of vLLM's grid holds vLLM's own config
    assert {k: v for k, v in data.items() if v == BEST} == {"1": BEST, "16": BEST, "256": BEST}
    assert sorted(map(int, data)) == sorted(set(space.DEFAULT_BATCH_SIZES) | {1, 16, 256})
    assert all(v == VLLM_DEFAULT for k, v in data.items() if k not in ("1", "16", "256"))
    out = capsys.readouterr().out
    # piped: plain lines, a progress line, a before/after row per batch size
    assert "configs timed: " in out and "\x1b[" not in out
    assert "E=256,N=512,dtype=bf16 batch 16: vLLM's config 10.4 us -> tuned 10.2 us (1.02 x;" in out
    assert "  E=256,N=512,dtype=bf16: batch=256; before us=12.8; after us=12.6; speedup=1.02 x;" in out
    assert f"{path}: 3 of 3 batch sizes tuned" in out
    state = json.loads((out_dir / "tune-state" / "E=256,N=512,device_name=NVIDIA_H200.state.json").read_text())
    assert state["meta"]["device"] == DEVICE and sorted(state["batches"]) == ["1", "16", "256"]
    assert state["batches"]["1"]["default_config"] == VLLM_DEFAULT
    assert state["batches"]["1"]["seconds"] >= 0 and state["batches"]["1"]["utc"].endswith("Z")
    # the winner was re-timed against vLLM's config, 5 rounds each, alternately
    conf = state["batches"]["16"]["confirm"]
    assert conf["rounds"] == 5 and conf["default_us"] == [10.41] * 5 and conf["tuned_us"] == [10.16] * 5
    assert conf["kept"] == "tuned" and conf["verdict"] == "faster beyond the spread"
    assert ("; re-timed 5 rounds alternately: vLLM's 10.4 us, tuned 10.2 us (1.02 x), faster beyond the spread"
            in out)
    assert "re-timed=5 rounds: vLLM's 10.4-10.4, tuned 10.2-10.2 us; faster beyond the spread" in out


def test_time_limit_stops_keeps_finished_batches_and_resumes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    gpu = FakeGPU()
    ticks = iter(range(10**6))
    clock = lambda: float(next(ticks))  # noqa: E731 - one second per clock read
    opts = Options(shapes=[shape()], batch_sizes=[1, 2, 4096], out_dir=str(tmp_path), time_limit=100)
    res = tunerun.execute(opts, gpu.backend(), Out(force_plain=True), clock=clock)
    assert res["exit_code"] == tunerun.TIME_LIMIT and "batch 4096" in res["stopped"]
    path = tmp_path / "E=256,N=512,device_name=NVIDIA_H200.json"
    data = json.loads(path.read_text())
    # finished batch sizes carry their best config; the unfinished one holds vLLM's own choice
    assert data["1"] == BEST and data["2"] == BEST and data["4096"] == VLLM_DEFAULT
    first = dict(gpu.calls)

    res2 = tunerun.execute(Options(shapes=[shape()], batch_sizes=[1, 2, 4096], out_dir=str(tmp_path)),
                           gpu.backend(), Out(force_plain=True))
    assert res2["exit_code"] == tunerun.DONE
    # batch sizes 1 and 2 were not timed again
    assert gpu.calls[("E=256,N=512,dtype=bf16", 1)] == first[("E=256,N=512,dtype=bf16", 1)]
    assert gpu.calls[("E=256,N=512,dtype=bf16", 2)] == first[("E=256,N=512,dtype=bf16", 2)]
    assert json.loads(path.read_text())["4096"] == BEST
    assert [r["resumed"] for r in res2["rows"]] == [True, True, False]

    # --fresh starts over
    tunerun.execute(Options(shapes=[shape()], batch_sizes=[1], out_dir=str(tmp_path), fresh=True),
                    gpu.backend(), Out(force_plain=True))
    assert gpu.calls[("E=256,N=512,dtype=bf16", 1)] == 2 * first[("E=256,N=512,dtype=bf16", 1)]


def test_a_file_of_decode_sizes_never_runs_a_prefill_with_a_decode_tile(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Tuning only the decode sizes (1-128) writes vLLM's own config for every size of vLLM's grid
    above them: vLLM takes the nearest size in the file, so without those an 8192-token forward would
    run the tile tuned for 128 tokens."""
    def default_for(shape: Shape, batch: int) -> dict[str, int]:  # vLLM's heuristic grows with the batch
        return {**VLLM_DEFAULT, "BLOCK_SIZE_M": 16 if batch <= 32 else 64 if batch <= 512 else 128}

    gpu = FakeGPU()
    backend = gpu.backend()
    backend.vllm_choice = default_for
    decode = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]
    res = tunerun.execute(Options(shapes=[shape()], batch_sizes=decode, out_dir=str(tmp_path)), backend,
                          Out(force_plain=True))
    assert res["exit_code"] == tunerun.DONE
    data = json.loads((tmp_path / "E=256,N=512,device_name=NVIDIA_H200.json").read_text())
    data.pop("triton_version")
    configs = {int(k): v for k, v in data.items()}
    for m in (3000, 8192, 700):  # vLLM's own lookup: the nearest batch size in the file
        nearest = min(configs, key=lambda b: abs(b - m))
        assert nearest > 128 and configs[nearest] == default_for(shape(), nearest)
    assert all(configs[b] == BEST for b in decode)
    # the resumed run over the whole grid times only the sizes not tuned yet
    first = dict(gpu.calls)
    res2 = tunerun.execute(Options(shapes=[shape()], batch_sizes=list(space.DEFAULT_BATCH_SIZES),
                                   out_dir=str(tmp_path)), backend, Out(force_plain=True))
    assert [r["resumed"] for r in res2["rows"]] == [b in decode for b in space.DEFAULT_BATCH_SIZES]
    assert all(gpu.calls[key] == n for key, n in first.items()) and len(gpu.calls) == len(space.DEFAULT_BATCH_SIZES)


def test_state_from_other_settings_is_not_resumed(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    gpu = FakeGPU()
    tunerun.execute(Options(shapes=[shape()], batch_sizes=[1], out_dir=str(tmp_path)), gpu.backend(),
                    Out(force_plain=True))
    tunerun.execute(Options(shapes=[shape()], batch_sizes=[1], out_dir=str(tmp_path), search="full"),
                    gpu.backend(), Out(force_plain=True))
    out = capsys.readouterr().out
    assert "starting fresh: the state in " in out and "(search 'quick' -> 'full')" in out


def test_candidates_are_pruned_per_batch() -> None:
    s = shape()
    small = space.candidates(s, 1, "quick", 228 * 1024)
    big = space.candidates(s, 8192, "quick", 228 * 1024)
    assert {c["BLOCK_SIZE_M"] for c in small} == {16} and {c["GROUP_SIZE_M"] for c in small} == {1}
    assert {c["BLOCK_SIZE_M"] for c in big} == {16, 32, 64, 128} and 16 in {c["GROUP_SIZE_M"] for c in big}
    assert {c["BLOCK_SIZE_M"] for c in space.candidates(s, 512, "quick", None)} == {16, 32, 64}
    tight = space.candidates(s, 8192, "full", 100 * 1024)  # a 4090 / A5000 has about 100 KiB per block
    assert all((c["BLOCK_SIZE_M"] + c["BLOCK_SIZE_N"]) * c["BLOCK_SIZE_K"] * 2 * c["num_stages"] <= 100 * 1024
               for c in tight)
    assert len(tight) < len(space.candidates(s, 8192, "full", None))


def test_file_name_matches_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    fm = pytest.importorskip("vllm.model_executor.layers.fused_moe.fused_moe")
    # no CUDA device on this machine: fake the name vLLM 0.32 reads for the file name
    monkeypatch.setattr(fm, "get_device_name_as_file_name", lambda device_id=0: "NVIDIA_GeForce_RTX_4090")
    for s in (shape(512), shape(256), Shape(256, 512, 2048, 8, "fp8_w8a8")):
        assert space.config_file_name(s, "NVIDIA_GeForce_RTX_4090") == fm.get_config_file_name(
            s.experts, s.intermediate, s.vllm_dtype)


def test_the_patch_picks_up_what_tune_moe_wrote(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    fm = pytest.importorskip("vllm.model_executor.layers.fused_moe.fused_moe")
    from vllm_overlay.patches import moe_configs
    from vllm_overlay.report import STATE

    out_dir = tmp_path / "moe"
    monkeypatch.setenv("VLLM_OVERLAY_MOE_CONFIG_DIR", str(out_dir))
    monkeypatch.setenv("VLLM_OVERLAY_REPORT_DIR", str(tmp_path / "reports"))
    monkeypatch.delenv("VLLM_TUNED_CONFIG_FOLDER", raising=False)
    assert tune_moe.run(parse("--batch-sizes", "1,64", "--intermediate", "256"),
                        backend_factory=FakeGPU().backend) == 0  # default --out-dir: the patch's folder
    # no CUDA device here: fake the device name vLLM 0.32 puts in the file name
    monkeypatch.setattr(fm, "get_device_name_as_file_name", lambda device_id=0: DEVICE)
    STATE.reset()
    moe_configs.reset()
    fm.get_moe_configs.cache_clear()
    with installing(moe_configs.PATCH_ID):
        installed = install(moe_configs.SPEC, moe_configs, moe_configs.FUSED_MOE, "0.32.0")
    try:
        got = fm.get_moe_configs(256, 256, None, 0, 0)
        assert got[1] == got[64] == BEST and sorted(got) == tunerun.file_batch_sizes([1, 64])
        assert fm.try_get_optimal_moe_config((256, 512, 2048), (256, 2048, 256), 8, None, 62) == BEST
        monkeypatch.setattr(fm, "get_device_name_as_file_name", lambda device_id=0: "NVIDIA_A100-SXM4-80GB")
        moe_configs.reset()
        assert fm.get_moe_configs(256, 256, None, 0, 0) is None  # another device: vLLM's default
    finally:
        for inst in reversed(installed):
            inst.undo()
        moe_configs.on_revert()
        fm.get_moe_configs.cache_clear()
        STATE.reset()


class LuckyGPU(FakeGPU):
    """A config that is timed fast once (a lucky single timing) and slower than vLLM's ever after."""

    LUCKY = {**BEST, "BLOCK_SIZE_N": 128}

    def __init__(self) -> None:
        super().__init__()
        self.lucky_seen = 0

    def bench(self, shape: Shape, batch: int, cfg: dict[str, int]) -> float:
        t = super().bench(shape, batch, cfg)
        if all(cfg.get(k) == v for k, v in self.LUCKY.items()):
            self.lucky_seen += 1
            return 5.0 if self.lucky_seen == 1 else 10.5
        return t + (5.0 if cfg == BEST else 0.0)  # the true best is out of reach: vLLM's (10.26) wins


def test_a_winner_by_one_lucky_timing_is_not_kept(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    """The fastest of ~40 single timings is biased low. Re-timed against vLLM's config, a winner that
    is slower by the median is dropped: the file keeps vLLM's config and the table says 1.00 x."""
    gpu = LuckyGPU()
    res = tunerun.execute(Options(shapes=[shape()], batch_sizes=[1], out_dir=str(tmp_path)), gpu.backend(),
                          Out(force_plain=True))
    assert res["exit_code"] == tunerun.DONE and gpu.lucky_seen == 1 + 5
    data = json.loads((tmp_path / "E=256,N=512,device_name=NVIDIA_H200.json").read_text())
    assert data["1"] == VLLM_DEFAULT
    (r,) = res["rows"]
    assert r["before_us"] == r["after_us"] == pytest.approx(10.26) and r["confirm"]["kept"] == "vllm"
    out = capsys.readouterr().out
    assert ("vLLM's config 10.3 us -> tuned 5.0 us (2.05 x; " in out
            and "re-timed 5 rounds alternately: vLLM's 10.3 us, tuned 10.5 us (0.98 x), not faster on re-timing: "
                "keeps vLLM's config" in out)
    assert "speedup=1.00 x; re-timed=5 rounds: vLLM's 10.3-10.3, tuned 10.5-10.5 us; not faster" in out

    # --confirm 0: the single timings decide, as before the re-timing existed
    gpu = LuckyGPU()
    res = tunerun.execute(Options(shapes=[shape()], batch_sizes=[1], out_dir=str(tmp_path / "c0"), confirm=0),
                          gpu.backend(), Out(force_plain=True))
    assert gpu.lucky_seen == 1 and res["rows"][0]["after_us"] == 5.0 and res["rows"][0]["confirm"] is None
    assert json.loads((tmp_path / "c0" / "E=256,N=512,device_name=NVIDIA_H200.json").read_text())["1"] == LuckyGPU.LUCKY


class FlakyGPU(FakeGPU):
    """The fastest config runs once, in the search, and fails to launch when timed again."""

    def __init__(self) -> None:
        super().__init__()
        self.best_seen = 0

    def bench(self, shape: Shape, batch: int, cfg: dict[str, int]) -> float:
        if cfg == BEST:
            self.best_seen += 1
            if self.best_seen > 1:
                raise RuntimeError("out of resources")
        return super().bench(shape, batch, cfg)


def test_a_winner_that_fails_on_re_timing_is_not_kept(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    res = tunerun.execute(Options(shapes=[shape()], batch_sizes=[1], out_dir=str(tmp_path)), FlakyGPU().backend(),
                          Out(force_plain=True))
    assert res["exit_code"] == tunerun.DONE
    (r,) = res["rows"]
    assert r["confirm"]["kept"] == "vllm" and r["confirm"]["tuned_us"] == [None] * 5
    assert r["confirm"]["default_median"] == pytest.approx(10.26) and r["confirm"]["tuned_median"] is None
    assert r["before_us"] == r["after_us"] == pytest.approx(10.26)
    assert json.loads((tmp_path / "E=256,N=512,device_name=NVIDIA_H200.json").read_text())["1"] == VLLM_DEFAULT
    state = (tmp_path / "tune-state" / "E=256,N=512,device_name=NVIDIA_H200.state.json").read_text()
    assert "Infinity" not in state and "NaN" not in state  # strict JSON
    out = capsys.readouterr().out
    assert "re-timed: a re-timing failed to run: keeps vLLM's config" in out
    assert "re-timed=5 rounds; a re-timing failed to run: keeps vLLM's config" in out


def test_a_config_that_cannot_run_is_skipped(tmp_path) -> None:  # type: ignore[no-untyped-def]
    gpu = FakeGPU()
    res = tunerun.execute(Options(shapes=[shape()], batch_sizes=[1], out_dir=str(tmp_path)), gpu.backend(),
                          Out(force_plain=True))
    assert res["exit_code"] == 0 and res["rows"][0]["after_us"] == pytest.approx(10.01)


def test_help_lists_tune_moe() -> None:
    p = subprocess.run([sys.executable, "-m", "vllm_overlay", "--help"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(__file__), "..", "src")})
    assert "tune-moe" in p.stdout


def _ship(*argv: str):  # type: ignore[no-untyped-def]
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "moe_ship", os.path.join(os.path.dirname(__file__), "..", "bench", "moe_ship.py"))
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod.main(list(argv))


def test_only_winners_beyond_the_spread_ship(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    """bench/moe_ship.py on what tune-moe wrote: a batch size ships its tuned config only where the
    re-timing put every tuned timing below every timing of vLLM's config; elsewhere the shipped file
    holds vLLM's own config, and a shape with no such batch size ships nothing."""
    name = "E=256,N=512,device_name=NVIDIA_H200.json"
    tuned = tmp_path / "tuned"
    tunerun.execute(Options(shapes=[shape()], batch_sizes=[1, 16, 64], out_dir=str(tuned)), FakeGPU().backend(),
                    Out(force_plain=True))
    capsys.readouterr()
    # one winner whose ranges overlap vLLM's: kept by tune-moe (lower median), not shipped
    state_path = tuned / "tune-state" / name.replace(".json", ".state.json")
    state = json.loads(state_path.read_text())
    state["batches"]["64"]["confirm"].update(tuned_us=[10.5, 10.6, 10.9, 11.0, 10.55], tuned_median=10.6,
                                             verdict="faster by the median, within the spread")
    state_path.write_text(json.dumps(state))
    dest = tmp_path / "ship"
    assert _ship(str(tuned), "--write", str(dest)) == 0
    out = capsys.readouterr().out
    shipped = json.loads((dest / name).read_text())
    written = json.loads((tuned / name).read_text())
    assert shipped["1"] == shipped["16"] == BEST and shipped["64"] == VLLM_DEFAULT and written["64"] == BEST
    assert {k: v for k, v in shipped.items() if k not in ("1", "16", "64")} == \
        {k: v for k, v in written.items() if k not in ("1", "16", "64")}
    assert "| 16 | 10.4 (10.4-10.4) | 10.2 (10.2-10.2) | 1.025 x | faster beyond the spread | yes |" in out
    assert "| 64 | 10.9 (10.9-10.9) | 10.6 (10.5-11.0) | 1.027 x | faster by the median, within the spread | no |" in out
    assert f"{name}: ships the tuned config at batch sizes 1, 16; vLLM's own config at the other 17 of the file's 19" in out

    # a run whose only winner was a lucky single timing ships nothing
    lucky = tmp_path / "lucky"
    tunerun.execute(Options(shapes=[shape()], batch_sizes=[1], out_dir=str(lucky)), LuckyGPU().backend(),
                    Out(force_plain=True))
    capsys.readouterr()
    assert _ship(str(lucky), "--write", str(tmp_path / "ship2")) == 0
    out = capsys.readouterr().out
    assert f"{name}: nothing ships (no batch size faster beyond the spread)" in out
    assert "| 1 | 10.3 (10.3-10.3) | 10.5 (10.5-10.5) | 0.977 x | not faster on re-timing: keeps vLLM's config | no |" in out
    assert not (tmp_path / "ship2").exists()

    # vLLM's own config cannot launch: nothing to compare the winner with, so nothing ships
    failing = tmp_path / "failing"
    backend = FakeGPU().backend()
    backend.vllm_choice = lambda shape, b: {**VLLM_DEFAULT, "BLOCK_SIZE_N": 32, "num_warps": 8}
    tunerun.execute(Options(shapes=[shape()], batch_sizes=[1], out_dir=str(failing)), backend, Out(force_plain=True))
    capsys.readouterr()
    assert _ship(str(failing)) == 0
    out = capsys.readouterr().out
    assert "| 1 | - | 10.01 | - | vLLM's config failed to run in the search: no comparison | no |" in out
    assert f"{name}: nothing ships" in out

    assert _ship(str(tmp_path / "nothing-here")) == 2
    assert "holds no tune-state/*.state.json; expected a tune-moe --out-dir folder" in capsys.readouterr().err
