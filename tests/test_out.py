"""output.py: tables on a wide terminal, plain lines anywhere else; identifiers never broken."""

from __future__ import annotations

import io

from vllm_overlay.output import Out

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


def test_a_long_word_in_a_wrapped_column_is_never_cut() -> None:
    """rich narrows the widest columns of a table wider than the terminal below their longest word and
    folds it: `report`'s patch table cut a setting name in its reason column at 100-103 columns."""
    reason = "off by default (set VLLM_OVERLAY_PREFILL_CHUNK_CLAMP to turn it on)"
    rows = [["prefill-chunk-clamp", "off", "api server, engine core, worker rank 0", reason],
            ["turboquant-v1-kv-shape", "upstream-merged", "api server, engine core, worker rank 0",
             "vLLM 0.32.0: each turboquant_ dtype has a KVQuantMode of its own, which the attention layer's spec "
             "carries, so V1 shapes TurboQuant layers with their real dtype"]]
    for width in range(60, 201):
        buf = io.StringIO()
        out = Out(buf, force_plain=False)
        out.console.width = width
        out.table("patches (per process)", ("patch", "status", "processes", "reason"), rows, ids=(0, 1))
        text = buf.getvalue()
        assert "VLLM_OVERLAY_PREFILL_CHUNK_CLAMP" in text and "turboquant-v1-kv-shape" in text, (width, text)
        if "│" in text:  # a table (else plain lines, one per row, never wrapped by us)
            assert all(len(line) <= width for line in text.splitlines()), width
