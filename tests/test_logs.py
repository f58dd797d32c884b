"""The overlay's logging leaves everyone else's configuration alone (no vLLM needed). A private
logger tree stands in for root (pytest attaches its own handlers to the real root logger)."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from vllm_overlay import logs


@pytest.fixture
def tree(monkeypatch) -> Iterator[tuple[logging.Logger, logging.Logger, pytest.MonkeyPatch]]:  # type: ignore[no-untyped-def]
    """(top, ours, monkeypatch): ``top`` plays root, with no handler, as in a vLLM worker (vLLM
    configures only its own 'vllm' logger)."""
    top = logging.getLogger("vo_logs_top")
    ours = logging.getLogger("vo_logs_top.overlay")
    top.propagate = False  # the chain ends here, like at root
    for lg in (top, ours):
        lg.handlers.clear()
        lg.setLevel(logging.NOTSET)
    yield top, ours, monkeypatch
    for lg in (top, ours):
        lg.handlers.clear()


def _begin(top: logging.Logger, monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    """In the test body: pytest re-attaches its capture handler to non-propagating loggers and
    swaps sys.stderr for each test phase."""
    top.handlers.clear()
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    return err


def test_unconfigured_process_gets_our_fallback_line(tree) -> None:  # type: ignore[no-untyped-def]
    top, ours, monkeypatch = tree
    err = _begin(top, monkeypatch)
    logs.setup(ours)
    logs.setup(ours)  # idempotent
    assert len(ours.handlers) == 1 and ours.propagate is True and ours.level == logging.INFO
    ours.info("hello")
    assert "[vllm-overlay] hello" in err.getvalue()
    assert top.handlers == []  # nobody else's logger was touched


def test_a_handler_configured_later_takes_over_without_duplicates(tree) -> None:  # type: ignore[no-untyped-def]
    top, ours, monkeypatch = tree
    err = _begin(top, monkeypatch)
    logs.setup(ours)
    theirs = io.StringIO()
    top.addHandler(logging.StreamHandler(theirs))  # the user's basicConfig, after the plugin loaded
    ours.warning("once")
    assert theirs.getvalue().count("once") == 1 and "once" not in err.getvalue()


def test_configured_logging_is_used_as_is(tree) -> None:  # type: ignore[no-untyped-def]
    top, ours, monkeypatch = tree
    err = _begin(top, monkeypatch)
    theirs = io.StringIO()
    top.addHandler(logging.StreamHandler(theirs))
    ours.setLevel(logging.WARNING)  # a level the user chose is kept
    logs.setup(ours)
    assert ours.handlers == [] and ours.level == logging.WARNING
    ours.info("quiet")
    ours.warning("loud")
    assert "loud" in theirs.getvalue() and "quiet" not in theirs.getvalue() and err.getvalue() == ""


def test_vllm_and_root_loggers_are_left_alone() -> None:
    vllm_logger, root = logging.getLogger("vllm"), logging.getLogger()
    before = (vllm_logger.handlers[:], vllm_logger.propagate, vllm_logger.level, root.handlers[:], root.level)
    logs.setup()
    assert (vllm_logger.handlers, vllm_logger.propagate, vllm_logger.level, root.handlers, root.level) == before
    assert logs.LOG.propagate is True


def test_the_summary_names_what_each_armed_patch_waits_for(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An armed patch in a process that never imports its module (hybrid-turboquant's engine-config
    target in a worker) is named with the module, so the count is never an unexplained number."""
    from vllm_overlay import report

    monkeypatch.setenv("VLLM_OVERLAY_REPORT_DIR", str(tmp_path))
    st = report.ProcessState()
    st.set_patch("gdn-output-prealloc", "applied")
    st.set_patch("hybrid-turboquant", "armed", pending_modules=["vllm.engine.arg_utils"])
    lines: list[str] = []
    monkeypatch.setattr(report.LOG, "info", lambda fmt, *a: lines.append(fmt % a))
    st.log_summary()
    assert ("1 applied, 1 armed (module not imported yet: hybrid-turboquant waits for vllm.engine.arg_utils), "
            "0 skipped") in lines[0]
    st.set_patch("hybrid-turboquant", "applied")
    st.log_summary()
    assert "2 applied, 0 armed (module not imported yet), 0 skipped" in lines[1]


def test_the_implicit_default_handler_above_does_not_change_our_format(tree) -> None:  # type: ignore[no-untyped-def]
    """Python's logging.debug() on an unconfigured root adds a bare BASIC_FORMAT stderr handler (vLLM's CPU
    MoE check does it in every worker, after the plugin loaded): our lines keep our format, once."""
    top, ours, monkeypatch = tree
    err = _begin(top, monkeypatch)
    logs.setup(ours)
    bare = logging.StreamHandler()  # what basicConfig() adds: stderr, BASIC_FORMAT
    bare.setFormatter(logging.Formatter(logging.BASIC_FORMAT))
    top.addHandler(bare)
    ours.warning("memory-headroom: profiled peak 0.000 GiB")
    assert err.getvalue().count("memory-headroom") == 1, err.getvalue()
    assert "[vllm-overlay] memory-headroom: profiled peak" in err.getvalue() and "WARNING:" not in err.getvalue()
    # logging configured afterwards (basicConfig(force=True, ...) replaces the bare handler) takes over,
    # without duplicates, and propagation is back on
    top.removeHandler(bare)
    theirs = io.StringIO()
    top.addHandler(logging.StreamHandler(theirs))
    ours.warning("later")
    assert ours.propagate is True and "later" in theirs.getvalue() and "later" not in err.getvalue()


def test_vllm_cpu_moe_check_leaves_our_lines_in_our_format() -> None:
    """In a fresh process: the plugin's logging set up, then vLLM's own is_zentorch_moe_supported (which calls
    the module-level logging.debug on the root logger) runs, as while a CPU worker loads a MoE model."""
    import subprocess
    import sys

    from conftest import clean_env

    code = ("import logging, torch\n"
            "from vllm_overlay import logs\n"
            "logs.setup()\n"
            "from vllm.model_executor.kernels.linear.zentorch_utils import is_zentorch_moe_supported\n"
            "assert logging.getLogger().handlers == []\n"
            "is_zentorch_moe_supported(torch.nn.Linear(1, 1))\n"
            "assert len(logging.getLogger().handlers) == 1  # vLLM's call added the implicit default handler\n"
            "logs.LOG.warning('memory-headroom: profiled peak 0.000 GiB')\n"
            "logs.LOG.info('pid 1 role worker rank 0: 7 applied')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=clean_env())
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if "memory-headroom" in ln or "7 applied" in ln]
    assert len(lines) == 2, p.stderr[-3000:]
    assert all("[vllm-overlay] " in ln and "vllm_overlay:" not in ln for ln in lines), lines
