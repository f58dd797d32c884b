"""Every source rewrite against the installed vLLM 0.32.0 and, textually, against the sources of
the vLLM 0.20.2 wheel (downloaded once into ~/.cache/vllm-overlay/wheels; never committed), by
the support matrix's sweep (matrix.sweep, what `vllm-overlay verify` runs)."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_overlay import sources
from vllm_overlay.tools import matrix, wheels
from vllm_overlay.errors import AnchorError
from vllm_overlay.mechanisms import rewrite
from vllm_overlay.spec import Rewrite


def rewrite_checks(version: str, read: sources.Reader) -> list[matrix.Check]:
    return [c for c in matrix.sweep(version, read) if c.what == "rewrite"]


def rewrites(version: str) -> list[tuple[str, Rewrite]]:
    return [(spec.id, rw) for spec in matrix.specs() for rw in spec.rewrites_for(version)]


def test_installed_0_32_0_anchors_and_hashes() -> None:
    checks = rewrite_checks("0.32.0", sources.installed_reader())
    assert len(checks) == 2 and all(c.ok for c in checks), [c.detail for c in checks]


@pytest.fixture(scope="module")
def wheel_0_20_2() -> str:
    return wheels.fetch_vllm_wheel("0.20.2")


def test_0_20_2_wheel_anchors_and_hashes(wheel_0_20_2: str) -> None:
    read = sources.wheel_reader(wheel_0_20_2)
    checks = rewrite_checks("0.20.2", read)
    assert [c.patch_id for c in checks] == ["gdn-output-prealloc", "hybrid-turboquant", "hybrid-turboquant"]
    assert all(c.ok for c in checks), [c.detail for c in checks]
    new = {str(rw.target): rewrite.check_text(rw, read(rw.path)) for _, rw in rewrites("0.20.2")}
    for text in new.values():
        compile(text, "<check>", "exec")
    # the rewritten 0.20.2 forward slices the layer's buffer, and keeps stock's allocation only for
    # a layer without one (built without the overlay's __init__)
    gdn = new["vllm.model_executor.layers.mamba.gdn_linear_attn:GatedDeltaNetAttention.forward_cuda"]
    assert "getattr(self, '_vllm_overlay_gdn_out', None)" in gdn and "core_attn_out[:num_tokens].zero_()" in gdn
    assert "core_attn_out = torch.zeros(" not in gdn and "if core_attn_out is None:" in gdn and "new_zeros(" in gdn
    # the hybrid refusal is gone; the planner asks the overlay for TurboQuant's packed page
    args = new["vllm.engine.arg_utils:EngineArgs.create_engine_config"]
    assert "not supported for hybrid" not in args and "boundary_skip_layers(model_config, num_layers)" in args
    plan = new["vllm.platforms.interface:Platform._align_hybrid_block_size"]
    assert "attention_page_bytes_per_token(vllm_config, attn_page_size_1_token)" in plan
    assert plan.startswith("def _align_hybrid_block_size(")  # rebound as a classmethod by apply()


def test_drift_is_detected() -> None:
    read = sources.installed_reader()
    (pid, rw), *_ = rewrites("0.32.0")
    text = read(rw.path)
    with pytest.raises(AnchorError, match="hash mismatch"):
        rewrite.check_text(dataclasses.replace(rw, sha256="f" * 64), text)
    doubled = dataclasses.replace(rw, sha256=rewrite.sha256(rewrite.locate(text, rw.target.qualname, "x").source),
                                  edits=(dataclasses.replace(rw.edits[0], anchor="core_attn_out"),))
    with pytest.raises(AnchorError, match="occurs [0-9]+ times"):
        rewrite.check_text(doubled, text)
