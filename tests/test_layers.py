"""The runtime and the tools apart: what every vLLM process loads (register(), core, the patches and
what they import) never imports a tool module (vllm_overlay.tools, the former-path forward
vllm_overlay.cli, python -m vllm_overlay) nor rich, which only the tools use (the tools extra); no
patch reaches core back through any chain of imports (the runtime's import graph, imports inside
functions and names importlib loads included), and core reaches the patches only through the registry.
Read two ways: the imports written in every runtime file, and the modules a real engine's process holds
after serving a request."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from conftest import clean_env

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
PKG = os.path.join(SRC, "vllm_overlay")
TOOLS = ("vllm_overlay.tools", "vllm_overlay.cli", "vllm_overlay.__main__")
TOOL_ONLY = ("rich",)  # third-party packages of the tools extra


def _module(path: str, src: str = SRC) -> str:
    rel = os.path.relpath(path, src)[: -len(".py")].replace(os.sep, ".")
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



# The import graph of the runtime, read from its files: an edge for every import written at any depth
# (inside functions too: those run when the function is called) and every string naming a module
# (what importlib loads). ``from P import name`` is an edge to P.name where that is a module, else to
# P. Importing a module runs its packages' __init__ first: a package is entered at import time only
# (its module-level imports), never through its functions (vllm_overlay/__init__.py's register() is
# the entry point vLLM calls, which nothing of the runtime calls).
def import_graph(modules: dict[str, str], src: str = SRC) -> dict[str, set[str]]:
    """{module: the modules it reaches in one step} for ``modules`` ({name: path under ``src``})."""
    def resolve(path: str, module_level: bool) -> set[str]:
        tree = ast.parse(open(path).read(), path)
        here = _module(path, src).split(".")
        package = here if path.endswith("__init__.py") else here[:-1]
        names: set[str] = set()
        for node in (tree.body if module_level else ast.walk(tree)):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                names |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
            elif (not module_level and isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and node.value.startswith("vllm_overlay.")):
                names.add(node.value.split(":")[0])
        out = set()
        for name in names:
            while name not in modules and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in modules:
                out.add(name)
        return out

    packages = {m for m, path in modules.items() if path.endswith("__init__.py")}
    graph = {m: (resolve(path, module_level=m in packages)) for m, path in modules.items()}
    for m in modules:  # importing m runs the __init__ of each package above it
        parts = m.split(".")
        graph[m] |= {".".join(parts[:i]) for i in range(1, len(parts))} & packages
        graph[m].discard(m)
    return graph


def path_to(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """The shortest chain of imports from ``start`` to ``goal``, or None."""
    prev: dict[str, str | None] = {start: None}
    todo = [start]
    while todo:
        nxt = []
        for m in todo:
            for n in sorted(graph.get(m, ())):
                if n not in prev:
                    prev[n] = m
                    nxt.append(n)
        todo = nxt
    if goal not in prev:
        return None
    chain = [goal]
    while (before := prev[chain[-1]]) is not None:
        chain.append(before)
    return chain[::-1]


def runtime_graph() -> dict[str, set[str]]:
    return import_graph({_module(f): f for f in runtime_files()})


CORE = "vllm_overlay.core"
PATCHES = "vllm_overlay.patches"
# the runtime modules besides the registry that name a patch module, each with why: anything else
# that reaches a patch goes through registry.PATCH_MODULES
NAMES_PATCHES = {
    "vllm_overlay.report": "report.SECTIONS: the owners of the report's sections, imported so every report "
                           "carries every key",
}


def test_no_chain_of_imports_leads_from_a_patch_to_core() -> None:
    """Seen or hidden: no patch module, nor anything it imports at any depth (inside functions, through
    importlib), reaches core. Core hands the patches what they need (PatchContext, through the hook bind)."""
    graph = runtime_graph()
    patches = [m for m in graph if _is(m, (PATCHES,))]
    assert len(patches) > 10 and CORE in graph
    chains = {m: chain for m in patches if (chain := path_to(graph, m, CORE))}
    assert not chains, "; ".join(" -> ".join(c) for c in chains.values())


def test_core_reaches_the_patches_only_through_the_registry() -> None:
    """core.py names no patch module (it imports registry.PATCH_MODULES' names); besides the registry,
    only the modules of NAMES_PATCHES name one, each for the reason given."""
    graph = runtime_graph()
    assert {m for m in graph[CORE] if _is(m, (PATCHES,))} == set()
    assert "vllm_overlay.registry" in graph[CORE]
    naming = {m for m, out in graph.items() if not _is(m, (PATCHES,)) and any(_is(n, (PATCHES,)) for n in out)}
    assert naming == {"vllm_overlay.registry", *NAMES_PATCHES}, sorted(naming)


def test_the_graph_sees_a_cycle_hidden_in_a_function_or_a_string(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pkg = tmp_path / "vllm_overlay"
    (pkg / "patches").mkdir(parents=True)
    (pkg / "__init__.py").write_text("def register():\n    from vllm_overlay.core import go\n")
    (pkg / "core.py").write_text("from vllm_overlay import registry\n")
    (pkg / "registry.py").write_text("PATCH_MODULES = ('vllm_overlay.patches.a',)\n")
    (pkg / "helper.py").write_text("import importlib\ndef later():\n    importlib.import_module('vllm_overlay.core')\n")
    (pkg / "patches" / "__init__.py").write_text("")
    (pkg / "patches" / "a.py").write_text("from vllm_overlay import __version__\ndef f():\n"
                                          "    from vllm_overlay.helper import later\n")
    files = {"vllm_overlay": pkg / "__init__.py", "vllm_overlay.core": pkg / "core.py",
             "vllm_overlay.registry": pkg / "registry.py", "vllm_overlay.helper": pkg / "helper.py",
             "vllm_overlay.patches": pkg / "patches" / "__init__.py", "vllm_overlay.patches.a": pkg / "patches" / "a.py"}
    graph = import_graph({m: str(p) for m, p in files.items()}, str(tmp_path))
    assert path_to(graph, "vllm_overlay.patches.a", CORE) == [
        "vllm_overlay.patches.a", "vllm_overlay.helper", CORE]
    # the package is entered at import time only: register()'s import of core is no edge
    assert CORE not in graph["vllm_overlay"]
    (pkg / "helper.py").write_text("def later():\n    pass\n")
    graph = import_graph({m: str(p) for m, p in files.items()}, str(tmp_path))
    assert path_to(graph, "vllm_overlay.patches.a", CORE) is None

MUTATORS = ("append", "extend", "update", "setdefault", "pop", "clear", "insert", "remove")


def _writes(tree: ast.AST, reaches: Any) -> list[tuple[int, str]]:
    """(line, what) for every write ``reaches`` names: an assignment to a field or into it
    (``X.f = v``, ``X.f[k] = v``, ``X.f += 1``) or a mutating call on it (``X.f.append(...)``);
    ``reaches(node)`` gives the name of the field an expression reaches into, or None."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        out += [(node.lineno, f"assigns {name}") for t in targets if (name := reaches(t))]
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
                and (name := reaches(node.func.value))):
            out.append((node.lineno, f"{name}.{node.func.attr}(...)"))
    return sorted(out)


