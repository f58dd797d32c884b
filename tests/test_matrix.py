"""The support matrix: every release x every patch from the specs' data, proved by the sweep
against real vLLM wheels (0.20.2, 0.26.0 and 0.33.0, downloaded once into
~/.cache/vllm-overlay/wheels, and every other release's wheel already in that cache)."""

from __future__ import annotations

import glob
import importlib
import os
import subprocess
import sys

import pytest

from vllm_overlay import core, sources, versions
from vllm_overlay.tools import matrix, wheels
from vllm_overlay.tools.cli import plan
from vllm_overlay.mechanisms import rewrite
from vllm_overlay.registry import PATCH_MODULES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALWAYS = ("0.20.2", "0.26.0", "0.33.0")


def _cached() -> list[str]:
    have = {wheels.version_of(w) for w in glob.glob(os.path.join(wheels.CACHE, "vllm-*.whl"))}
    return [v for v in versions.RELEASES if v in have]


SWEPT = sorted(set(ALWAYS) | set(_cached()), key=versions.RELEASES.index)


def test_every_release_and_patch_has_a_status_and_a_reason() -> None:
    for v in versions.RELEASES:
        for c in matrix.cells(v):
            # no release is left "unsupported" (not checked): each row says what the patch does there
            assert c.status in ("applies", "upstream-merged", "not-needed"), (v, c)
            assert c.reason


def test_every_wrapper_bound_by_a_spec_is_a_function_of_its_module() -> None:
    for name in PATCH_MODULES:
        mod = importlib.import_module(name)
        for t in mod.SPEC.targets:
            if t.wrapper is not None:
                assert getattr(mod, t.wrapper_name, None) is t.wrapper, (mod.SPEC.id, str(t), t.wrapper_name)


@pytest.mark.parametrize("version", SWEPT)
def test_sweep_against_the_release_wheel(version: str) -> None:
    read = sources.wheel_reader(wheels.fetch_vllm_wheel(version))
    checks = matrix.sweep(version, read)
    assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]
    # every applying patch had its targets looked at, and the GDN rewrite leaves no per-forward zeros
    kinds = {(c.patch_id, c.what) for c in checks}
    assert ("gdn-output-prealloc", "rewrite") in kinds and ("forward-telemetry", "target") in kinds
    for rw in core_spec("gdn-output-prealloc").rewrites_for(version):
        new = rewrite.check_text(rw, read(rw.path))
        compile(new, "<check>", "exec")
        assert "core_attn_out = torch.zeros(" not in new and "core_attn_out[:num_tokens].zero_()" in new


def core_spec(pid: str):  # type: ignore[no-untyped-def]
    return next(s for s in core.specs() if s.id == pid)


def test_sweep_catches_a_drifted_hash_and_a_missing_target() -> None:
    read = sources.wheel_reader(wheels.fetch_vllm_wheel("0.33.0"))
    assert all(c.ok for c in matrix.sweep("0.33.0", read))
    # 0.20.2's sources read as if they were 0.33.0: the layer moved and the hashes differ
    bad = [c for c in matrix.sweep("0.33.0", sources.wheel_reader(wheels.fetch_vllm_wheel("0.20.2"))) if not c.ok]
    details = " ".join(c.detail for c in bad)
    assert "QwenGatedDeltaNetAttention" in details or "qwen_gdn_linear_attn" in details
    assert any(c.what == "proof" for c in bad)  # 0.20.2 still refuses TurboQuant on hybrids


def test_propose_for_a_new_release() -> None:
    read = sources.wheel_reader(wheels.fetch_vllm_wheel("0.34.0"))
    lines = matrix.propose("0.35.0", read)
    text = "\n".join(lines)
    assert "versions.RELEASES: add '0.35.0'" in text
    assert ("gdn-output-prealloc: rewrite QwenGatedDeltaNetAttention.forward_cuda in "
            "vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py: add '0.35.0': "
            "'f862cdd031514498a931ada9f6931b5a1fe517e3f4fe22823bf466fc85002cf2', (unchanged)") in text
    for spec in matrix.specs():
        assert any(ln.startswith(f"{spec.id}: ") and "extend Support(" in ln for ln in lines), spec.id
    # sources where the latest edits do not fit: the proposal says so instead of guessing
    moved = "\n".join(matrix.propose("0.35.0", sources.wheel_reader(wheels.fetch_vllm_wheel("0.20.2"))))
    assert "rewrite QwenGatedDeltaNetAttention.forward_cuda: MISSING" in moved and "do not add 0.35.0" in moved
    assert "hybrid-turboquant: upstream-merged on 0.34.0; its proofs DO NOT hold on 0.35.0" in moved
    older = "\n".join(matrix.propose("0.35.0", sources.wheel_reader(wheels.fetch_vllm_wheel("0.33.0"))))
    assert "forward_cuda in vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py: sha256 " in older
    assert "DRIFT with the edits of 0.34.0: " in older and "still contains 'core_attn_out = torch.zeros('" in older


