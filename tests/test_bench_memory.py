"""bench/stack.py's `memory` step and `series memory` (bench/memory_serve.py) on the CPU: the series'
configurations, the plan's device commands, the nvidia-smi reader, the table; then a real `vllm serve`
of the tiny hybrid driven through the series across two "calls", with memory-headroom's runtime
windows opened by the step's marks (engine-marked)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time

import pytest

from conftest import clean_env
from test_bench_stack import parse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
sys.path.insert(0, BENCH)
import make_table  # noqa: E402
import memory_serve  # noqa: E402
import stack  # noqa: E402

sys.path.remove(BENCH)

def boot_of(label: str):  # type: ignore[no-untyped-def]
    spec = stack.SERIES["memory"]
    return parse(["boot", label, *shlex.split(spec["boot"]), *shlex.split(dict(spec["items"])[label])])


def test_memory_series_configurations() -> None:
    """Two pairs, each booting the same graphs: the bug report's sizing (TurboQuant, cap 4096 from
    config overlay, mnbt 16384) without and with memory-headroom, and vLLM's own sizing (bf16, cap 0)
    with memory-headroom and measuring only. No MTP, 0.97, graphs up to 128 tokens."""
    spec = stack.SERIES["memory"]
    assert [x for x, _ in spec["items"]] == ["tq16k-cap", "tq16k-headroom", "bf16-8k-headroom", "bf16-8k-vllm"]
    b = {label: boot_of(label) for label, _ in spec["items"]}
    for a in b.values():
        assert (a.config, a.mtp, a.mem, a.max_capture, a.max_model_len) == ("overlay", 0, 0.97, 128, 262144)
    assert {(x.kv, x.mnbt) for x in (b["tq16k-cap"], b["tq16k-headroom"])} == {("turboquant_k8v4", 16384)}
    assert {(x.kv, x.mnbt) for x in (b["bf16-8k-headroom"], b["bf16-8k-vllm"])} == {("auto", 8192)}
    assert b["tq16k-cap"].overlay_env == "VLLM_OVERLAY_MEMORY_HEADROOM=0" and b["tq16k-headroom"].overlay_env is None
    assert shlex.split(b["bf16-8k-vllm"].overlay_env) == ["GENESIS_PROFILE_RUN_CAP_M=0",
                                                         "VLLM_OVERLAY_MEMORY_HEADROOM_DRY_RUN=1"]
    assert stack.CONFIGS["overlay"] == {"GENESIS_PROFILE_RUN_CAP_M": "4096"}  # the 16k pair's cap
    m = parse(["memory", "x", *shlex.split(spec["memory"])])
    assert memory_serve.phase_list(m.phases) == ["longest", "band", "burst", "mixed"]
    assert (m.band_seconds, m.mixed_tokens) == (20, 128)
    assert stack.series_items(spec) == [(x, boot, ("memory",)) for x, boot in spec["items"]]
    assert spec["least_budget_s"] == 100 and "logprobs" not in spec and spec["fallbacks"] == ("headroom",)


def test_only_a_boot_stopped_by_memory_headroom_boots_again() -> None:
    """memory: a boot memory-headroom's forward stopped boots again with the patch off (a finding,
    kept aside); any other failed boot is a result. tq-mtp-steps keeps both second boots."""
    args = ["--config", "overlay", "--max-capture", "128"]
    headroom = "HeadroomError: vllm-overlay memory-headroom: the measuring forward of 16384 tokens failed"
    memory, steps = stack.SERIES["memory"]["fallbacks"], stack.SERIES["tq-mtp-steps"]["fallbacks"]
    assert stack.boot_fallback(args, headroom, memory) == (
        [*args, "--overlay-env", "VLLM_OVERLAY_MEMORY_HEADROOM=0"], "with memory-headroom")
    assert stack.boot_fallback(args, "torch.OutOfMemoryError: CUDA out of memory", memory) is None
    assert stack.boot_fallback(args, "torch.OutOfMemoryError", steps)[1] == "with --max-capture"


def test_the_series_runs_the_memory_step(tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """The queue's "memory" phase with the step itself stood in for (its traffic needs a server; the real
    one runs in the engine test below): it starts only with the series' least budget left, passes the
    series' memory arguments and the budget, goes on after a cut-short run (exit 3) and stops the label
    when done; a step that ends otherwise (the server died) marks the label FAILED and stops it."""
    monkeypatch.setattr(stack, "STATE", str(tmp_path / "state"))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setattr(stack, "REFUSED", {})
    monkeypatch.setattr(stack, "ABORTED", {})
    monkeypatch.setattr(stack, "wait", lambda label, seconds: 0)
    calls: list[list[str]] = []
    answers: list[int] = []

    def dispatch(argv: list[str]) -> int:
        calls.append(argv)
        return answers.pop(0) if argv[0] == "memory" else 0

    monkeypatch.setattr(stack, "dispatch", dispatch)
    spec = stack.SERIES["memory"]

    def served(label: str) -> None:
        os.makedirs(stack.sdir(label))
        stack.save_state(label, {"label": label, "pid": os.getpid(), "port": 1, "config": "overlay", "started": 0,
                                 "healthy_after_s": 1.0, "vllm_args": {}, "series": {"series": "memory"}})

    served("tq16k-headroom")
    rc = stack.main(["series", "memory", "--labels", "tq16k-headroom", "--deadline", "120"])
    assert rc == 10 and calls == [], capsys.readouterr().out  # 120 - 45 s left: below the least budget of 100
    answers[:] = [3, 0]
    rc = stack.main(["series", "memory", "--labels", "tq16k-headroom", "--deadline", "400"])
    assert rc == 0, capsys.readouterr().out
    assert [c[0] for c in calls] == ["memory", "memory", "stop"]
    assert calls[0][1:-2] == ["tq16k-headroom", *shlex.split(spec["memory"])] and calls[0][-2] == "--budget-s"
    assert 340 <= float(calls[0][-1]) <= 355
    assert stack.load_state("tq16k-headroom")["series"] == {"series": "memory", "runner": [], "runner_from": None,
                                                            "memory_rc": 0, "done": True}
    calls.clear()
    served("bf16-8k-vllm")
    answers[:] = [1]
    rc = stack.main(["series", "memory", "--labels", "bf16-8k-vllm", "--deadline", "400", "--memory", "--phases burst"])
    out = capsys.readouterr().out
    assert rc == 0 and "bf16-8k-vllm: FAILED: memory ended with 1 (the server died?)" in out, out
    assert calls == [["memory", "bf16-8k-vllm", "--phases", "burst", "--budget-s", calls[0][-1]], ["stop", "bf16-8k-vllm"]]


def test_bad_phases_are_named() -> None:
    with pytest.raises(SystemExit, match=r"memory --phases 'longest,soak': expected some of longest, band"):
        memory_serve.phase_list("longest,soak")


def test_nvidia_smi_rounds() -> None:
    """`nvidia-smi -lms 200` prints one line per GPU per round; a round ends when a GPU comes again."""
    s = memory_serve.DeviceSampler.__new__(memory_serve.DeviceSampler)
    s.samples, s.total = [], {}

    class Proc:
        stdout = iter(["0, 1000, 143771\n", "1, 2000, 143771\n", "0, 5000, 143771\n", "1, 1500, 143771\n",
                       "garbage\n", "0, 3000, 143771\n"])

    s.proc = Proc()  # type: ignore[assignment]
    s.read()
    assert [b for _, b in s.samples] == [{"0": 1000, "1": 2000}, {"0": 5000, "1": 1500}, {"0": 3000}]
    assert s.total == {"0": 143771, "1": 143771}
    assert s.peak(0, 4e9) == {"0": 5000, "1": 2000}


def test_memory_table() -> None:
    """The BENCHMARKS rows from a merged result (numbers made up for the layout): one row per run, one
    per phase and worker; a run without the patch shows the device and the outcome only."""
    gib = 2**30
    rec = {"profiled_peak": int(2.4 * gib), "measured_peak": int(6 * gib), "moved": int(3.6 * gib), "dry_run": False,
           "kv_tokens_before": 3_000_000, "kv_tokens_after": 2_800_000, "reserved": 80 * gib, "baseline": int(77.6 * gib)}
    win = {"runtime_peak": int(5.5 * gib), "over_budget": int(-0.5 * gib)}
    w = {"window": win, "budget": rec["reserved"] + rec["moved"], "baseline": rec["baseline"]}
    ph = {"requests_ok": 1024, "requests_failed": 0, "server_alive": True, "oom": False, "workers": {"7": w},
          "device_peak_mib": {"0": 130000}, "device_requested_mib": {"0": 139457}, "oom_lines": [], "errors": []}
    dead = {"requests_ok": 0, "requests_failed": 1, "server_alive": False, "oom": True, "workers": {},
            "oom_lines": ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 480.00 MiB"], "errors": []}
    d = {"runs": {
        "on": {"overlay_env": {"GENESIS_PROFILE_RUN_CAP_M": "4096"},
               "memory": {"config": {"mnbt": 16384}, "headroom": {"7": {"records": [rec]}},
                          "phases": {"burst": ph}, "done": True}},
        "cap": {"overlay_env": {"GENESIS_PROFILE_RUN_CAP_M": "4096", "VLLM_OVERLAY_MEMORY_HEADROOM": "0"},
                "memory": {"config": {"mnbt": 16384}, "headroom": {}, "phases": {"longest": dead},
                           "server_died_in": "longest"}},
        "steps-only": {}}}
    lines = make_table.memory_lines(d)
    on = next(x for x in lines if x.startswith("| on | 16384 / 4096 |"))
    assert ("| memory-headroom | 2.400 | 6.000 | 3.600 | 3000000 -> 2800000 | 5.500 (burst) | +0.500 | +0.500 | "
            "served every phase |") in on
    assert any(x.startswith("| cap | 16384 / 4096 | off | - | - | - | - | - | - | - | server died in longest |")
               for x in lines)
    assert "| on | burst | 1024 / 0 | alive | 5.500 | 6.000 | +0.500 | 130000 / 139457 | - |" in lines
    assert any(x.startswith("| cap | longest | 0 / 1 | DEAD, OOM | - | - | - | - | torch.OutOfMemoryError")
               for x in lines)
    assert make_table.memory_lines({"runs": {"x": {}}}) == []


# ---- a real server (CPU build): the series across two device-call-like invocations --------------------


@pytest.mark.engine
def test_memory_series_on_a_real_cpu_server(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`series memory` on the tiny hybrid through `vllm serve` (CPU build, eager, mnbt 2048,
    max_num_seqs 32, max-model-len 8192): the first invocation runs out of its deadline during the
    boot (NOT DONE); the second runs the four phases, each in its own window of memory-headroom's
    watch (dry run: vLLM's KV size), and merge renders the table. The CPU build meters the resident
    set: the numbers check the plumbing only."""
    from test_bench_stack import free_port_block

    env = clean_env(STACK_STATE_DIR=str(tmp_path / "state"), OUT=str(tmp_path / "out"),
                    PYTHONPATH=os.path.join(ROOT, "src"))
    boot = ("--model tiny --mnbt 2048 --max-model-len 8192 --mem 0.3 --additional-config '' "
            "--extra '--max-num-seqs 32 --enforce-eager --no-enable-prefix-caching'")
    cmd = [sys.executable, os.path.join(BENCH, "stack.py"), "series", "memory", "--compact", "--labels",
           "bf16-8k-vllm", "--base-port", str(free_port_block(4)), "--boot-extra", boot,
           "--memory", "--band-seconds 10 --min-band 3 --mixed-tokens 256"]
    try:
        first = subprocess.run([*cmd, "--deadline", "15"], env=env, capture_output=True, text=True, timeout=300)
        assert first.returncode == 10, first.stdout[-3000:] + first.stderr[-3000:]
        second = subprocess.run([*cmd, "--deadline", "400"], env=env, capture_output=True, text=True, timeout=600)
        log = second.stdout[-6000:] + second.stderr[-3000:]
        assert second.returncode == 0 and "series memory: all done" in second.stdout, log
    finally:  # no server outlives the test
        if os.path.exists(tmp_path / "state" / "bf16-8k-vllm" / "state.json"):
            subprocess.run([sys.executable, os.path.join(BENCH, "stack.py"), "stop", "bf16-8k-vllm", "--compact"],
                           env=env, capture_output=True, timeout=120)
    assert sorted(os.listdir(tmp_path / "out")) == ["bf16-8k-vllm.json"]
    b = json.load(open(tmp_path / "out" / "bf16-8k-vllm.json"))
    m = b["files"]["memory.json"]
    assert m["done"] and list(m["phases"]) == ["longest", "band", "burst", "mixed"], log
    (worker,) = m["headroom"].values()
    (rec,) = worker["records"]
    assert rec["dry_run"] is True and rec["tokens"] == 2048 and len(rec["shapes"]) == 4
    assert m["config"]["max_num_seqs"] == 32 and m["config"]["max_num_seqs_source"] == "the worker's report"
    for i, (name, ph) in enumerate(m["phases"].items()):
        assert ph["server_alive"] and ph["requests_failed"] == 0 and not ph["oom"], (name, ph)
        assert ph["open_ack_s"] is not None and ph["close_ack_s"] is not None, (name, ph)
        (w,) = ph["workers"].values()
        assert w["window"]["name"] == name and w["window"]["seq"] == 2 * i + 1 and w["window"]["end"] is not None
        assert w["budget"] == rec["reserved"]  # dry run: vLLM's own reservation
    assert m["phases"]["longest"]["prompt_tokens"] == 8191 and m["phases"]["burst"]["requests_ok"] == 32
    assert m["phases"]["band"]["verdict"] == "PASSED", m["phases"]["band"]
    mixed = m["phases"]["mixed"]
    assert mixed["running_when_long_sent"] >= 27 and mixed["requests_ok"] == 32 and "note" not in mixed, mixed
    assert "would move" in b["logs"]["serve.log"]
    result = tmp_path / "merged.json"
    assert stack.main(["merge", str(result), f"bf16-8k-vllm={tmp_path / 'out' / 'bf16-8k-vllm.json'}"]) == 0
    lines = make_table.memory_lines(json.load(open(result)))
    assert any(x.startswith("| bf16-8k-vllm | 2048 / off | dry run (vLLM's sizing) |") for x in lines)
    assert sum(x.startswith("| bf16-8k-vllm | ") for x in lines) == 5


