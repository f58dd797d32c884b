"""The runtime and the tools apart: what every vLLM process loads (register(), core, the patches and
what they import) never imports a tool module (vllm_overlay.tools, the former-path forward
vllm_overlay.cli, python -m vllm_overlay) nor rich, which only the tools use (the tools extra); no
patch imports core back. Read two ways: the imports written in every runtime file, and the modules a
real engine's process holds after serving a request."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

from conftest import clean_env

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
PKG = os.path.join(SRC, "vllm_overlay")
TOOLS = ("vllm_overlay.tools", "vllm_overlay.cli", "vllm_overlay.__main__")
TOOL_ONLY = ("rich",)  # third-party packages of the tools extra


def _module(path: str) -> str:
    rel = os.path.relpath(path, SRC)[: -len(".py")].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def runtime_files() -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(PKG):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            if name.endswith(".py") and not _module(path).startswith(TOOLS):
                out.append(path)
    return out


def imported_names(path: str) -> list[tuple[int, str]]:
    """(line, module) for every import the file writes, at any depth (inside functions too), and every
    string constant naming a vllm_overlay module (what importlib loads)."""
    tree = ast.parse(open(path).read(), path)
    here = _module(path).split(".")
    package = here if path.endswith("__init__.py") else here[:-1]
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("vllm_overlay."):
            out.append((node.lineno, node.value.split(":")[0]))
    return out


def _is(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_layout_has_both_layers() -> None:
    files = runtime_files()
    names = {_module(f) for f in files}
    assert {"vllm_overlay", "vllm_overlay.core", "vllm_overlay.spec", "vllm_overlay.patches"} <= names
    assert not any(_is(n, TOOLS) for n in names)
    for tool in ("cli/main.py", "stress/run.py", "tune/run.py", "matrix.py", "docs.py", "output.py"):
        assert os.path.isfile(os.path.join(PKG, "tools", tool)), tool


def test_a_built_package_holds_every_module_and_the_model() -> None:
    """setuptools' discovery (pyproject.toml: packages.find) finds only folders with an __init__.py: each
    folder of modules must have one, or a wheel leaves it out; the tiny model ships as package data."""
    import glob
    import tomllib

    from setuptools import find_packages

    found = set(find_packages(SRC))
    folders = {_module(os.path.join(d, "__init__.py")) for d, _, files in os.walk(PKG)
               if "__pycache__" not in d and any(f.endswith(".py") for f in files)}
    assert folders - found == set()
    data = tomllib.load(open(os.path.join(os.path.dirname(SRC), "pyproject.toml"), "rb"))
    patterns = data["tool"]["setuptools"]["package-data"]["vllm_overlay"]
    assert any(glob.glob(os.path.join(PKG, p)) == [os.path.join(PKG, "tools", "models", "tiny-hybrid", "config.json")]
               for p in patterns)
    assert "rich" not in " ".join(data["project"]["dependencies"])
    assert data["project"]["optional-dependencies"]["tools"] == ["rich>=13"]


def test_no_runtime_file_imports_a_tool_module_or_rich() -> None:
    bad = [f"{os.path.relpath(path, SRC)}:{line} imports {name}"
           for path in runtime_files() for line, name in imported_names(path)
           if _is(name, TOOLS) or _is(name, TOOL_ONLY)]
    assert not bad, "the runtime imports the tools: " + "; ".join(bad)


def test_no_patch_imports_core() -> None:
    """core installs the patches and hands them what they need (a PatchContext); a patch that imported core
    back would close a cycle the import graph does not show."""
    bad = [f"{os.path.relpath(path, SRC)}:{line} imports {name}"
           for path in runtime_files() if os.sep + "patches" + os.sep in path
           for line, name in imported_names(path) if _is(name, ("vllm_overlay.core",))]
    assert not bad, "; ".join(bad)


MUTATORS = ("append", "extend", "update", "setdefault", "pop", "clear", "insert", "remove")


def state_writes(path: str) -> list[tuple[int, str]]:
    """(line, what) for every write of a field of report.STATE the file makes: an assignment to
    ``STATE.x`` or into it (``STATE.x[k] = v``, ``STATE.x += 1``), or a mutating call on it
    (``STATE.x.append(...)``). STATE's own methods (``STATE.count(...)``) are not writes."""
    def field(node: ast.AST) -> str | None:  # the STATE field an expression reaches into
        while isinstance(node, (ast.Subscript, ast.Attribute)):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "STATE":
                return node.attr
            node = node.value
        return None

    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        out += [(node.lineno, f"assigns STATE.{name}") for t in targets if (name := field(t))]
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
                and (name := field(node.func.value))):
            out.append((node.lineno, f"STATE.{name}.{node.func.attr}(...)"))
    return sorted(out)


