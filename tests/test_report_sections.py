"""The report's sections: each key beyond the process's identity, status and counters is kept by the
module that owns its data (report.SECTIONS), registered with report.section(), reset with the state,
and handed to a forked child as its owner says (no vLLM needed)."""

from __future__ import annotations

import json
import os

import pytest

from forked import in_child
from vllm_overlay import budget, report, telemetry
from vllm_overlay.errors import OverlayError
from vllm_overlay.patches import _runner, forward_telemetry, rank_reports
from vllm_overlay.patches._gdn_buffers import BUFFERS
from vllm_overlay.report import STATE


@pytest.fixture
def state(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("VLLM_OVERLAY_REPORT_DIR", str(tmp_path))
    STATE.reset()
    yield tmp_path
    STATE.reset()


def test_a_section_key_must_be_declared_and_has_one_owner() -> None:
    with pytest.raises(OverlayError, match=r"key='gpu_clocks': not one of SECTIONS \(budgets, buffers, "):
        report.section("gpu_clocks", report.Fields)
    with pytest.raises(OverlayError, match=r"key='buffers': already registered by "
                                           r"vllm_overlay\.patches\._gdn_buffers\.Buffers; one owner per key"):
        report.section("buffers", report.Items)
    assert report.section("budgets", budget.Budgets) is budget.BUDGETS  # the same module, imported again


def test_every_section_is_in_the_json_and_reset_with_the_state(state) -> None:  # type: ignore[no-untyped-def]
    BUFFERS.add({"rows": 64})
    forward_telemetry.ENGINE_CONFIG.replace({"max_num_batched_tokens": 256})
    _runner.RUNNER_REPORT.replace({"kind": "V1", "class": "C"})
    telemetry.TELEMETRY.record(100)
    telemetry.TELEMETRY.record_dummy(256, True)
    rank_reports.RANKS.gathered(2, [], [{"rank": 1, "why": "gone"}])
    rep = json.loads(STATE.snapshot())
    assert rep["buffers"] == [{"rows": 64}] and rep["engine_config"] == {"max_num_batched_tokens": 256}
    assert rep["runner"] == {"kind": "V1", "class": "C"} and rep["ranks"]["missing"] == [{"rank": 1, "why": "gone"}]
    assert rep["telemetry"]["forwards"]["sizes"] == {"100": 1}
    assert rep["telemetry"]["profile_forward_tokens"] == [256]
    STATE.reset()
    rep = STATE.to_json()
    assert "ranks" not in rep  # until an engine core gathered
    assert (rep["buffers"], rep["budgets"], rep["engine_config"], rep["runner"]) == ([], [], {}, {})
    assert rep["telemetry"]["forwards"]["count"] == 0 and rep["telemetry"]["profile_forward_tokens"] == []


def test_a_change_marks_the_report_for_the_flusher(state) -> None:  # type: ignore[no-untyped-def]
    STATE.snapshot()
    assert STATE.dirty is False
    forward_telemetry.ENGINE_CONFIG.note(block_size=16)
    assert STATE.dirty is True and forward_telemetry.ENGINE_CONFIG.get("block_size") == 16


def test_a_step_after_a_gather_is_written(state) -> None:  # type: ignore[no-untyped-def]
    """The engine core's file says a step ran since the gather (its workers' reports are older than
    the file then): the first step after a gather marks the report for the flusher, later ones do not."""
    rank_reports.RANKS.gathered(1, [], [])
    STATE.snapshot()
    rank_reports.RANKS.stepped()
    assert STATE.dirty is True and json.loads(STATE.snapshot())["ranks"]["stepped_since"] is True
    rank_reports.RANKS.stepped()
    assert STATE.dirty is False


def test_a_forked_child_keeps_what_each_owner_says(state) -> None:  # type: ignore[no-untyped-def]
    budget.BUDGETS.add({"purpose": "gdn-output", "value": 64})
    BUFFERS.add({"rows": 64})  # not a buffer the patch's pool holds: its fork handler lists only those
    telemetry.TELEMETRY.record(7)
    _runner.RUNNER_REPORT.replace({"kind": "V1", "class": "C"})
    parent = os.getpid()

    def child() -> dict:  # type: ignore[type-arg]
        rep = STATE.to_json()
        return {k: rep[k] for k in ("budgets", "buffers", "telemetry", "runner")}

    out = in_child(child)
    assert out["budgets"] == [{"purpose": "gdn-output", "value": 64, "inherited_from": parent}]
    assert out["buffers"] == [] and out["runner"] == {} and out["telemetry"]["forwards"]["count"] == 0
    assert STATE.to_json()["budgets"] == [{"purpose": "gdn-output", "value": 64}]  # the parent's unchanged
