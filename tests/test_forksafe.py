"""Fork-safe module state and consistent reports (no vLLM needed).

vLLM forks workers; a lock held by another thread at fork time stays held forever in the child,
and a cache copied into the child describes the parent. After fork every lock is new, the
budget cache is the child's own, inherited budgets and buffers are marked as inherited, and a
report is a snapshot taken under the lock."""

from __future__ import annotations

import json
import os
import threading
import time
from types import SimpleNamespace

import pytest

from forked import in_child
from vllm_overlay import budget, core, report
from vllm_overlay.mechanisms import wrap as wrapmech
from vllm_overlay.patches import gdn_output_prealloc as gdn
from vllm_overlay.report import STATE
from vllm_overlay.telemetry import TELEMETRY


@pytest.fixture
def state(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("VLLM_OVERLAY_REPORT_DIR", str(tmp_path))
    STATE.reset()
    with budget._seen_lock:
        budget._seen.clear()
    yield tmp_path
    STATE.reset()
    with budget._seen_lock:
        budget._seen.clear()


def _locks() -> dict[str, object]:
    return {"STATE.lock": STATE.lock, "budget._seen_lock": budget._seen_lock, "gdn._lock": gdn._lock,
            "core._LOCK": core._LOCK, "wrap._HOOK_LOCK": wrapmech._HOOK_LOCK,
            "report._flusher_lock": report._flusher_lock}


def test_every_lock_is_new_after_fork_even_when_held(state) -> None:  # type: ignore[no-untyped-def]
    held, release = threading.Event(), threading.Event()
    locks = _locks()

    def holder() -> None:
        for lk in locks.values():
            lk.acquire()  # type: ignore[attr-defined]
        held.set()
        release.wait(30)
        for lk in locks.values():
            lk.release()  # type: ignore[attr-defined]

    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(10)
    try:
        def child() -> dict:
            now = _locks()
            out = {}
            for name, lk in now.items():
                got = lk.acquire(timeout=2)  # type: ignore[attr-defined]
                out[name] = {"new": lk is not locks[name], "acquired": got}
                if got:
                    lk.release()  # type: ignore[attr-defined]
            return out

        result = in_child(child)
    finally:
        release.set()
        t.join()
    assert result == {name: {"new": True, "acquired": True} for name in locks}, result


def test_child_has_its_own_budget_cache_and_marks_inherited_entries(state, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET", "3000")
    cfg = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=2048, max_num_seqs=8),
                          speculative_config=None)
    budget.resolve("gdn-output", vllm_config=cfg)
    parent = os.getpid()
    STATE.count("guard_checks", 5)

    def child() -> dict:
        before = [dict(b) for b in budget.BUDGETS.items]
        budget.resolve("gdn-output", vllm_config=cfg)  # resolved again here: recorded again
        return {"forked_from": STATE.forked_from, "pid": STATE.pid, "before": before,
                "after": budget.BUDGETS.items, "guard_checks": STATE.counters["guard_checks"]}

    out = in_child(child)
    assert out["forked_from"] == parent and out["pid"] != parent
    assert [b["inherited_from"] for b in out["before"]] == [parent]
    assert out["before"][0]["value"] == 3000
    assert len(out["after"]) == 2 and "inherited_from" not in out["after"][1]
    assert out["guard_checks"] == 0  # the child's counters are its own
    assert len(budget.BUDGETS) == 1 and "inherited_from" not in budget.BUDGETS[0]


def test_report_is_a_snapshot_under_the_lock(state) -> None:  # type: ignore[no-untyped-def]
    """A writer races with updates that add keys to dicts and items to lists: every write
    succeeds (no 'dictionary changed size during iteration') and every file is valid JSON."""
    stop = threading.Event()
    warnings: list[str] = []
    orig = report.LOG.warning
    report.LOG.warning = lambda *a, **k: warnings.append(str(a))  # type: ignore[method-assign]

    def updater() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            STATE.set_patch(f"p{i % 500}", "applied", detail=i)
            STATE.count(f"c{i % 500}")
            STATE.event(f"e{i}")
            TELEMETRY.record(i % 9000 + 1)

    t = threading.Thread(target=updater)
    t.start()
    try:
        deadline, writes = time.monotonic() + 2.0, 0
        while time.monotonic() < deadline or writes < 5:
            writes += 1
            path = STATE.write()
            assert path is not None
            json.load(open(path))
    finally:
        stop.set()
        t.join()
        report.LOG.warning = orig  # type: ignore[method-assign]
    assert warnings == []


def test_update_during_write_is_not_lost(state, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``dirty`` is cleared with the snapshot, so an update that lands while the file is being
    written marks the state dirty again (the flusher writes it next)."""
    real = report.tempfile.mkstemp

    def mkstemp(*a, **k):  # type: ignore[no-untyped-def]
        STATE.count("guard_checks")  # an update after the snapshot, before the file is in place
        return real(*a, **k)

    monkeypatch.setattr(report.tempfile, "mkstemp", mkstemp)
    STATE.count("guard_trips")
    assert STATE.write() is not None
    assert STATE.dirty is True
    monkeypatch.setattr(report.tempfile, "mkstemp", real)
    path = STATE.write()
    assert STATE.dirty is False
    assert json.load(open(path))["counters"]["guard_checks"] == 1  # type: ignore[arg-type]
