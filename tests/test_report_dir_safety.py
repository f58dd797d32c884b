"""Nothing in a report directory can hang, blind or fool a reader: files that are not regular
(a FIFO, a link to /dev/zero), a 50 MB file, reports of processes that are gone, two live servers
under one hand-set server id; the default directory per user and owner-only; no secret of the
command line or the environment in a report; one WARNING per cause of a failing write. Real
processes and files throughout (no engine: these are the overlay's own readers and writer)."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import time

import pytest

from conftest import PY, clean_env
from test_cli import BIN
from vllm_overlay import metrics, report_files, reports, server_id, settings
from vllm_overlay.tools.stress import metrics_text


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def plant(directory, sid: str) -> list[str]:  # type: ignore[no-untyped-def]
    """A FIFO, a link to /dev/zero and a 50 MB (sparse) file, each named like a report of ``sid``."""
    key = server_id.file_key(sid)
    names = [report_files.name(key, n, f"{n:08x}") for n in (1, 2, 3)]
    os.mkfifo(os.path.join(directory, names[0]))
    os.symlink("/dev/zero", os.path.join(directory, names[1]))
    with open(os.path.join(directory, names[2]), "wb") as f:
        f.truncate(50 * 2**20)
    return names


def plant_dead(directory, sid: str, n: int) -> None:  # type: ignore[no-untyped-def]
    """``n`` engine-core reports of processes that are gone, written now (after any reader started)."""
    pid, host, key = dead_pid(), socket.gethostname(), server_id.file_key(sid)
    for i in range(n):
        rep = {"pid": pid, "instance": f"{i:08x}", "host": host, "server_id": sid, "role": "engine core",
               "written": time.time(), "started": time.time() - 10, "patches": {}, "counts": {}}
        with open(os.path.join(directory, report_files.name(key, pid, f"{i:08x}")), "w") as f:
            json.dump(rep, f)


def live_report(directory, sid: str, pid: int, tree: str, sizes: dict[int, int]) -> None:  # type: ignore[no-untyped-def]
    rep = {"pid": pid, "instance": f"{pid:08x}", "host": socket.gethostname(), "server_id": sid,
           "server_tree": tree, "role": "engine core + worker rank 0", "tp_rank": 0, "written": time.time(),
           "started": time.time(), "counters": {"guard_checks": 1, "guard_trips": 0},
           "patches": {"forward-telemetry": {"status": "applied"}},
           "engine_config": {"max_num_batched_tokens": 4096, "max_model_len": 8192, "max_num_seqs": 32},
           "telemetry": {"forwards": {"sizes": {str(k): v for k, v in sizes.items()}}}}
    with open(os.path.join(directory, report_files.name(server_id.file_key(sid), pid, rep["instance"])), "w") as f:
        json.dump(rep, f)


def test_read_opens_regular_files_only_and_never_blocks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    fifo, zero, big = (str(tmp_path / n) for n in plant(tmp_path, "srv"))
    t0 = time.monotonic()
    for path, why in ((fifo, "a FIFO"), (zero, "a symbolic link"), (big, "over the")):
        with pytest.raises(report_files.Unreadable, match=why):
            report_files.read(path)
    assert time.monotonic() - t0 < 2
    # a FIFO swapped in after the lstat check is seen on the open descriptor (O_NONBLOCK: no hang)
    st = os.lstat(fifo)
    with pytest.raises(report_files.Unreadable, match="a FIFO"):
        report_files.check_entry(st)


def test_the_collector_skips_each_bad_file_once_and_leaves_out_gone_processes(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    from prometheus_client import CollectorRegistry, generate_latest

    live_report(tmp_path, "srv", os.getpid(), "h:1:1:00000000", {1500: 2})
    names = plant(tmp_path, "srv")
    plant_dead(tmp_path, "srv", 2000)
    collector = metrics.OverlayCollector(str(tmp_path), "srv")
    collector.cache = metrics.ReportCache(live=True)  # the serving side's cache
    reg = CollectorRegistry()
    reg.register(collector)
    for _ in range(3):
        t0 = time.monotonic()
        text = generate_latest(reg).decode()
        assert time.monotonic() - t0 < 10
    s = metrics_text.parse(text)
    assert s.band(1024, 2048) == 2 and s.servers == 1
    assert 'vllm_overlay_processes{role="engine core + worker rank 0"} 1.0' in text
    assert 'role="engine core"' not in text and "vllm_overlay_reports_gone 2000.0" in text
    for name in names:
        assert f'file="{name}"' in text
    warned = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(warned) == 3, warned  # one per file, not one per scrape


def test_report_doctor_and_plan_finish_with_a_fifo_in_the_directory(tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = tmp_path / "reports"
    d.mkdir()
    names = plant(d, "srv")
    os.mkfifo(d / "overlay-0123456789ab-7-00000000.json")  # another server's key: `report` reads every file
    env = clean_env(VLLM_OVERLAY_REPORT_DIR=str(d))
    p = subprocess.run([BIN, "report", str(d)], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 1 and "no overlay-*.json report" in p.stdout, p.stdout + p.stderr
    for name in names:
        assert f"skipped {d / name}: not a report" in p.stdout, p.stdout
    for cmd in ("doctor", "plan"):
        p = subprocess.run([BIN, cmd], capture_output=True, text=True, timeout=120, env=env)
        assert p.returncode in (0, 1) and "Traceback" not in p.stderr, (cmd, p.stdout, p.stderr)


# ---- the default report directory -----------------------------------------------------------


@pytest.fixture
def tmpdir_default(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = settings.value("VLLM_OVERLAY_REPORT_DIR", {})
    assert path == str(tmp_path / f"vllm-overlay-reports-{os.geteuid()}")
    return path


def test_the_default_directory_is_created_owner_only(tmpdir_default) -> None:  # type: ignore[no-untyped-def]
    assert settings.startup_problems({}) == []  # missing: created at start-up
    report_files.prepare(tmpdir_default, default=True)
    assert stat.S_IMODE(os.lstat(tmpdir_default).st_mode) == 0o700


@pytest.mark.parametrize(("make", "why"), [
    (lambda p: (os.mkdir(p), os.chmod(p, 0o777)), "is writable by others (mode 0777"),
    (lambda p: (os.mkdir(p + "-target"), os.symlink(p + "-target", p)), "is a symbolic link"),
    (lambda p: (os.mkdir(p, 0o700), os.chown(p, 54321, 54321)), "is owned by uid 54321, not by this user"),
])
def test_an_unsafe_default_directory_is_refused_with_one_line(tmpdir_default, make, why: str) -> None:  # type: ignore[no-untyped-def]
    if "owned" in why and os.geteuid() != 0:
        pytest.skip("making a directory of another user needs root")
    make(tmpdir_default)
    (line,) = settings.startup_problems({})
    assert line.startswith(f"VLLM_OVERLAY_REPORT_DIR unset: its default {tmpdir_default} {why}"), line
    assert line.endswith("set VLLM_OVERLAY_REPORT_DIR to a directory of your own")
    with pytest.raises(ValueError, match="the report directory"):
        report_files.prepare(tmpdir_default, default=True)


def test_start_up_refuses_an_unsafe_default_directory(tmp_path) -> None:  # type: ignore[no-untyped-def]
    target = tmp_path / "elsewhere"
    target.mkdir()
    os.symlink(target, tmp_path / f"vllm-overlay-reports-{os.geteuid()}")
    env = clean_env(TMPDIR=str(tmp_path))
    env.pop("VLLM_OVERLAY_REPORT_DIR", None)  # the default directory
    p = subprocess.run([PY, "-c", "from vllm_overlay import core; core.register()"], capture_output=True,
                       text=True, timeout=120, env=env)
    assert p.returncode != 0 and "is a symbolic link" in p.stderr and "VLLM_OVERLAY_REPORT_DIR" in p.stderr
    assert os.listdir(target) == []  # nothing written or pruned through the link


# ---- a server id shared by two live servers --------------------------------------------------


def test_two_live_servers_under_one_id_are_said_and_not_judged(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    from prometheus_client import CollectorRegistry, generate_latest

    from standin_server import StandIn
    from test_stress_server_checks import execute

    other = subprocess.Popen(["sleep", "120"])  # the other server's engine core: a live process
    try:
        live_report(tmp_path, "shared", os.getpid(), "hostA:100:1:aaaaaaaa", {3000: 20})
        live_report(tmp_path, "shared", other.pid, "hostB:200:1:bbbbbbbb", {3000: 20})
        trees = reports.scan_server(str(tmp_path), "shared")
        assert sorted(trees) == ["hostA:100:1:aaaaaaaa", "hostB:200:1:bbbbbbbb"]
        reg = CollectorRegistry()
        reg.register(metrics.OverlayCollector(str(tmp_path), "shared"))
        text = generate_latest(reg).decode()
        generate_latest(reg)
        assert "vllm_overlay_server_id_servers 2.0" in text
        warned = [r.getMessage() for r in caplog.records if "live servers" in r.getMessage()]
        assert len(warned) == 1 and "VLLM_OVERLAY_SERVER_ID=shared is used by 2 live servers" in warned[0]
        s = StandIn()
        try:
            s.metrics_from = (str(tmp_path), "shared")  # /metrics says 2: refused before traffic
            result, out = execute(tmp_path / "m", url=s.url, requests=4)
            assert result["exit_code"] == 2 and "shared by several live servers" in result["why"], out
            result, out = execute(tmp_path / "r", url=s.url, requests=4, report_dir=str(tmp_path),
                                  server_id="shared")  # the reports say so too
            assert result["exit_code"] == 2 and "is used by 2 live servers" in result["why"], out
            assert s.completions == 0
        finally:
            s.close()
    finally:
        other.kill()
        other.wait()


def test_a_main_process_makes_its_own_tree_and_its_children_inherit_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = (
        "import multiprocessing as mp, os\n"
        "from vllm_overlay import server_id\n"
        "def child(q):\n"
        "    q.put(server_id.ensure_tree())\n"
        "if __name__ == '__main__':\n"
        "    mine = server_id.ensure_tree()\n"
        "    q = mp.get_context('spawn').Queue()\n"
        "    p = mp.get_context('spawn').Process(target=child, args=(q,)); p.start(); p.join()\n"
        "    print(mine, q.get(), server_id.ensure_tree())\n")
    f = tmp_path / "tree.py"
    f.write_text(script)
    inherited = "launcher:1:1:00000000"
    p = subprocess.run([PY, str(f)], capture_output=True, text=True, timeout=120,
                       env=clean_env(VLLM_OVERLAY_SERVER_ID="hand-set", VLLM_OVERLAY_SERVER_TREE=inherited))
    mine, childs, again = p.stdout.split()
    assert mine != inherited and childs == mine == again, p.stdout + p.stderr


# ---- what a report holds, and how a failing write is said ------------------------------------


def test_no_secret_of_argv_or_the_environment_reaches_a_report(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = ("import sys\n"
              "sys.argv = ['/usr/bin/vllm', 'serve', '/models/m', '--api-key', 'sk-argv-1', '--token=sk-argv-2']\n"
              "from vllm_overlay import core, flush\n"
              "core.register()\n"
              "print(flush())\n")
    p = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=120,
                       env=clean_env(VLLM_OVERLAY_REPORT_DIR=str(tmp_path), VLLM_API_KEY="sk-env-3",
                                     HF_TOKEN="sk-env-4"))
    assert p.returncode == 0, p.stderr[-3000:]
    text = open(p.stdout.split()[-1]).read()
    assert "sk-" not in text
    assert json.loads(text)["argv"] == ["vllm", "serve", "--api-key", "--token"]


def test_a_write_failing_with_a_new_temporary_name_each_time_warns_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # the report's own name is a directory: each os.replace fails naming a new random temporary file
    script = ("import os, time\n"
              "from vllm_overlay import core, flush\n"
              "from vllm_overlay.report import STATE\n"
              "from vllm_overlay.telemetry import TELEMETRY\n"
              "os.makedirs(STATE.report_path())\n"
              "core.register()\n"
              "for i in range(5):\n"
              "    TELEMETRY.record(10 + i); flush()\n"
              "print(STATE.write_failures)\n")
    p = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=120,
                       env=clean_env(VLLM_OVERLAY_REPORT_DIR=str(tmp_path), VLLM_OVERLAY_SERVER_ID="srv"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert int(p.stdout.split()[-1]) >= 6
    warnings = [ln for ln in p.stderr.splitlines() if "could not write the report" in ln]
    assert len(warnings) == 1, warnings
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
