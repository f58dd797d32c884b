"""Server mode against what a real `vllm serve` cannot be made to do on purpose: another server's
reports in the same directory, nothing listening, junk on /metrics, no model, a server that dies
after the warm-up, an engine that stalls while /health still answers. A stand-in HTTP server
(tests/standin_server.py) plays the server; /metrics is the overlay's real collector over a report
directory. Each case ends with one line, its own exit code and a stress.json that says why."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from conftest import clean_env
from standin_server import StandIn
from test_cli import BIN
from vllm_overlay import report_files, server_id
from vllm_overlay.tools.output import Out
from vllm_overlay.tools.stress import run, server


@pytest.fixture
def standin() -> Iterator[StandIn]:
    s = StandIn()
    try:
        yield s
    finally:
        s.close()


def write_report(directory, sid: str, pid: int, sizes: dict[int, int], **engine_config: int) -> str:  # type: ignore[no-untyped-def]
    rep = {"pid": pid, "instance": f"{pid:08x}", "server_id": sid, "role": "engine core + worker rank 0",
           "tp_rank": 0, "written": time.time(), "counters": {"guard_checks": 1, "guard_trips": 0},
           "buffers": [], "patches": {"forward-telemetry": {"status": "applied"}},
           "engine_config": {"max_num_batched_tokens": 4096, "max_model_len": 8192, "max_num_seqs": 32,
                             **engine_config},
           "telemetry": {"forwards": {"sizes": {str(k): v for k, v in sizes.items()}}}}
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, report_files.name(server_id.file_key(sid), pid, rep["instance"]))
    with open(path + ".tmp", "w") as f:
        json.dump(rep, f)
    os.replace(path + ".tmp", path)
    return path


def execute(tmp_path, **opts) -> tuple[dict, str]:  # type: ignore[no-untyped-def, type-arg]
    buf = io.StringIO()
    result = run.execute(run.Options(out=str(tmp_path / "out"), **opts), Out(file=buf, force_plain=True))
    saved = json.load(open(tmp_path / "out" / "stress.json"))
    assert saved["verdict"] == result["verdict"] and saved["why"] == result["why"]
    return result, buf.getvalue()


def test_another_servers_reports_are_not_counted(standin, tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = str(tmp_path / "reports")
    mine = write_report(d, "srv-mine", 11, {100: 1}, profile_run_cap=1024)
    lock = threading.Lock()
    counts = {"mine": 0, "other": 0}

    def serve(_body: dict) -> None:  # type: ignore[type-arg]
        # the driven server never reaches the band; another server in the same directory does
        with lock:
            counts["mine"] += 1
            counts["other"] += 1
            write_report(d, "srv-mine", 11, {100: counts["mine"]}, profile_run_cap=1024)
            write_report(d, "srv-other", 11, {3000: counts["other"]})

    standin.metrics_from = (d, "srv-mine")
    standin.on_completion = serve
    result, text = execute(tmp_path, url=standin.url, report_dir=d, requests=4, min_band_forwards=10)
    assert result["exit_code"] == 3 and result["verdict"] == "DID NOT TEST", text
    assert result["band"] == [1024, 4096]  # the server's own cap, from its reports
    assert result["band_forwards"] == 0 and result["worker_reports"] == [mine]
    assert result["server_id"] == "srv-mine"
    other = [n for n in result["reports_not_counted"] if n.get("server_id") == "srv-other"]
    assert len(other) == 1 and "not counted: 1 report(s)" in text and "(server id srv-other)" in text


def test_reports_that_cannot_be_tied_are_refused(standin, tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = str(tmp_path / "reports")
    write_report(d, "srv-mine", 11, {100: 1})
    standin.metrics = (200, "")  # a server whose /metrics has no overlay series: no server id
    result, text = execute(tmp_path, url=standin.url, report_dir=d, requests=4)
    assert result["exit_code"] == 2 and "cannot tie the reports" in result["why"] and "--server-id" in text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_nothing_listening_is_unreachable_on_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out"
    p = subprocess.run([BIN, "stress", "--url", f"http://127.0.0.1:{free_port()}", "--out", str(out)],
                       capture_output=True, text=True, timeout=60, env=clean_env())
    assert p.returncode == 4, p.stdout + p.stderr
    assert "Traceback" not in p.stdout + p.stderr and "max_num_batched_tokens" not in p.stdout
    assert "UNREACHABLE: nothing answers at http://127.0.0.1:" in p.stdout
    assert json.load(open(out / "stress.json"))["verdict"] == "UNREACHABLE"


def test_a_port_out_of_range_is_bad_usage(tmp_path) -> None:  # type: ignore[no-untyped-def]
    result, _ = execute(tmp_path, url="http://127.0.0.1:99999")
    assert result["exit_code"] == 2 and "port is not an integer in [1, 65535]" in result["why"]


@pytest.mark.parametrize(("route", "answer", "why"), [
    ("metrics", (200, "<html><body>a proxy</body></html>"), "GET /metrics is not Prometheus text"),
    ("metrics", (200, "junk junk junk"), "GET /metrics is not Prometheus text"),
    ("models", (404, {"detail": "Not Found"}), "GET /v1/models answered HTTP 404"),
    ("models", (200, {"data": []}), "serves no model"),
    ("models", (200, "<html>login</html>"), "did not answer an OpenAI model list"),
])
def test_not_a_vllm_server_is_unreachable(standin, tmp_path, route: str, answer, why: str) -> None:  # type: ignore[no-untyped-def]
    setattr(standin, route, answer)
    result, text = execute(tmp_path, url=standin.url, engine_args={"max_num_batched_tokens": 2048,
                                                                   "max_model_len": 8192, "max_num_seqs": 32})
    assert result["exit_code"] == 4 and why in result["why"], text
    assert standin.completions == 0  # before any traffic


def test_a_server_that_dies_after_the_warm_up_is_unreachable(standin, tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = str(tmp_path / "reports")
    write_report(d, "srv", 11, {100: 1})
    standin.metrics_from = (d, "srv")  # telemetry from /metrics: scraped again after the warm-up
    prefills: list[int] = []
    plan_k = 2  # band (2048, 4096]: 2 prefills a wave

    def serve(body: dict) -> None:  # type: ignore[type-arg]
        if len(body["prompt"]) > 64:
            prefills.append(1)
            if len(prefills) == plan_k:  # the warm-up wave: the server goes away just after it
                threading.Timer(0.3, standin.close).start()

    standin.on_completion = serve
    result, text = execute(tmp_path, url=standin.url, requests=8)
    # it went away (connections refused): unreachable, as docs/stress.md says, not a failed engine
    assert result["exit_code"] == 4 and result["verdict"] == "UNREACHABLE", text
    assert "went away during the run: server is down" in result["why"], result["why"]
    assert "Traceback" not in text


def test_a_stalled_engine_ends_within_duration_and_grace(standin, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(server, "GRACE_S", 1.0)
    d = str(tmp_path / "reports")
    write_report(d, "srv", 11, {100: 1})
    standin.metrics_from = (d, "srv")
    standin.completion = "hang"  # /health and /metrics answer; no completion ever does
    t0 = time.monotonic()
    result, text = execute(tmp_path, url=standin.url, duration=1.0)
    wall = time.monotonic() - t0
    assert result["exit_code"] == 4 and "stopped answering" in result["why"], text
    assert "--duration 1 s + 1 s grace" in result["why"]
    assert wall < 1.0 + 1.0 + 8.0, wall  # plus the final telemetry read (2.5 s)


def test_a_server_that_trickles_its_answer_is_cut_off_before_traffic(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from vllm_overlay.tools.stress import target

    monkeypatch.setattr(target, "PREFLIGHT_S", 3.0)
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(4)
    stop = threading.Event()

    def trickle() -> None:  # one byte every 0.5 s: each read answers well within any per-read timeout
        conn, _ = lsock.accept()
        with conn:
            for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 100000:
                if stop.wait(0.5):
                    return
                try:
                    conn.sendall(bytes([byte]))
                except OSError:
                    return

    threading.Thread(target=trickle, daemon=True).start()
    t0 = time.monotonic()
    try:
        result, text = execute(tmp_path, url=f"http://127.0.0.1:{lsock.getsockname()[1]}", requests=4)
    finally:
        stop.set()
        lsock.close()
    assert time.monotonic() - t0 < 3.0 + 5.0
    assert result["exit_code"] == 4 and "completely within the 3 s" in result["why"], text


def test_a_server_with_an_api_key_is_driven_with_it(standin, tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = str(tmp_path / "reports")
    write_report(d, "srv", 11, {100: 1})
    standin.metrics_from = (d, "srv")
    standin.api_key = "sk-test-1"
    result, text = execute(tmp_path, url=standin.url, requests=4)  # no key: refused before traffic
    assert result["exit_code"] == 2 and "HTTP 401" in result["why"] and "--api-key KEY or set VLLM_API_KEY" in text
    assert standin.completions == 0
    p = subprocess.run([BIN, "stress", "--url", standin.url, "--requests", "4", "--out", str(tmp_path / "k")],
                       capture_output=True, text=True, timeout=300, env={**clean_env(), "VLLM_API_KEY": "sk-test-1"})
    saved = json.load(open(tmp_path / "k" / "stress.json"))
    assert p.returncode == 3 and saved["verdict"] == "DID NOT TEST", p.stdout[-3000:]  # driven; the band not reached
    assert standin.completions > 0 and "sk-test-1" not in open(tmp_path / "k" / "stress.json").read()
