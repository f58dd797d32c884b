"""output.py: tables on a wide terminal, plain lines anywhere else; identifiers never broken."""

from __future__ import annotations

import io

from vllm_overlay.tools.output import Out

LONG_ID = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn:QwenGatedDeltaNetAttention.forward_cuda"


def test_plain_lines_when_not_a_terminal() -> None:
    buf = io.StringIO()
    Out(buf).table("plan", ("patch", "decision", "targets"), [["gdn-output-prealloc", "would apply", LONG_ID]],
                   ids=(0, 2))
    assert buf.getvalue().splitlines() == ["plan:", f"  gdn-output-prealloc: decision=would apply; targets={LONG_ID}"]


def test_terminal_too_narrow_for_the_identifiers_falls_back_to_plain_lines() -> None:
    buf = io.StringIO()
    out = Out(buf, force_plain=False)  # as on a terminal; rich gives a StringIO 80 columns
    out.table("plan", ("patch", "targets"), [["gdn-output-prealloc", LONG_ID]], ids=(0, 1))
    assert f"  gdn-output-prealloc: targets={LONG_ID}" in buf.getvalue().splitlines()


def test_table_on_a_wide_enough_terminal_keeps_identifiers_whole() -> None:
    buf = io.StringIO()
    out = Out(buf, force_plain=False)
    out.table("settings", ("setting", "value"), [["VLLM_OVERLAY_PROFILE_RUN_CAP", "4096"]])
    text = buf.getvalue()
    assert "VLLM_OVERLAY_PROFILE_RUN_CAP" in text and "│" in text  # a real table, the name whole


def test_markup_like_values_are_printed_as_is() -> None:
    buf = io.StringIO()
    Out(buf).line("accepted: an integer in [0, 1048576] [red]not markup[/]", "error")
    assert buf.getvalue() == "accepted: an integer in [0, 1048576] [red]not markup[/]\n"
