"""Shared fixtures. Engine scenarios run in their own processes (tests/scenario.py) because the
overlay reads its settings once per vLLM process; results are cached per session so several
tests can assert on one boot."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest

# the benchmarks' package, imported before any test module: bench scripts that tests import put bench/ first on
# sys.path, where bench/bench.py would otherwise answer a later `import bench`
import bench  # noqa: F401 - the project root is on the tests' path (pyproject.toml)

HERE = os.path.dirname(os.path.abspath(__file__))
PY = sys.executable
OVERLAY_PREFIXES = ("VLLM_OVERLAY", "GENESIS_")


# every process of the suite reports here unless a test names a folder: the machine's default folder (in
# the temp directory) keeps reports of earlier runs, and the commands that read it (plan, doctor, report)
# would see them. Subprocesses get it from clean_env or from os.environ (set here and by the autouse
# fixture below); this pytest process too: a test that registers the overlay in-process leaves its state,
# whose report the flusher rewrites and the exit handler writes last, after every test's settings are gone.
REPORTS = tempfile.mkdtemp(prefix="vllm-overlay-test-reports-")
SESSION_STARTED = time.time()
os.environ["VLLM_OVERLAY_REPORT_DIR"] = REPORTS

# processes a test started with an environment that names no report folder (neither
# VLLM_OVERLAY_REPORT_DIR nor a TMPDIR of its own): each would report into the machine's default
# folder. tests/test_zz_integrity.py asserts there are none, and the terminal summary names them.
STARTED_WITHOUT_REPORT_DIR: list[str] = []
_popen_init = subprocess.Popen.__init__


def _popen_init_checked(self: subprocess.Popen, args: Any, *rest: Any, **kw: Any) -> None:  # type: ignore[type-arg]
    env = kw.get("env", rest[9] if len(rest) > 9 else None)
    seen = os.environ if env is None else env
    if "VLLM_OVERLAY_REPORT_DIR" not in seen and "TMPDIR" not in seen:
        test = os.environ.get("PYTEST_CURRENT_TEST", "outside a test")
        STARTED_WITHOUT_REPORT_DIR.append(f"{test}: {str(args)[:200]}")
    _popen_init(self, args, *rest, **kw)


subprocess.Popen.__init__ = _popen_init_checked  # type: ignore[method-assign]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for line in STARTED_WITHOUT_REPORT_DIR:
        terminalreporter.write_line(f"started with no report folder (reports into the default one): {line}",
                                    red=True)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(OVERLAY_PREFIXES)}
    env.update(extra)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("VLLM_OVERLAY_REPORT_DIR", REPORTS)
    return env


@pytest.fixture(autouse=True)
def _isolate_overlay_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No overlay setting of the caller's reaches a test, but the suite's report folder (REPORTS); a test
    that needs the setting unset deletes it itself."""
    for key in list(os.environ):
        if key.startswith(OVERLAY_PREFIXES):
            monkeypatch.delenv(key)
    monkeypatch.setenv("VLLM_OVERLAY_REPORT_DIR", REPORTS)


def load_reports(directory: str) -> list[dict[str, Any]]:
    from vllm_overlay.reports import load

    return load(directory)


def worker_report(reports: list[dict[str, Any]]) -> dict[str, Any]:
    found = [r for r in reports if "worker" in r["role"]]
    assert len(found) == 1, [(r["pid"], r["role"]) for r in reports]
    return found[0]


class Scenarios:
    """Runs tests/scenario.py once per distinct (args, env) and caches the result."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.cache: dict[str, dict[str, Any]] = {}

    def run(self, name: str, args: list[str], env: dict[str, str], timeout: int = 900) -> dict[str, Any]:
        if name in self.cache:
            return self.cache[name]
        work = os.path.join(self.root, name)
        os.makedirs(work, exist_ok=True)
        out = os.path.join(work, "result.json")
        full_env = clean_env(VLLM_OVERLAY_REPORT_DIR=os.path.join(work, "reports"), **env)
        with open(os.path.join(work, "log.txt"), "w") as log:
            proc = subprocess.run([PY, os.path.join(HERE, "scenario.py"), out, *args], env=full_env,
                                  stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
        with open(os.path.join(work, "log.txt")) as f:
            log_text = f.read()
        result = json.load(open(out)) if os.path.exists(out) else {"ok": False, "error": "no result"}
        result["returncode"] = proc.returncode
        result["log"] = log_text
        result["reports"] = load_reports(os.path.join(work, "reports"))
        self.cache[name] = result
        return result


@pytest.fixture(scope="session")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> Scenarios:
    return Scenarios(str(tmp_path_factory.mktemp("scenarios")))


def vllm_tree_digest() -> str:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    assert spec and spec.submodule_search_locations
    root = list(spec.submodule_search_locations)[0]
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".pyc"):
                continue
            path = os.path.join(dirpath, name)
            h.update(path.encode())
            with open(path, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


_DIGEST_BEFORE: list[str] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    # taken before any test boots vLLM, compared by tests/test_zz_integrity.py at the end
    _DIGEST_BEFORE.append(vllm_tree_digest())


@pytest.fixture(scope="session")
def vllm_digest_before() -> Iterator[str]:
    yield _DIGEST_BEFORE[0]


@pytest.fixture
def run_interpreted() -> Any:
    """run(name): tests/interpreted/NAME under Triton's interpreter in a fresh process (vLLM's CPU
    build replaces `triton` with a placeholder once vLLM is imported, which other tests of this session
    do), asserting that its tests passed; skips where Triton is not installed."""
    import importlib.util

    def run(name: str) -> None:
        try:
            if importlib.util.find_spec("triton") is None:
                pytest.skip("needs Triton (runs the kernel with TRITON_INTERPRET=1 on the CPU)")
        except ValueError:
            pytest.skip("triton is present only as vLLM's placeholder in this process")
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            os.path.join(HERE, "interpreted", name)], capture_output=True, text=True,
                           env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=900, cwd=os.path.dirname(HERE))
        assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
        assert " passed" in p.stdout and " failed" not in p.stdout

    return run
