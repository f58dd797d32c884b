"""Buffers belong to the engine that allocated them: two engines in one process (in-process
engine core), 2048 then 8192; the first is released before the second serves its band."""

from __future__ import annotations

import pytest

from conftest import worker_report

pytestmark = pytest.mark.engine


def test_second_engine_gets_its_own_buffer_and_the_first_is_freed(scenarios) -> None:  # type: ignore[no-untyped-def]
    r = scenarios.run("two-engines-2048-8192", ["--first-mnbt", "2048", "--mnbt", "8192", "--shape", "bug"], {})
    assert r["ok"], r.get("traceback") or r["log"][-3000:]
    assert r["first_rows"] == [2048]
    assert r["first_freed"] == [True], "the released engine's GDN buffer is still alive"
    assert r["second_rows"] == [8192]
    w = worker_report(r["reports"])  # one process: both engines' worker ran here
    # the second engine served its band: the bug report's step of 7820 tokens in one forward
    assert w["telemetry"]["forwards"]["sizes"].get("7820") == 1
    assert w["counters"]["guard_trips"] == 0 and w["counters"]["guard_checks"] >= 1
    first, second = w["buffers"]
    assert (first["rows"], first.get("freed"), second["rows"], second.get("freed")) == (2048, True, 8192, None)
    assert first["engine"] != second["engine"]
    assert second["dtype_source"] == "out_proj.params_dtype"
    assert w["engine_config"]["max_num_batched_tokens"] == 8192  # the live engine, not the released one
