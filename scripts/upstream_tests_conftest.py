"""pytest plugin that scripts/vllm_scheduler_tests.py copies, as conftest.py, beside vLLM's own tests.

vLLM's scheduler tests build a Scheduler directly and never call ``load_general_plugins()``, so
without this file the overlay would not be in the test process at all. At start-up it loads vLLM's
general plugins exactly as every vLLM process does (entry point group ``vllm.general_plugins``), so
vllm-overlay's ``register()`` runs under the VLLM_OVERLAY* variables of the environment. pytest's
header then shows the overlay's own summary line, which module was loaded, the status of every
patch and which overlay patch wraps ``Scheduler.__init__``; the end of the run shows what the
prefill clamp did. ``--overlay-evidence PATH`` writes the same as JSON (the runner checks it). At
exit every patch is reverted and what could not be taken off is recorded.
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
