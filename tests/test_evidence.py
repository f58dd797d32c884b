"""No path reports "applied" or "checked" without evidence (no vLLM engine needed)."""

from __future__ import annotations

import gc
import pytest

from vllm_overlay import budget
from vllm_overlay.errors import CapacityError
from vllm_overlay.patches import gdn_output_prealloc as gdn
from vllm_overlay.patches._gdn_buffers import BUFFERS
from vllm_overlay.report import STATE


@pytest.fixture
def pool(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("VLLM_OVERLAY_REPORT_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET", "64")
    monkeypatch.setattr(budget, "current_vllm_config", lambda: None)
    STATE.reset()
    gdn.on_revert()
    yield
    gdn.on_revert()
    STATE.reset()


class _Layer:
    """Stands in for a GDN layer's geometry (a real one needs a vLLM config and a model)."""

    num_v_heads, tp_size, head_v_dim = 2, 1, 4


def _layer() -> _Layer:
    return _Layer()


def test_unreadable_token_count_is_counted_and_named(pool, caplog) -> None:  # type: ignore[no-untyped-def]
    layer = _layer()
    gdn._attach(layer)
    with caplog.at_level("WARNING", logger="vllm_overlay"):
        gdn.check(None, "forward")
        gdn.check(None, "forward")
    assert STATE.counters["guard_unreadable"] == 2 and STATE.counters["guard_checks"] == 0
    named = [m for m in caplog.messages if "could not read the token count of a forward" in m]
    assert len(named) == 1 and "guard_unreadable" in named[0]
    assert any("guard_unreadable" in e for e in STATE.events)
    gdn.check(64, "forward")
    with pytest.raises(CapacityError, match="65 tokens exceeds the GDN output buffer of 64 rows"):
        gdn.check(65, "forward")
    assert STATE.counters["guard_checks"] == 2 and STATE.counters["guard_trips"] == 1


def test_buffer_is_freed_with_its_layers(pool) -> None:  # type: ignore[no-untyped-def]
    layers = [_layer(), _layer()]
    for layer in layers:
        gdn._attach(layer)
    assert gdn.capacity() == 64 and BUFFERS[0]["layers"] == 2
    assert BUFFERS[0]["dtype_source"] == "torch default dtype"
    del layers, layer
    gc.collect()
    assert gdn.capacity() is None and BUFFERS[0]["freed"] is True


def test_rewritten_allocation_falls_back_to_stock_without_a_buffer() -> None:
    """The replacement text of the GDN rewrite, run as-is: a layer with the overlay's buffer gets
    a zeroed slice of it; a layer built without the overlay's __init__ gets stock's torch.zeros."""
    import textwrap

    import torch

    body = textwrap.indent(gdn._SLICE.format(i=""), "    ")
    ns: dict = {"torch": torch}
    exec("def alloc(self, hidden_states, num_tokens):\n" + body + "    return core_attn_out\n", ns)  # noqa: S102
    assert gdn._SLICE.count("\n") == gdn._ZEROS.count("\n")  # line numbers after the edit unchanged
    hidden = torch.ones(3, 8, dtype=torch.float64)
    bare = _Layer()  # no buffer
    out = ns["alloc"](bare, hidden, 3)
    assert out.shape == (3, 2, 4) and out.dtype == torch.float64 and not out.any()
    with_buf = _Layer()
    buf = torch.ones(5, 2, 4)
    object.__setattr__(with_buf, gdn.ATTR, buf)
    out = ns["alloc"](with_buf, hidden, 3)
    assert out.data_ptr() == buf.data_ptr() and not buf[:3].any() and buf[3:].all()
