"""vLLM's own tests/v1/core/test_scheduler.py, run against the installed vLLM without the overlay,
with its default patches and with VLLM_OVERLAY_PREFILL_CHUNK_CLAMP=512, through
scripts/vllm_scheduler_tests.py: every test must have the same outcome in all three. It fetches
the vLLM sdist with pip once (about 45 MB, cached in ~/.cache/vllm-overlay/upstream-tests); three
pytest runs of about 40 s each on 2 cores."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "vllm_scheduler_tests.py")


@pytest.mark.engine
def test_vllm_scheduler_tests_same_outcome_with_and_without_the_overlay(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, SCRIPT, "--out", str(out)], capture_output=True, text=True,
                          timeout=1200, env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")})
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-6000:]
    assert re.search(r"every one of \d+ tests has the same outcome in stock, default, clamp", text), text[-3000:]
    # the case the clamp used to break (chunked prefill off: vLLM schedules one long prompt alone)
    assert "test_schedule_order[False]: stock=passed; default=passed; clamp=passed" in text
    evidence = {n: json.loads((out / f"{n}.overlay.json").read_text()) for n in ("stock", "default", "clamp")}
    assert evidence["stock"]["scheduler_init_wrapped_by"] == []
    assert evidence["clamp"]["scheduler_init_wrapped_by"] == ["prefill-chunk-clamp"]
    assert evidence["clamp"]["clamp"]["set"] > 0 and evidence["clamp"]["clamp"]["stood_aside"] > 0
    assert all(e["revert_problems"] == [] for e in evidence.values())
    passed = {n: int(re.search(rf"  {n}: \d+ tests: .*?(\d+) passed", text).group(1))  # type: ignore[union-attr]
              for n in evidence}
    assert len(set(passed.values())) == 1 and passed["stock"] > 100, passed


def _runner():  # type: ignore[no-untyped-def]
    import importlib.util

    spec = importlib.util.spec_from_file_location("vllm_scheduler_tests", SCRIPT)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def _evidence(path, **fields) -> None:  # type: ignore[no-untyped-def]
    base = {"registered": True, "patches_at_start": {}, "scheduler_init_wrapped_by": [],
            "clamp": {"set": 0, "stood_aside": 0, "kept_users": 0}, "revert_problems": []}
    path.write_text(json.dumps({**base, **fields}))


def test_runner_refuses_evidence_that_does_not_match_the_configuration(tmp_path) -> None:  # type: ignore[no-untyped-def]
    run = _runner()
    _evidence(tmp_path / "stock.overlay.json", patches_at_start={"compile-cache-key": "applied"})
    _evidence(tmp_path / "clamp.overlay.json", patches_at_start={"prefill-chunk-clamp": "applied"},
              scheduler_init_wrapped_by=["prefill-chunk-clamp"])  # applied, never fired
    _evidence(tmp_path / "default.overlay.json", registered=False)
    assert "VLLM_OVERLAY=0, yet compile-cache-key in place" in run.check_evidence("stock", str(tmp_path))[0]
    assert "applied but never set a threshold" in run.check_evidence("clamp", str(tmp_path))[0]
    assert "register() did not run" in run.check_evidence("default", str(tmp_path))[0]
    _evidence(tmp_path / "clamp.overlay.json", patches_at_start={"prefill-chunk-clamp": "applied"},
              scheduler_init_wrapped_by=["prefill-chunk-clamp"], clamp={"set": 3})
    assert run.check_evidence("clamp", str(tmp_path)) == []


def test_runner_reads_every_outcome_from_junit_xml(tmp_path) -> None:  # type: ignore[no-untyped-def]
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.v1.core.test_scheduler" name="test_a[False]"/>'
        '<testcase classname="tests.v1.core.test_scheduler" name="test_b">'
        '<failure message="assert 2 == 1&#10;more">tb</failure></testcase>'
        '<testcase classname="tests.v1.core.test_scheduler" name="test_c"><error message="no fixture"/></testcase>'
        '<testcase classname="tests.v1.core.test_scheduler" name="test_d"><skipped message="cuda"/></testcase>'
        '</testsuite></testsuites>')
    assert _runner().outcomes(str(xml)) == {
        "tests/v1/core/test_scheduler.py::test_a[False]": ("passed", ""),
        "tests/v1/core/test_scheduler.py::test_b": ("failed", "assert 2 == 1 more"),
        "tests/v1/core/test_scheduler.py::test_c": ("error", "no fixture"),
        "tests/v1/core/test_scheduler.py::test_d": ("skipped", "cuda"),
    }