def state_writes(path: str, names: frozenset[str] = frozenset({"STATE"})) -> list[tuple[int, str]]:
    """(line, what) for every write of a field of report.STATE, or of a report section (``names``: the
    module-level names the sections are bound to, ``BUFFERS = report.section(...)``), that the file
    makes, whether it names the object (``STATE.x``) or its module (``_gdn_buffers.BUFFERS.items``).
    Their own methods (``STATE.count(...)``, ``BUFFERS.add(...)``) are not writes."""
    def field(node: ast.AST) -> str | None:  # the field of a named object an expression reaches into
        while isinstance(node, (ast.Subscript, ast.Attribute)):
            if isinstance(node, ast.Attribute):
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in names:
                    return f"{owner.id}.{node.attr}"
                if isinstance(owner, ast.Attribute) and owner.attr in names:
                    return f"{owner.attr}.{node.attr}"
            node = node.value
        return None

    return _writes(ast.parse(open(path).read(), path), field)


def section_names() -> frozenset[str]:
    """The module-level names every runtime file binds a report section to (``X = report.section(...)``)."""
    out = set()
    for path in runtime_files():
        for node in ast.parse(open(path).read(), path).body:
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                    and ast.unparse(node.value.func) in ("report.section", "section")):
                out.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return frozenset(out)


def test_patches_write_the_report_only_through_its_helpers() -> None:
    """A patch, and every module that owns a section of the report, changes the report through
    report.py's helpers (patch_note, patch_put, ...), STATE's methods and the sections' methods
    (BUFFERS.add, ENGINE_CONFIG.replace, TELEMETRY.record, ...), never by writing a field of STATE or
    of a section itself: the lock is held and the flusher told in one place."""
    from vllm_overlay import report

    names = section_names() | {"STATE"}
    assert {"BUDGETS", "BUFFERS", "ENGINE_CONFIG", "RUNNER_REPORT", "RANKS", "TELEMETRY"} <= names
    owners = {os.path.join(SRC, *m.split(".")) + ".py" for m in report.SECTIONS.values()}
    patches = os.path.join(PKG, "patches")
    bad = [f"{os.path.relpath(path, SRC)}:{line} {what}" for path in runtime_files()
           if path.startswith(patches + os.sep) or path in owners for line, what in state_writes(path, names)]
    assert not bad, "; ".join(bad)


