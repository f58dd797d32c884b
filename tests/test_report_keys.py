"""Report files are keyed by server and process: two servers sharing one directory (two PID
namespaces, two servers started by one launcher) never overwrite or mix each other's reports.
The second server is an overlay process without an engine (tests/overlay_process.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest

from conftest import PY, clean_env, load_reports
from vllm_overlay import metrics, report_files, server_id
from vllm_overlay.tools.stress import metrics_text

HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "overlay_process.py")


def overlay_process(tmp_path, name: str, *args: str, prefix: list[str] | None = None, **env: str) -> dict:  # type: ignore[no-untyped-def, type-arg]
    out = tmp_path / f"{name}.json"
    subprocess.run([*(prefix or []), PY, HELPER, str(out), *args], check=True, timeout=120,
                   env=clean_env(VLLM_OVERLAY_REPORT_DIR=str(tmp_path / "reports"), **env))
    return json.loads(out.read_text())


def _pid_namespaces() -> bool:
    if not shutil.which("unshare"):
        return False
    p = subprocess.run(["unshare", "-pf", "sh", "-c", "echo $$"], capture_output=True, text=True, timeout=30)
    return p.returncode == 0 and p.stdout.strip() == "1"


@pytest.mark.skipif(not _pid_namespaces(), reason="cannot create a PID namespace here (unshare -pf)")
def test_same_pid_in_two_pid_namespaces_writes_two_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    a = overlay_process(tmp_path, "a", "--forward", "1500:3", prefix=["unshare", "-pf"])
    b = overlay_process(tmp_path, "b", "--forward", "1500:5", prefix=["unshare", "-pf"])
    assert a["pid"] == b["pid"] == 1  # each is pid 1 in its own namespace
    assert a["report"] != b["report"] and a["server_id"] != b["server_id"]
    reports = load_reports(str(tmp_path / "reports"))
    assert sorted(r["telemetry"]["forwards"]["sizes"]["1500"] for r in reports) == [3, 5]
    for who, n in ((a, 3), (b, 5)):  # each server's /metrics counts its own forwards only
        s = metrics_text.parse(_exposition(str(tmp_path / "reports"), who["server_id"]))
        assert s.band(1024, 2048) == n


def test_a_launcher_with_the_plugin_loaded_gives_each_server_its_own_id(tmp_path) -> None:  # type: ignore[no-untyped-def]
    launcher = overlay_process(tmp_path, "launcher", "--children", "2", "--mp-child")
    ids = {launcher["server_id"], *(c["server_id"] for c in launcher["children"])}
    assert len(ids) == 3, ids  # the launcher and each server it started: three ids
    # a process vLLM starts with multiprocessing (engine core, worker, extra API server) inherits
    assert launcher["mp_child"]["server_id"] == launcher["server_id"]
    names = {os.path.basename(p) for p in (launcher["report"], *(c["report"] for c in launcher["children"]),
                                          launcher["mp_child"]["report"])}
    assert len(names) == 4
    for c in launcher["children"]:
        assert os.path.basename(c["report"]).startswith(f"overlay-{server_id.file_key(c['server_id'])}-")


def test_an_id_set_by_hand_is_kept(tmp_path) -> None:  # type: ignore[no-untyped-def]
    a = overlay_process(tmp_path, "a", VLLM_OVERLAY_SERVER_ID="my-server")
    assert a["server_id"] == "my-server"
    # an id of the overlay's own form made by a process that is gone: a new program replaces it
    b = overlay_process(tmp_path, "b", VLLM_OVERLAY_SERVER_ID="host:1:1700000000:0123abcd")
    assert b["server_id"] != "host:1:1700000000:0123abcd"


def test_instance_differs_per_process_state(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from vllm_overlay.report import ProcessState

    monkeypatch.setenv("VLLM_OVERLAY_REPORT_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_OVERLAY_SERVER_ID", "srv")
    one, two = ProcessState(), ProcessState()  # the same pid, as in two PID namespaces
    assert one.report_path() != two.report_path()
    assert os.path.basename(one.report_path()).startswith(f"overlay-{server_id.file_key('srv')}-{os.getpid()}-")


def test_prune_removes_only_old_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    now = time.time()
    old, fresh, tmp_old, other = (tmp_path / n for n in ("overlay-1.json", "overlay-2.json",
                                                          ".overlay-x.tmp", "notes.txt"))
    for f in (old, fresh, tmp_old, other):
        f.write_text("{}")
    day_ago = now - report_files.PRUNE_AFTER_S - 10
    for f in (old, tmp_old, other):
        os.utime(f, (day_ago, day_ago))
    removed = report_files.prune(str(tmp_path), now)
    assert sorted(os.path.basename(p) for p in removed) == [".overlay-x.tmp", "overlay-1.json"]
    assert fresh.exists() and other.exists()


def _exposition(directory: str, server: str) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    reg = CollectorRegistry()
    reg.register(metrics.OverlayCollector(directory, server))
    return generate_latest(reg).decode()


def test_collector_opens_only_its_own_servers_files(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    mine = overlay_process(tmp_path, "mine", "--forward", "1500:2")
    directory = str(tmp_path / "reports")
    for i in range(300):  # stale files of other servers: never opened
        (tmp_path / "reports" / f"overlay-{i:012x}-{i}-00000000.json").write_text("[]")
    opened: list[str] = []
    real_read = report_files.read

    def spy(path, *a, **k):  # type: ignore[no-untyped-def]
        opened.append(str(path))
        return real_read(path, *a, **k)

    monkeypatch.setattr(report_files, "read", spy)  # every reader opens a report through it
    s = metrics_text.parse(_exposition(directory, mine["server_id"]))
    assert s.band(1024, 2048) == 2
    assert [p for p in opened if p.startswith(directory)] == [mine["report"]]


def test_prune_keeps_the_directory_bounded_without_touching_live_files(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Past MAX_FILES report files, the oldest of those nobody wrote for 2 h go (restarts within a day);
    files written within that time (a live process rewrites hourly) stay whatever their number."""
    monkeypatch.setattr(report_files, "MAX_FILES", 4)
    now = time.time()
    for i in range(8):  # 3 h + i min old: idle
        f = tmp_path / f"overlay-aaaaaaaaaaaa-{i}-00000000.json"
        f.write_text("{}")
        t = now - 3 * 3600 - 60 * i
        os.utime(f, (t, t))
    for i in range(3):  # written 10 minutes ago: live
        f = tmp_path / f"overlay-bbbbbbbbbbbb-{i}-00000000.json"
        f.write_text("{}")
        os.utime(f, (now - 600, now - 600))
    removed = report_files.prune(str(tmp_path), now)
    assert sorted(int(os.path.basename(p).split("-")[2]) for p in removed) == [1, 2, 3, 4, 5, 6, 7]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert len(left) == 4 and all(f"overlay-bbbbbbbbbbbb-{i}-00000000.json" in left for i in range(3))


