"""Runs last (file order): every boot of this session left the installed vLLM untouched. And the
patch modules write their report entries through report.py alone."""

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
