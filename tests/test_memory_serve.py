"""bench/memory_serve.py (`bench/stack.py memory`) against a real `vllm serve` of the CPU build with the
tiny hybrid: every phase sends its traffic and records memory-headroom's window from the worker's
report; a second step against the same server opens windows after the ones the worker holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STACK = [sys.executable, os.path.join(ROOT, "bench", "stack.py")]
pytestmark = pytest.mark.engine


def test_memory_phases_on_a_cpu_server(tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = {**os.environ, "STACK_STATE_DIR": str(tmp_path / "state"), "OUT": str(tmp_path / "out"),
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}

    def stack(*argv: str, timeout: float = 600) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
        return subprocess.run([*STACK, *argv], env=env, capture_output=True, text=True, timeout=timeout)

    boot = stack("boot", "mem", "--model", "tiny", "--config", "overlay", "--kv", "auto", "--mtp", "0", "--mnbt", "2048",
                 "--max-model-len", "4096", "--port", "8143", "--max-num-seqs", "16", "--mem", "0.3",
                 "--extra=--enforce-eager", "--wait", "600")
    try:
        assert boot.returncode == 0, boot.stdout[-3000:] + boot.stderr[-3000:]
        p = stack("memory", "mem", "--phases", "longest,band,burst,mixed", "--band-seconds", "5", "--min-band", "1",
                  "--mixed-tokens", "32")
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        d = json.load(open(tmp_path / "state" / "mem" / "memory.json"))
        assert d["done"] and d["config"]["max_num_seqs"] == 16 and d["config"]["max_num_seqs_source"] == "the worker's report"
        ph = d["phases"]
        assert [ph[n]["seq"] for n in ("longest", "band", "burst", "mixed")] == [1, 3, 5, 7]
        assert ph["longest"]["prompt_tokens"] == 4095 and ph["burst"]["prompts"] == 16 and ph["mixed"]["streams"] == 15
        for name, x in ph.items():
            assert x["requests_failed"] == 0 and x["requests_ok"] >= 1 and x["server_alive"] and not x["oom"], (name, x)
            (w,) = x["workers"].values()
            assert w["window"]["name"] == name and w["meter"] == "resident set (VmRSS / VmHWM)" and w["whole_process"]
        rec = d["headroom"][next(iter(d["headroom"]))]["records"][0]
        assert rec["kv_tokens_after"] <= rec["kv_tokens_before"] and not rec["dry_run"]
        # the CPU meter's excess over the reservation is said as the whole process's, never as the forwards'
        assert "OVER budget" not in p.stdout and p.stdout.count("worker runtime peak") == 4
        again = stack("memory", "mem", "--phases", "burst", "--out", "again")
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        assert json.load(open(tmp_path / "state" / "mem" / "again.json"))["phases"]["burst"]["seq"] == 9
    finally:
        stack("stop", "mem", timeout=120)


def test_a_phase_names_each_process_peak_on_the_device() -> None:
    """The device sampler's per-process figures (nvidia-smi --query-compute-apps, stood in here: the CPU
    build has no nvidia-smi) give each worker its highest in the phase, and the phase line says it beside
    the allocator's reserved peak; a worker without them keeps the line it had."""
    from bench import memory_serve  # the project root is on the tests' path (pyproject.toml)

    s = memory_serve.DeviceSampler.__new__(memory_serve.DeviceSampler)
    s.apps = [(10.0, memory_serve.parse_apps("3921, 30112\n4000, 512\n[N/A], [N/A]\n")),
              (11.0, {3921: 31200}), (20.0, {3921: 33000})]
    assert s.process_peaks(9.5, 11.5) == {3921: 31200, 4000: 512}
    g = 2**30
    worker = {"window": {"runtime_peak": 5.193 * g, "over_budget": -0.181 * g, "reserved_peak": 30 * g},
              "driver_peak_mib": 31200}
    assert memory_serve.peak_words(worker) == (
        "; worker runtime peak 5.193 GiB, under budget by 0.181 GiB (on the device the process peaked at "
        "31200 MiB, its allocator's reserved peak 30720 MiB)")
    del worker["driver_peak_mib"]
    assert memory_serve.peak_words(worker) == "; worker runtime peak 5.193 GiB, under budget by 0.181 GiB"