def test_the_state_check_sees_each_kind_of_write(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "m.py"
    path.write_text("def f():\n    STATE.runner = {}\n    STATE.engine_config['a'] = 1\n    STATE.dirty |= True\n"
                    "    with STATE.lock:\n        STATE.buffers.append(1)\n    STATE.patches['x'].update(a=1)\n"
                    "    STATE.count('guard_checks')\n    x = STATE.buffers\n    BUFFERS.items.append(2)\n"
                    "    _gdn_buffers.BUFFERS.items[0]['rows'] = 3\n    BUFFERS.add({})\n    RANKS.ranks = None\n")
    assert state_writes(str(path), frozenset({"STATE", "BUFFERS", "RANKS"})) == [
        (2, "assigns STATE.runner"), (3, "assigns STATE.engine_config"), (4, "assigns STATE.dirty"),
        (6, "STATE.buffers.append(...)"), (7, "STATE.patches.update(...)"), (10, "BUFFERS.items.append(...)"),
        (11, "assigns BUFFERS.items"), (13, "assigns RANKS.ranks")]


# a section's own methods that set its data up: everything else changes it inside ``with self.changing()``
SETUP = ("__init__", "reset", "after_fork")


def unguarded_changes(cls_source: str) -> list[tuple[int, str]]:
    """(line, what) for every write of a field of ``self`` in a section class's methods (but SETUP)
    made outside a ``with self.changing(...)`` block."""
    cls = ast.parse(textwrap.dedent(cls_source)).body[0]
    assert isinstance(cls, ast.ClassDef)

    def field(node: ast.AST) -> str | None:
        while isinstance(node, (ast.Subscript, ast.Attribute)):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                return f"self.{node.attr}"
            node = node.value
        return None

    def guarded(stmt: ast.With) -> bool:
        return any(ast.unparse(item.context_expr).startswith("self.changing(") for item in stmt.items)

    out: list[tuple[int, str]] = []

    def visit(stmts: list[ast.stmt]) -> None:
        for stmt in stmts:
            if isinstance(stmt, ast.With) and guarded(stmt):
                continue
            blocks = [b for f in ("body", "orelse", "finalbody") if isinstance(b := getattr(stmt, f, None), list)]
            handlers = [h.body for h in getattr(stmt, "handlers", None) or []]
            if not blocks and not handlers:
                out.extend(_writes(stmt, field))
                continue
            out.extend(_writes(_shallow(stmt), field))  # an if's test, a for's target
            for block in blocks + handlers:
                visit(block)

    for fn in cls.body:
        if isinstance(fn, ast.FunctionDef) and fn.name not in SETUP:
            visit(fn.body)
    return sorted(set(out))


def _shallow(stmt: ast.stmt) -> ast.stmt:
    """A compound statement without its blocks (its test or iterator alone can write too)."""
    import copy

    node = copy.copy(stmt)
    for f in ("body", "orelse", "finalbody", "handlers"):
        if hasattr(node, f):
            setattr(node, f, [])
    return node


def test_sections_change_their_data_only_under_the_lock() -> None:
    """Every section of the report (``report.SECTIONS``, each registered by the module listed for it)
    changes its data inside ``with self.changing()`` (the state's lock held, the report marked for the
    flusher) outside the methods that set it up; no section's key is one ProcessState writes itself."""
    import importlib
    import inspect

    from vllm_overlay import report

    report.load_owners()
    assert set(report.STATE.sections) == set(report.SECTIONS)
    for key, module in report.SECTIONS.items():
        sec = report.STATE.sections[key]
        assert sec.key == key and sec in vars(importlib.import_module(module)).values(), (key, module)
    assert not set(report.SECTIONS) & set(report.ProcessState().to_json())
    bad = []
    classes = {c for sec in report.STATE.sections.values() for c in type(sec).__mro__
               if c.__module__.startswith("vllm_overlay.")}
    for cls in sorted(classes, key=lambda c: (c.__module__, c.__qualname__)):
        bad += [f"{cls.__module__}.{cls.__qualname__} (line {line} of the class) {what}"
                for line, what in unguarded_changes(inspect.getsource(cls))]
    assert not bad, "; ".join(bad)


def test_the_section_check_sees_an_unguarded_change() -> None:
    src = ("class S(Section):\n"
           "    def reset(self):\n        self.items = []\n"
           "    def add(self, x):\n        with self.changing():\n            self.items.append(x)\n"
           "    def bad(self, x):\n        self.items.append(x)\n        if x:\n            self.n = 1\n"
           "    def worse(self):\n        with STATE.lock:\n            self.items[0] = 2\n")
    assert unguarded_changes(src) == [(8, "self.items.append(...)"), (10, "assigns self.n"), (13, "assigns self.items")]


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
