"""Runs last (file order): every boot of this session left the installed vLLM untouched, and none of
its processes reported into the machine's default report folder. And the patch modules write their
report entries through report.py alone."""

from __future__ import annotations

import glob
import os

from conftest import vllm_tree_digest

PATCHES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src", "vllm_overlay", "patches")


def test_installed_vllm_files_unchanged(vllm_digest_before: str) -> None:
    assert vllm_tree_digest() == vllm_digest_before


def test_patch_modules_report_through_report_py() -> None:
    """A patch's report entry is written by report.patch_note / patch_append / patch_put (and read
    by report.patch_entry); its status only by core (STATE.set_patch)."""
    files = sorted(glob.glob(os.path.join(PATCHES, "*.py")))
    assert len(files) > 10
    offenders = [f"{os.path.basename(path)}:{n}: {line.strip()}"
                 for path in files for n, line in enumerate(open(path), 1)
                 if "STATE.patches" in line or ".set_patch(" in line]
    assert offenders == [], offenders


def test_no_report_of_this_suite_in_the_default_folder() -> None:
    """Every process the suite started named a report folder (conftest.py: clean_env, the autouse fixture,
    os.environ for this process), and this process wrote nothing into the machine's default folder."""
    import json

    from conftest import REPORTS, SESSION_STARTED, STARTED_WITHOUT_REPORT_DIR

    from vllm_overlay import report_files
    from vllm_overlay.report import STATE

    assert STARTED_WITHOUT_REPORT_DIR == []
    assert os.path.dirname(STATE.report_path()) == REPORTS  # where its flusher and its exit handler write
    default = report_files.default_dir()
    mine = []
    for path in glob.glob(os.path.join(default, "overlay-*.json")):
        try:
            with open(path, encoding="utf-8") as f:
                rep = json.load(f)
        except (OSError, ValueError):
            continue  # another run's file, being replaced
        if rep.get("pid") == os.getpid() and rep.get("written", 0) >= SESSION_STARTED:
            mine.append(path)
    assert mine == []
