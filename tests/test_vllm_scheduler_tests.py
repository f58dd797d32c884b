"""vLLM's own tests/v1/core/test_scheduler.py, run against the installed vLLM without the overlay,
with its default patches and with VLLM_OVERLAY_PREFILL_CHUNK_CLAMP=512, through
scripts/vllm_scheduler_tests.py: every test must pass in all three, but for the declared ones
(EXPECTED_DIFFERENCES) that fail with the clamp exactly as declared. It fetches the vLLM sdist
(about 45 MB) and installs torchvision for the installed torch (about 8 MB, no dependencies) with pip
once, both cached in ~/.cache/vllm-overlay/upstream-tests; three pytest runs of about 15 s each on 2
cores. What is not real: PyPI's torchvision is a CUDA build whose compiled operators cannot load on
the CPU torch, so two of them are declared without a kernel (scripts/upstream_tests_sitecustomize.py)
for torchvision to import; no test runs them."""

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
    assert "DIFFERS " not in text and "NOT AS DECLARED " not in text
    # the case the clamp used to break (chunked prefill off: vLLM schedules one long prompt alone)
    assert "test_schedule_order[False]: stock=passed; default=passed; clamp=passed" in text
    evidence = {n: json.loads((out / f"{n}.overlay.json").read_text()) for n in ("stock", "default", "clamp")}
    assert evidence["stock"]["scheduler_init_wrapped_by"] == []
    assert evidence["clamp"]["scheduler_init_wrapped_by"] == ["prefill-chunk-clamp"]
    assert evidence["clamp"]["clamp"]["set"] > 0 and evidence["clamp"]["clamp"]["stood_aside"] > 0
    assert all(e["revert_problems"] == [] for e in evidence.values())
    # every test passes in every configuration (none fails, errors or is skipped), but for those the
    # clamp changes as declared (vLLM 0.32.0: 208 tests, one of them declared)
    run = _runner()
    totals = {n: re.search(rf"^  {n}: (\d+) tests: (.*)$", text, re.M) for n in evidence}
    declared = {n: sum(1 for config, _ in run.EXPECTED_DIFFERENCES if config == n) for n in evidence}
    for n, m in totals.items():
        assert m, text[-3000:]
        total, failed = int(m.group(1)), declared[n]
        assert m.group(2) == (f"{failed} failed, " if failed else "") + f"{total - failed} passed", m.group(0)
    counts = {int(m.group(1)) for m in totals.values() if m}
    assert len(counts) == 1 and counts.pop() > 100, totals
    # the llava tests ran with torchvision importing, and the fixture from vLLM's own conftest is there
    assert re.search(r"^torchvision \S+ \(.*\) with vLLM ", text, re.M), text[:3000]
    fixture_test = "test_encoder_cache_rejects_mismatched_embed_count"  # takes caplog_vllm
    assert f"{fixture_test}: stock=passed; default=passed; clamp=passed" in text
    assert all(e["torchvision"]["imported"] for e in evidence.values())


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


def test_runner_accepts_a_difference_only_as_declared() -> None:
    run = _runner()
    names = ["stock", "default", "clamp"]
    (config, tid), (message, _) = next(iter(run.EXPECTED_DIFFERENCES.items()))
    other = "tests/v1/core/test_scheduler.py::test_other"

    def results(declared_outcome, other_clamp=("passed", "")):  # type: ignore[no-untyped-def]
        return {n: {tid: declared_outcome if n == config else ("passed", ""),
                    other: other_clamp if n == "clamp" else ("passed", "")} for n in names}

    assert run.compare(results(("failed", message)), names) == {tid: "declared", other: "same"}
    # the declared test passes with the clamp too, or fails otherwise: not as declared
    assert run.compare(results(("passed", "")), names)[tid] == "stale"
    assert run.compare(results(("failed", "assert 1 == 2")), names)[tid] == "stale"
    assert run.compare(results(("error", message)), names)[tid] == "stale"
    # an undeclared test that differs is a difference
    assert run.compare(results(("failed", message), ("failed", message)), names)[other] == "differs"
    # failing alike everywhere (say, no torchvision): the declaration cannot show, nothing differs
    alike = {n: {tid: ("failed", "ModuleNotFoundError")} for n in names}
    assert run.compare(alike, names) == {tid: "same"}
