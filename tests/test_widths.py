"""No identifier (a setting name, a patch id, an option of the command line, a report path) is split across
lines at any terminal width from 60 to 200 columns: `plan`, `plan --ledger`, `doctor`, `matrix`, `report`,
the stress summary and every command's --help are rendered as on a terminal of each width (rich's own
terminal mode: TTY_COMPATIBLE=1, COLUMNS), and each identifier must occur whole as many times as in the
same output rendered 1,000 columns wide. No vLLM engine: the reports `report` reads are built from the
decisions the overlay takes on the installed vLLM (their real reasons, settings named in them)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
from collections import Counter
from collections.abc import Callable, Iterator

import pytest

from vllm_overlay import settings
from vllm_overlay.tools import matrix

WIDTHS = range(60, 201)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _parser() -> argparse.ArgumentParser:
    from vllm_overlay.tools.cli.main import build_parser

    return build_parser()


def identifiers(*extra: str) -> list[str]:
    """Setting names, patch ids and every option string of every command (longest first)."""
    names = set(settings.BY_NAME) | {s.id for s in matrix.specs()} | set(extra)
    parser = _parser()
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]  # noqa: SLF001
    for p in [parser, *subs[0].choices.values()]:
        for action in p._actions:  # noqa: SLF001
            names |= {o for o in action.option_strings if o.startswith("--")}
    return sorted(names, key=len, reverse=True)


def counter(idents: list[str]) -> Callable[[str], Counter[str]]:
    """text -> how often each identifier occurs in it whole (not inside a longer word), in one pass."""
    pattern = re.compile(r"(?<![\w.-])(" + "|".join(map(re.escape, idents)) + r")(?![\w-])")
    return lambda text: Counter(pattern.findall(text))


@contextlib.contextmanager
def terminal(monkeypatch: pytest.MonkeyPatch, width: int) -> Iterator[io.StringIO]:
    """stdout as a terminal of ``width`` columns, for rich (TTY_COMPATIBLE, COLUMNS) and argparse (COLUMNS)."""
    buf = io.StringIO()
    with monkeypatch.context() as m:
        m.setenv("TTY_COMPATIBLE", "1")
        m.setenv("NO_COLOR", "1")
        m.setenv("COLUMNS", str(width))
        m.setattr("sys.stdout", buf)
        yield buf


def render(monkeypatch: pytest.MonkeyPatch, width: int, command: Callable[[], object]) -> str:
    with terminal(monkeypatch, width) as buf:
        try:
            command()
        except SystemExit:  # --help
            pass
    return ANSI.sub("", buf.getvalue())


def reports_dir(tmp_path) -> str:  # type: ignore[no-untyped-def]
    """A server's reports as `report` reads them: an API server, an engine core and a worker, each patch
    with the status and reason the overlay decides on the installed vLLM, the settings named in them."""
    from vllm_overlay.core import decide

    decisions = decide(environ={"VLLM_OVERLAY_PROFILE_RUN_CAP": "0"})
    runner = ["vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu_worker"]
    for pid, role in ((41, "api server"), (42, "engine core"), (43, "worker rank 0")):
        patches = {}
        for d in decisions:
            status = {"planned": "applied" if role.startswith("worker") else "armed"}.get(d.status, d.status)
            patches[d.spec.id] = {"status": status, "reason": d.reason,
                                  **({"pending_modules": runner} if status == "armed" else {})}
        patches["memory-headroom"] = {"status": "skipped", "reason": (
            "VLLM_OVERLAY_MEMORY_HEADROOM_DRY_RUN=1 and VLLM_OVERLAY_PROFILE_RUN_CAP=512: the profiled forward was "
            "capped, see VLLM_OVERLAY_REPORT_DIR and --allow-partial-band")}
        rep = {"pid": pid, "role": role, "server_id": "srv-widths", "vllm_version": "0.32.0", "written": 1.0 + pid,
               "counts": {"applied": 3, "armed": 0, "skipped": 1, "off": 2, "failed": 0}, "patches": patches,
               "telemetry": {"forwards": {"count": 9, "min": 1, "max": 2048,
                                          "sizes": {"1": 4, "1536": 3, "2048": 2}}},
               "counters": {"guard_trips": 0}, "runner": {"kind": "V1", "class": "CPUModelRunner"}}
        (tmp_path / f"overlay-srv-{pid}.json").write_text(json.dumps(rep))
    return str(tmp_path)


def commands(directory: str) -> dict[str, Callable[[], object]]:
    """Each command as the command line runs it (parsed once; run, or its --help printed, per width)."""
    from vllm_overlay.tools.output import Out
    from vllm_overlay.tools.stress import run as stress_run
    from vllm_overlay.tools.stress.verdict import Outcome, judge

    parser = _parser()

    def run(*argv: str) -> Callable[[], object]:
        args = parser.parse_args(list(argv))
        return lambda: args.func(args)

    def stress_summary() -> None:
        worker = {"role": "worker rank 0", "vllm_version": "0.32.0", "platform": "cpu",
                  "runner": {"kind": "V1", "class": "x"}, "patches": {"forward-telemetry": {"status": "applied"}}}
        result = judge(1024, 2048, 1, {1536: 3, 2048: 2}, Outcome(requests_ok=5), [worker])
        Out().table(f"stress: {result['verdict']}", ("measure", "value"), stress_run.summary_rows(result))

    found = {"plan": run("plan"), "plan --ledger": run("plan", "--ledger"), "doctor": run("doctor"),
             "matrix": run("matrix"), "report": run("report", directory), "report --all": run("report", "--all", directory),
             "stress summary": stress_summary, "--help": parser.print_help}
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]  # noqa: SLF001
    for name, sub in subs[0].choices.items():
        if name != "serve":  # serve's --help is vLLM's own
            found[f"{name} --help"] = sub.print_help
    return found


def test_no_identifier_is_split_at_any_width(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    directory = reports_dir(tmp_path)
    monkeypatch.setenv("VLLM_OVERLAY_REPORT_DIR", directory)
    count = counter(identifiers(directory))
    split: list[str] = []
    for name, command in commands(directory).items():
        expected = count(render(monkeypatch, 1000, command))
        assert expected or name == "stress summary", name
        for width in WIDTHS:
            got = count(render(monkeypatch, width, command))
            split += [f"{name} at {width} columns: {ident} ({got[ident]} of {n} whole)"
                      for ident, n in expected.items() if got[ident] != n]
    assert split == [], "\n".join(split[:40])
