"""pytest plugin that scripts/vllm_scheduler_tests.py copies, as conftest.py, beside vLLM's own tests.

vLLM's scheduler tests build a Scheduler directly and never call ``load_general_plugins()``, so
without this file the overlay would not be in the test process at all. At start-up it loads vLLM's
general plugins exactly as every vLLM process does (entry point group ``vllm.general_plugins``), so
vllm-overlay's ``register()`` runs under the VLLM_OVERLAY* variables of the environment. pytest's
header then shows the overlay's own summary line, which module was loaded, the status of every
patch and which overlay patch wraps ``Scheduler.__init__``; the end of the run shows what the
prefill clamp did. ``--overlay-evidence PATH`` writes the same as JSON (the runner checks it). At
exit every patch is reverted and what could not be taken off is recorded.

It also provides ``caplog_vllm``, a fixture that vLLM's tests take from vLLM's own tests/conftest.py
(not fetched): the log records of vLLM's ``vllm`` logger during the test, which pytest's ``caplog``
may not see because vLLM's logging configuration stops that logger from propagating to the root.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

CLAMP = "prefill-chunk-clamp"
_EVIDENCE: dict[str, Any] = {}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class VllmLogCapture(logging.Handler):
    """What ``caplog_vllm`` gives a test: the records that reached the ``vllm`` logger while it ran."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.records: list[logging.LogRecord] = []
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @property
    def messages(self) -> list[str]:
        return [r.getMessage() for r in self.records]

    @property
    def text(self) -> str:
        return "".join(self.format(r) + "\n" for r in self.records)

    def clear(self) -> None:
        self.records.clear()


@pytest.fixture
def caplog_vllm() -> Any:
    """Records of vLLM's ``vllm`` logger (and its children) during the test, at the levels vLLM's
    logging configuration lets through; ``.text``, ``.messages``, ``.records``, ``.clear()``."""
    capture = VllmLogCapture()
    vllm_logger = logging.getLogger("vllm")
    vllm_logger.addHandler(capture)
    try:
        yield capture
    finally:
        vllm_logger.removeHandler(capture)


def _torchvision() -> dict[str, Any]:
    """Which torchvision the test process imports, and whether its compiled operators loaded."""
    try:
        import torchvision
    except Exception as exc:  # the runner checked it imports; a plain pytest run may not have it
        return {"imported": False, "error": f"{type(exc).__name__}: {exc}"}
    declared: list[str] = []
    try:
        import sitecustomize

        declared = list(getattr(sitecustomize, "DECLARED", []))
    except ImportError:
        pass
    return {"imported": True, "version": torchvision.__version__, "file": torchvision.__file__,
            "ops_loaded": torchvision.extension._has_ops(), "declared_without_kernel": declared}


def _scheduler_init_marks() -> list[str]:
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_overlay.mechanisms.wrap import mark_of, wrapper_chain

    return [m for m in (mark_of(o) for o in wrapper_chain(vars(Scheduler)["__init__"])) if m]


def _clamp_tally(events: list[str]) -> dict[str, int]:
    mine = [e for e in events if e.startswith(f"{CLAMP}: ")]
    return {
        "set": sum(1 for e in mine if " -> " in e),
        "stood_aside": sum(1 for e in mine if "stands aside" in e),
        "kept_users": sum(1 for e in mine if "kept the user's" in e),
    }


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--overlay-evidence", default=None,
                     help="write what vllm-overlay applied in this process (JSON) to this path")


def pytest_configure(config: pytest.Config) -> None:
    import vllm_overlay
    from vllm.plugins import load_general_plugins

    from vllm_overlay.report import STATE

    lines = _Lines()
    overlay_log = logging.getLogger("vllm_overlay")
    overlay_log.addHandler(lines)
    try:
        load_general_plugins()  # what every vLLM process does; vLLM logs a plugin's error and goes on
        marks = _scheduler_init_marks()  # importing the scheduler module fires the overlay's hook for it
        if STATE.registered:
            try:
                STATE.log_summary(note="after importing vllm.v1.core.sched.scheduler")
            except TypeError:  # an older vllm-overlay (running an earlier commit to compare)
                STATE.log_summary()
    finally:
        overlay_log.removeHandler(lines)
    _EVIDENCE.update(
        overlay_module=vllm_overlay.__file__,
        registered=STATE.registered,
        vllm_version=STATE.vllm_version,
        summary_lines=[line for line in lines.lines if " role " in line and " applied, " in line],
        patches_at_start={pid: rec["status"] for pid, rec in sorted(STATE.patches.items())},
        scheduler_init_wrapped_by=marks,
        torchvision=_torchvision(),
    )


def pytest_report_header(config: pytest.Config) -> list[str]:
    e = _EVIDENCE
    if not e.get("registered"):
        return ["vllm-overlay: NOT registered in this process (load_general_plugins did not run its "
                f"register(); module {e.get('overlay_module')})"]
    out = [f"vllm-overlay: {line}" for line in e["summary_lines"]] or [
        "vllm-overlay: registered, but no summary line was logged"]
    out.append(f"vllm-overlay: module {e['overlay_module']}, vLLM {e['vllm_version']}")
    out.append("vllm-overlay: patches " + ", ".join(f"{k}={v}" for k, v in e["patches_at_start"].items()))
    out.append("vllm-overlay: Scheduler.__init__ wrapped by " + (", ".join(e["scheduler_init_wrapped_by"])
                                                                  or "no overlay patch"))
    tv = e["torchvision"]
    if not tv["imported"]:
        out.append(f"torchvision: does not import ({tv['error']})")
    else:
        ops = "loaded" if tv["ops_loaded"] else "not loaded; declared without a kernel: " + (
            ", ".join(tv["declared_without_kernel"]) or "nothing")
        out.append(f"torchvision: {tv['version']} from {tv['file']}; C++ operators {ops}")
    return out


def pytest_terminal_summary(terminalreporter: Any) -> None:
    from vllm_overlay.report import STATE

    tally = _clamp_tally(list(STATE.events))
    _EVIDENCE["clamp"] = tally
    terminalreporter.write_line(
        f"vllm-overlay: {CLAMP} set long_prefill_token_threshold in {tally['set']} schedulers, stood "
        f"aside in {tally['stood_aside']}, kept the test's own threshold in {tally['kept_users']}")


def pytest_unconfigure(config: pytest.Config) -> None:
    import vllm_overlay
    from vllm_overlay.report import STATE

    _EVIDENCE.setdefault("clamp", _clamp_tally(list(STATE.events)))
    _EVIDENCE["patches_at_end"] = {pid: rec["status"] for pid, rec in sorted(STATE.patches.items())}
    _EVIDENCE["counters"] = dict(STATE.counters)
    _EVIDENCE["revert_problems"] = vllm_overlay.revert() if STATE.registered else []
    path = config.getoption("--overlay-evidence")
    if path:
        with open(path, "w") as f:
            json.dump(_EVIDENCE, f, indent=1, sort_keys=True)
