"""CI runs the wrap tests under both wrapt majors: pyproject allows wrapt>=1.16, and 1.x and 2.x
differ where it matters (in 1.x FunctionWrapper is an ObjectProxy, in 2.x it is not). This test
installs the major that is NOT in this environment into a cache directory (pip from the package
index, once per machine) and runs tests/test_wrap.py, test_rewrite.py and test_core.py again with that
wrapt first on the path."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

import wrapt

from conftest import clean_env

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
OTHER = {"1": "wrapt==2.0.1", "2": "wrapt==1.17.2"}  # the other major's tested release


def _install(requirement: str) -> str:
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                         "vllm-overlay", "wrapt", requirement.replace("==", "-"))
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    with open(cache + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(os.path.join(cache, "wrapt", "__init__.py")):
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                 "--no-deps", "--target", cache, requirement],
                capture_output=True, text=True, timeout=300,
            )
            assert proc.returncode == 0, f"pip install {requirement} into {cache} failed:\n{proc.stderr}"
    return cache


def test_wrap_and_core_under_the_other_wrapt_major() -> None:
    requirement = OTHER[wrapt.__version__.split(".")[0]]
    path = _install(requirement)
    env = clean_env(PYTHONPATH=os.pathsep.join([path, SRC]))  # with the suite's report folder
    probe = subprocess.run([sys.executable, "-c", "import wrapt; print(wrapt.__version__)"],
                           env=env, capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == requirement.split("==")[1], probe.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         *(os.path.join(HERE, f) for f in ("test_wrap.py", "test_rewrite.py", "test_core.py"))],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"under {requirement}:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
