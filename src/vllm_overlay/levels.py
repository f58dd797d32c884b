"""Support levels: for every (vLLM release, model runner, platform) cell of the support matrix and
every patch, how far the claim that the patch works there has been carried:

- ``gpu-proven``: a GPU run with the overlay served traffic there with the patch applied; the
  result files under ``bench/results/`` that show it are named, with their dates, as read from them;
- ``cpu-proven``: an engine test of the suite ran it on vLLM's CPU build (the test is named);
- ``source-checked``: the matrix says it applies and ``vllm-overlay verify`` checked its targets,
  anchors and hashes in that release's wheel; no engine with the overlay ran it there;
- ``unsupported``: the patch does nothing there (not in its support rows, upstream-merged, not
  needed, or not for that platform).

The proven cells come from ``data/levels.json``, which ``bench/levels.py`` generates from the
result files and ``tests/engine_proofs.json`` (a test keeps it equal to what the script writes);
every other cell follows from the PatchSpecs, so a new patch or release is ``source-checked`` until
evidence names it. Nothing here imports vLLM.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from vllm_overlay.spec import PatchSpec

LEVELS = ("unsupported", "source-checked", "cpu-proven", "gpu-proven")  # of a cell of the matrix, weakest first
# the level of a patch in a process on a release newer than the matrix that its checks carried over to
# (carry.py): weaker than source-checked, as no maintainer checked that release's wheel
CARRIED = "carried-over"
PROCESS_LEVELS = ("unsupported", CARRIED, "source-checked", "cpu-proven", "gpu-proven")  # weakest first
RUNNERS = ("V1", "V2")
PLATFORMS = ("cuda", "cpu")
V1_LAST = "0.33.0"  # vLLM 0.34.0 removed the V1 model runner (VLLM_USE_V2_MODEL_RUNNER other than 1 is refused)
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "levels.json")
MEANS = {
    "gpu-proven": "a GPU run with the overlay served traffic with the patch applied (result files named)",
    "cpu-proven": "an engine test of the suite ran it on vLLM's CPU build (test named)",
    "source-checked": "targets, anchors and hashes verified in that release's wheel only; no engine with the "
                      "overlay ran it there",
    "unsupported": "the patch does nothing there",
    CARRIED: "a release newer than the support matrix: the checks of the newest release's support row (proofs, "
             "rewrite hashes and anchors) held against the installed vLLM's files at start-up; no wheel check by "
             "a maintainer, no engine run there",
}


@dataclass(frozen=True)
class CellLevel:
    patch_id: str
    version: str
    runner: str
    platform: str
    level: str
    evidence: tuple[str, ...]  # "bench/results/FILE (DATE)" or "tests/FILE::TEST"
    why: str


def rank(level: str) -> int:
    return PROCESS_LEVELS.index(level)


@lru_cache(maxsize=4)
def _load(path: str) -> dict[tuple[str, str, str, str], dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return {(c["patch"], c["vllm"], c["runner"], c["platform"]): c for c in data["cells"]}


def proven_cells(path: str = DATA) -> dict[tuple[str, str, str, str], dict[str, Any]]:
    """(patch, release, runner, platform) -> the generated entry (level, evidence) of each proven cell."""
    return _load(path)


def evidence_text(item: Mapping[str, Any]) -> str:
    if "test" in item:
        return str(item["test"])
    return f"{item['file']} ({item['date']})" + (f" run {item['run']}" if item.get("run") else "")


def runner_exists(version: str, runner: str) -> bool:
    """Whether vLLM ``version`` has ``runner`` at all (V1 ends at 0.33.0)."""
    return not (runner == "V1" and Version(version) > Version(V1_LAST))


def cell(spec: PatchSpec, version: str, runner: str, platform: str, path: str = DATA) -> CellLevel:
    """The level of ``spec`` on one cell."""
    if not runner_exists(version, runner):
        return CellLevel(spec.id, version, runner, platform, "unsupported", (),
                         f"vLLM {version} has no {runner} model runner (removed after {V1_LAST})")
    if not spec.applies_on(version):
        row = spec.support_for(version)
        status = row.status if row else "not in the support matrix"
        return CellLevel(spec.id, version, runner, platform, "unsupported", (), f"vLLM {version}: {status}")
    if platform not in spec.platforms:
        return CellLevel(spec.id, version, runner, platform, "unsupported", (),
                         f"platform {platform}: the patch concerns {', '.join(spec.platforms)} only")
    if runner == "V2" and spec.v2_releases is not None and Version(version) not in SpecifierSet(spec.v2_releases):
        return CellLevel(spec.id, version, runner, platform, "unsupported", (),
                         f"Model Runner V2 of vLLM {version}: the patch acts on V2 of {spec.v2_releases} only")
    entry = proven_cells(path).get((spec.id, version, runner, platform))
    if entry is None:
        return CellLevel(spec.id, version, runner, platform, "source-checked", (), MEANS["source-checked"])
    return CellLevel(spec.id, version, runner, platform, entry["level"],
                     tuple(evidence_text(e) for e in entry["evidence"]), MEANS[entry["level"]])


def expected_runner(version: str, platform: str, environ: Mapping[str, str] | None = None) -> tuple[str | None, str]:
    """The model runner vLLM's worker will build, as far as it is known before it is built, and why:
    VLLM_USE_V2_MODEL_RUNNER when set; V1 before 0.22.0 (V2 only on request) and on the CPU build
    (its V2 needs Triton); otherwise None: vLLM chooses at start-up."""
    env = os.environ if environ is None else environ
    raw = env.get("VLLM_USE_V2_MODEL_RUNNER")
    asked = (raw or "").strip().lower()
    if not runner_exists(version, "V1"):
        if raw is not None and raw != "1":  # vLLM 0.34.0 refuses every other value, set but empty included
            return "V2", (f"vLLM {version} has only Model Runner V2 and refuses VLLM_USE_V2_MODEL_RUNNER={raw!r} "
                          "(only 1 is accepted; unset it)")
        return "V2", f"vLLM {version} has only Model Runner V2 (V1 removed after {V1_LAST})"
    if asked in ("1", "true"):
        return "V2", "VLLM_USE_V2_MODEL_RUNNER=1"
    if asked in ("0", "false"):
        return "V1", "VLLM_USE_V2_MODEL_RUNNER=0"
    if Version(version) < Version("0.22.0"):
        return "V1", f"vLLM {version} builds Model Runner V2 only with VLLM_USE_V2_MODEL_RUNNER=1"
    if platform == "cpu":
        return "V1", "the CPU build's Model Runner V2 needs Triton"
    return None, "vLLM chooses the runner at start-up (VllmConfig.use_v2_model_runner); set VLLM_USE_V2_MODEL_RUNNER to choose"


def for_process(spec: PatchSpec, version: str, platform: str, runner: str | None, path: str = DATA) -> CellLevel:
    """The level that counts in a process: the cell of ``runner``; where the runner is not known,
    the weaker of the two runners' cells (a patch never counts as proven on a runner that was not)."""
    if runner is not None:
        return cell(spec, version, runner, platform, path)
    both = [cell(spec, version, r, platform, path) for r in RUNNERS]
    return min(both, key=lambda c: rank(c.level))


