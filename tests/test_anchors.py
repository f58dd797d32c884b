"""Every source rewrite against the installed vLLM 0.32.0 and, textually, against the sources of
the vLLM 0.20.2 wheel (downloaded once into ~/.cache/vllm-overlay/wheels; never committed)."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_overlay import anchors, wheels
from vllm_overlay.errors import AnchorError
from vllm_overlay.mechanisms import rewrite


def test_installed_0_32_0_anchors_and_hashes() -> None:
    checks = anchors.check("0.32.0", anchors.installed_reader())
    assert len(checks) == 2 and all(c.ok for c in checks), [c.detail for c in checks]


@pytest.fixture(scope="module")
def wheel_0_20_2() -> str:
    return wheels.fetch_vllm_wheel("0.20.2")


def test_0_20_2_wheel_anchors_and_hashes(wheel_0_20_2: str) -> None:
    checks = anchors.check("0.20.2", anchors.wheel_reader(wheel_0_20_2))
    assert len(checks) == 1 and all(c.ok for c in checks), [c.detail for c in checks]
    # the rewritten 0.20.2 forward compiles and slices the shared buffer
    rw = checks[0].rw
    new = rewrite.check_text(rw, anchors.wheel_reader(wheel_0_20_2)(rw.path))
    compile(new, "<check>", "exec")
    assert "self._vllm_overlay_gdn_out[:num_tokens]" in new and "torch.zeros(" not in new


def test_drift_is_detected() -> None:
    read = anchors.installed_reader()
    (pid, rw), *_ = list(anchors.all_rewrites("0.32.0"))
    text = read(rw.path)
    with pytest.raises(AnchorError, match="hash mismatch"):
        rewrite.check_text(dataclasses.replace(rw, sha256="f" * 64), text)
    doubled = dataclasses.replace(rw, sha256=rewrite.sha256(rewrite.locate(text, rw.target.qualname, "x").source),
                                  edits=(dataclasses.replace(rw.edits[0], anchor="core_attn_out"),))
    with pytest.raises(AnchorError, match="occurs [0-9]+ times"):
        rewrite.check_text(doubled, text)
