"""The support-levels line of `plan` and `doctor`: each patch's level on the installed release, its
platform and the model runner vLLM will build (the one the latest worker report of this release in
VLLM_OVERLAY_REPORT_DIR names, else what VLLM_USE_V2_MODEL_RUNNER and the release decide)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from vllm_overlay import levels, reports, settings, versions
from vllm_overlay.core import specs


def runner(inst: versions.Installed, environ: Mapping[str, str] | None = None) -> tuple[str | None, str]:
    try:
        directory = settings.value("VLLM_OVERLAY_REPORT_DIR", environ)
        built = [r for r in reports.load(directory) if (r.get("runner") or {}).get("kind") in levels.RUNNERS
                 and r.get("vllm_version") == inst.version] if os.path.isdir(directory) else []
    except Exception:  # noqa: BLE001 - an unreadable report directory: decide from the release
        built = []
    if built:
        last = max(built, key=lambda r: r.get("written", 0))
        return last["runner"]["kind"], f"built by pid {last['pid']}, report {reports.where(last)}"
    return levels.expected_runner(inst.version, inst.platform, environ)


def line(inst: versions.Installed | None, environ: Mapping[str, str] | None = None) -> str | None:
    """None where no level applies (vLLM not installed, or a release the matrix does not cover)."""
    if inst is None or inst.version not in versions.RELEASES:
        return None
    kind, why = runner(inst, environ)
    return levels.summary_line(specs(), inst.version, inst.platform, kind, why)