def summary_line(specs: tuple[PatchSpec, ...], version: str, platform: str, runner: str | None,
                 runner_why: str, path: str = DATA) -> str:
    """One line: the level of each patch on the installed release and the runner vLLM will build."""
    where = f"vLLM {version} ({platform}, runner {runner or 'V1 or V2, the weaker counts'}: {runner_why})"
    by_level: dict[str, list[str]] = {}
    idle: dict[str, dict[str, list[str]]] = {}  # what a patch that does nothing here is: its status -> why -> ids
    for spec in specs:
        level = for_process(spec, version, platform, runner, path).level
        if level == "unsupported":
            status, why = idle_here(spec, version, platform, runner)
            idle.setdefault(status, {}).setdefault(why, []).append(spec.id)
        else:
            by_level.setdefault(level, []).append(spec.id)
    parts = [f"{lv}: {', '.join(by_level[lv])}" + (f" ({MEANS[lv]})" if lv == "source-checked" else "")
             for lv in reversed(LEVELS) if lv in by_level]
    parts += [f"{status}: " + ", ".join(f"{', '.join(ids)} ({why})" for why, ids in idle[status].items())
              for status in IDLE if status in idle]
    return f"support levels on {where}: " + "; ".join(parts)


IDLE = ("not-needed", "upstream-merged", "unsupported")  # why a patch does nothing on a cell, in the line's order


def idle_here(spec: PatchSpec, version: str, platform: str, runner: str | None) -> tuple[str, str]:
    """(status, reason) of a patch that does nothing on this cell, as ``plan`` words it: ``not-needed``
    (its support row, or a platform it does not concern), ``upstream-merged`` (vLLM does it itself) or
    ``unsupported``, each with the reason of its support row."""
    row = spec.support_for(version)
    if row is not None and row.status != "applies":
        return row.status, row.reason
    if row is None:
        return "unsupported", f"vLLM {version} is not in the support matrix"
    if platform not in spec.platforms:
        return "not-needed", f"platform {platform}: the patch concerns {', '.join(spec.platforms)} only"
    if runner is not None and not runner_exists(version, runner):
        return "unsupported", f"vLLM {version} has no {runner} model runner (removed after {V1_LAST})"
    return "unsupported", f"Model Runner V2 of vLLM {version}: the patch acts on V2 of {spec.v2_releases} only"