def test_decode_gemv_proof_reads_the_cuda_dispatch() -> None:
    """decode-gemv installs wherever UnquantizedLinearMethod has _gemm_impl; it acts only where CUDA's
    dispatch returns the function it replaces. 0.34.0's dispatch returns cuda_unquantized_gemm: the 0.33.0
    row's proofs must fail there (they did not check the dispatch before), and a proposal made from
    sources whose dispatch is not the one the newest row expects names the patch as a problem."""
    new = sources.wheel_reader(wheels.fetch_vllm_wheel("0.34.0"))
    old = sources.wheel_reader(wheels.fetch_vllm_wheel("0.33.0"))
    spec = core_spec("decode-gemv")
    row = spec.support_for("0.33.0")
    failing = [p for p in row.proof if (p.text in new(p.path)) != p.present]
    assert [p.path for p in failing] == ["model_executor/layers/utils.py"], failing
    assert "return default_unquantized_gemm" in failing[0].text
    assert all((p.text in old(p.path)) == p.present for p in row.proof)
    # 0.34.0's sources with 0.33.0's dispatch: every target is there, but the patch would install and not act
    mixed = lambda path: old(path) if path == "model_executor/layers/utils.py" else new(path)  # noqa: E731
    lines = [ln for ln in matrix.propose("0.35.0", mixed) if ln.startswith("decode-gemv: ")]
    assert any("return cuda_unquantized_gemm" in ln and "DOES NOT hold" in ln for ln in lines), lines
    assert "problem(s): do not add 0.35.0" in lines[-1]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "60", "PYTHONPATH": os.path.join(ROOT, "src")}
    return subprocess.run([sys.executable, "-m", "vllm_overlay", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_matrix_command_prints_whole_lines() -> None:
    p = _cli("matrix")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines == matrix.plain_lines()
    assert len(lines) == len(versions.RELEASES) * len(matrix.specs())
    assert all(ln.split()[0] in versions.RELEASES for ln in lines)  # narrow COLUMNS: nothing wrapped
    assert any(ln.startswith("0.22.0  hybrid-turboquant") and "upstream-merged" in ln for ln in lines)


def test_verify_one_release_from_the_cache() -> None:
    wheels.fetch_vllm_wheel("0.26.0")
    p = _cli("verify", "--version", "0.26.0", "--quiet")
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip().splitlines()[-1].startswith("vLLM 0.26.0 (")
    assert p.stdout.strip().endswith("ok, 0 failed")


def test_verify_a_release_not_in_the_matrix_fails(tmp_path) -> None:  # type: ignore[no-untyped-def]
    src = wheels.fetch_vllm_wheel("0.33.0")
    fake = tmp_path / "vllm-0.35.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    os.symlink(src, fake)
    p = _cli("verify", "--wheel", str(fake))
    assert p.returncode == 1 and "vLLM 0.35.0" in p.stdout and "not in the support matrix" in p.stdout


def test_plan_names_a_release_not_in_the_matrix(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(versions, "installed_vllm", lambda: versions.Installed("vllm", "0.21.0", "cuda"))
    monkeypatch.setenv("COLUMNS", "300")
    assert plan.run(type("A", (), {"ledger": False})()) == 0
    out = capsys.readouterr().out
    assert "every patch skipped: vLLM 0.21.0 is left out of the support matrix: " in " ".join(out.split())


def test_readme_tables_are_generated() -> None:
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "readme_tables.py"), "--check"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr + r.stdout


def test_a_patch_module_with_its_own_install_is_refused(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """What is installed comes from SPEC alone: a module-level install() would be ignored, so it is an error."""
    from vllm_overlay.errors import OverlayError
    from vllm_overlay.patches import forward_telemetry

    monkeypatch.setattr(forward_telemetry, "install", lambda *a: [], raising=False)
    with pytest.raises(OverlayError, match="forward_telemetry defines install"):
        core.specs()


def test_specs_name_only_declared_settings() -> None:
    from vllm_overlay import settings

    for spec in matrix.specs():
        for name in (*spec.settings, *([spec.enabled_by] if spec.enabled_by else [])):
            assert name in settings.BY_NAME, (spec.id, name)