@pytest.mark.engine
def test_a_server_that_dies_in_a_phase_ends_the_step(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The red path: the server dies during `burst` (the test kills it, after writing the line an
    out-of-memory error would leave in its log: the CPU build cannot run out of device memory); the
    phase records the dead server and that line, later phases are not run, the step exits 1 (the
    series then marks the label FAILED and stops it), and `longest`, measured before, is kept."""
    from test_bench_stack import free_port_block

    monkeypatch.setattr(stack, "STATE", str(tmp_path / "state"))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setenv("STACK_COMPACT", "1")
    monkeypatch.setenv("PYTHONPATH", os.path.join(ROOT, "src"))
    for k in [k for k in os.environ if k.startswith(("VLLM_OVERLAY", "GENESIS_"))]:
        monkeypatch.delenv(k)
    label = "red"
    try:
        assert stack.main(["boot", label, "--config", "overlay", "--model", "tiny", "--kv", "auto", "--mtp", "0",
                           "--mnbt", "2048", "--max-model-len", "8192", "--mem", "0.3", "--additional-config", "",
                           "--port", str(free_port_block(2)), "--wait", "240",
                           "--extra", "--max-num-seqs 32 --enforce-eager --no-enable-prefix-caching"]) == 0
        st = stack.load_state(label)

        def dies(*_args: object) -> dict[str, object]:
            with open(os.path.join(stack.sdir(label), "serve.log"), "a") as f:
                f.write("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB (stand-in)\n")
            os.killpg(st["pid"], 9)
            for _ in range(50):
                if not stack.alive(st["pid"]):
                    break
                time.sleep(0.1)
            return {"requests_ok": 0, "requests_failed": 32, "errors": ["RemoteDisconnected"]}

        monkeypatch.setattr(memory_serve, "burst", dies)
        rc = stack.main(["memory", label, "--phases", "longest,burst,mixed"])
    finally:
        if os.path.exists(tmp_path / "state" / label / "state.json"):
            stack.main(["stop", label])
    assert rc == 1
    m = json.load(open(tmp_path / "state" / label / "memory.json"))
    assert list(m["phases"]) == ["longest", "burst"] and m["server_died_in"] == "burst" and not m["done"]
    burst = m["phases"]["burst"]
    assert not burst["server_alive"] and burst["oom"] and "Tried to allocate 4.00 GiB" in burst["oom_lines"][0]
    assert m["phases"]["longest"]["server_alive"] and not m["phases"]["longest"]["oom"]
    b = json.load(open(tmp_path / "out" / f"{label}.json"))
    assert b["files"]["memory.json"]["server_died_in"] == "burst"