def test_an_earlier_servers_files_under_the_same_id_are_not_counted(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Two boots under one hand-set VLLM_OVERLAY_SERVER_ID share the file key: the serving collector
    leaves out a report of this host whose process is gone, whenever it was written (before this
    process started or after), and keeps one whose process runs and one from another host; a reader
    given a directory (a post-mortem) keeps them all."""
    import socket

    probe = subprocess.Popen(["true"])  # a pid that no longer runs
    probe.wait()
    dead_pid = probe.pid
    directory = tmp_path / "reports"
    directory.mkdir()
    key = server_id.file_key("srv")
    base = {"server_id": "srv", "role": "engine core", "patches": {}, "counts": {}, "written": time.time() - 3600}
    rows = {"old": {**base, "pid": dead_pid, "host": socket.gethostname(), "instance": "a"},
            "live": {**base, "pid": os.getpid(), "host": socket.gethostname(), "instance": "b"},
            "remote": {**base, "pid": dead_pid, "host": "another-host", "instance": "c"},
            "late": {**base, "pid": dead_pid, "host": socket.gethostname(), "instance": "d", "written": time.time()}}
    for n, rep in rows.items():
        (directory / f"overlay-{key}-{rep['pid']}-{rep['instance']}{n}.json").write_text(json.dumps(rep))
    serving = metrics.ReportCache(live=True)
    assert sorted(r["instance"] for r in serving.reports(str(directory), "srv")) == ["b", "c"]
    assert serving.gone == 2
    assert sorted(r["instance"] for r in metrics.ReportCache().reports(str(directory), "srv")) == ["a", "b", "c", "d"]
