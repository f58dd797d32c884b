"""output.py: tables on a wide terminal, plain lines anywhere else; identifiers never broken."""

from __future__ import annotations

import io
import subprocess
import sys

from conftest import clean_env
from vllm_overlay.tools.output import NO_RICH as NO_RICH_LINE
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


# Without the tools extra: rich is made unimportable in a fresh process (a finder placed first refuses
# it; this machine has rich installed, so its absence is the one thing simulated here).
NO_RICH = "import sys\nclass NoRich:\n    def find_spec(self, name, path=None, target=None):\n" \
          "        if name == 'rich' or name.startswith('rich.'):\n" \
          "            raise ModuleNotFoundError(\"No module named 'rich'\", name='rich')\n" \
          "sys.meta_path.insert(0, NoRich())\n"


def _no_rich(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", NO_RICH + code, *args], env=clean_env(), capture_output=True,
                          text=True, timeout=300)


def test_without_rich_tables_are_plain_lines_and_a_terminal_is_told_once() -> None:
    r = _no_rich(
        "import io\nfrom vllm_overlay.tools.output import Out\nfrom vllm_overlay.tools.progress import Ticker\n"
        "buf = io.StringIO()\nout = Out(buf, force_plain=False)\n"
        "out.table('plan', ('patch', 'decision'), [['gdn-output-prealloc', 'would apply']])\n"
        "out.heading('settings')\nout.line('done', 'ok')\n"
        "with Ticker(out, 2) as t:\n    t.advance(); t.advance()\n"
        "print(buf.getvalue(), end='')\nprint('rich' in sys.modules)\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[:4] == ["plan:", "  gdn-output-prealloc: decision=would apply", "== settings ==",
                                         "done"]
    assert r.stdout.splitlines()[-1] == "False"
    assert r.stderr.splitlines() == [NO_RICH_LINE]


def test_without_rich_a_pipe_gets_no_hint() -> None:
    r = _no_rich("import io\nfrom vllm_overlay.tools.output import Out\nOut(io.StringIO()).table('t', ('a',), [['x']])\n")
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_without_rich_the_command_runs() -> None:
    r = _no_rich("from vllm_overlay.tools.cli.main import main\nsys.exit(main(sys.argv[1:]))\n", "plan")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "compile-cache-key" in r.stdout and "Traceback" not in r.stderr
