"""Fetch and cache a vLLM wheel (sources only are read; nothing is installed or committed)."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

from vllm_overlay.errors import OverlayError

CACHE = os.path.join(os.path.expanduser(os.environ.get("XDG_CACHE_HOME", "~/.cache")), "vllm-overlay", "wheels")
PLATFORM = ["--platform", "manylinux_2_35_x86_64", "--platform", "manylinux_2_31_x86_64",
            "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
            "--platform", "manylinux2014_x86_64"]


def version_of(wheel: str) -> str:
    name = os.path.basename(wheel)
    parts = name.split("-")
    if len(parts) < 2 or not parts[0].startswith("vllm"):
        raise OverlayError(f"--wheel {wheel!r}: expected a vllm-X.Y.Z-*.whl file name")
    return parts[1]


def fetch_vllm_wheel(version: str) -> str:
    found = glob.glob(os.path.join(CACHE, f"vllm-{version}-*.whl"))
    if found:
        return found[0]
    os.makedirs(CACHE, exist_ok=True)
    print(f"downloading the vllm=={version} wheel into {CACHE} (about 250 MB, once) ...", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", *PLATFORM, "-d", CACHE, f"vllm=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = glob.glob(os.path.join(CACHE, f"vllm-{version}-*.whl"))
    if proc.returncode != 0 or not found:
        raise OverlayError(f"could not download vllm=={version}: {proc.stderr.strip()[-500:]}")
    return found[0]