def test_patches_write_the_report_only_through_its_helpers() -> None:
    """A patch changes its entry and the process's fields of the report through report.py's helpers
    (patch_note, patch_put, add_buffer, set_engine_config, ...) and STATE's methods, never by writing a
    field of STATE itself: the report's JSON is built in one place."""
    patches = os.path.join(PKG, "patches")
    bad = [f"{os.path.relpath(path, SRC)}:{line} {what}" for path in runtime_files()
           if path.startswith(patches + os.sep) for line, what in state_writes(path)]
    assert not bad, "; ".join(bad)


def test_the_state_check_sees_each_kind_of_write(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "m.py"
    path.write_text("def f():\n    STATE.runner = {}\n    STATE.engine_config['a'] = 1\n    STATE.dirty |= True\n"
                    "    with STATE.lock:\n        STATE.buffers.append(1)\n    STATE.patches['x'].update(a=1)\n"
                    "    STATE.count('guard_checks')\n    x = STATE.buffers\n")
    assert state_writes(str(path)) == [(2, "assigns STATE.runner"), (3, "assigns STATE.engine_config"),
                                       (4, "assigns STATE.dirty"), (6, "STATE.buffers.append(...)"),
                                       (7, "STATE.patches.update(...)")]


def test_the_static_check_sees_imports_inside_functions(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from vllm_overlay.tools import output\n    import rich.table\n")
    names = [n for _, n in imported_names(str(path))]
    assert "vllm_overlay.tools.output" in names and "rich.table" in names


# One process as vLLM runs it with VLLM_ENABLE_V1_MULTIPROCESSING=0: vLLM loads the plugin (register()),
# the engine core and the worker run here and serve one request; then the modules it holds are listed.
# A finder placed first records the module whose code asked for rich, if one of the overlay's did.
ENGINE = r"""
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
asked = []
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "rich" or name.startswith("rich."):
            f = sys._getframe(1)
            while f is not None:
                mod = f.f_globals.get("__name__", "")
                if mod.startswith("vllm_overlay"):
                    asked.append(mod)
                    break
                f = f.f_back
        return None
sys.meta_path.insert(0, Watch())
model = sys.argv[1]
from vllm import LLM, SamplingParams
llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, max_num_batched_tokens=256,
          max_model_len=512, max_num_seqs=4, enforce_eager=True, seed=0, enable_prefix_caching=False)
out = llm.generate([{"prompt_token_ids": list(range(10, 26))}], SamplingParams(max_tokens=2, detokenize=False),
                   use_tqdm=False)
from vllm_overlay.report import STATE
print("RESULT " + json.dumps({
    "tokens": len(out[0].outputs[0].token_ids),
    "modules": sorted(m for m in sys.modules if m.startswith("vllm_overlay")),
    "rich_asked_by": asked,
    "applied": sorted(p for p, e in STATE.patches.items() if e.get("status") == "applied"),
}))
"""


@pytest.mark.engine
def test_an_engine_process_holds_no_tool_module(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = os.path.join(PKG, "tools", "models", "tiny-hybrid")
    env = clean_env(VLLM_OVERLAY_REPORT_DIR=str(tmp_path / "reports"))
    r = subprocess.run([sys.executable, "-c", ENGINE, model], env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, (r.stdout[-3000:], r.stderr[-5000:])
    got = json.loads(lines[-1][len("RESULT "):])
    assert got["tokens"] == 2
    assert {"forward-telemetry", "gdn-output-prealloc", "compile-cache-key"} <= set(got["applied"])
    assert "vllm_overlay.patches.gdn_output_prealloc" in got["modules"]  # the runtime did load
    assert [m for m in got["modules"] if _is(m, TOOLS)] == []
    assert got["rich_asked_by"] == []
