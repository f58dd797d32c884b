"""The layout, and the docs that describe it: docs/architecture.md and CONTRIBUTING.md name only files that
exist (every file and folder of their text diagrams, under src/vllm_overlay/ for the runtime,
src/vllm_overlay/tools/ for the tools, or the project root, and every path they write in backticks), the
layers' diagram fits on one screen, and the serving-stack driver bench/stack/ is a package of files that
each say what they hold, none of 600 lines or more."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "src", "vllm_overlay")
BASES = (PKG, os.path.join(PKG, "tools"), ROOT, os.path.join(ROOT, "src"))
DOCS = ("docs/architecture.md", "CONTRIBUTING.md")
NAME = re.compile(r"(?<![\w/.-])[\w.-]+(?:/[\w.*-]+)*(?:\.py|\.json|\.md|/)(?=[\s,;:)]|$)")
# paths in backticks that are not files of this project: vLLM's own sources and tests, names made at run
# time (the report files, the demo's output folder) and placeholders (NAME, ID, X)
NOT_OURS = re.compile(r"^(vllm/|tests/v1/|demo-out/|overlay-KEY|release-proposals/)|(NAME|ID|-X)\.(py|md)$")


def _text(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def _diagrams(rel: str) -> list[str]:
    """The fenced blocks of ``rel`` without a language: its text diagrams."""
    blocks, lang, lines = [], None, []  # lang: None outside a block, else the opening fence's language
    for line in _text(rel).splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, lines = line[3:].strip(), []
                continue
            if lang == "":
                blocks.append("\n".join(lines))
            lang = None
        elif lang is not None:
            lines.append(line)
    return blocks


def _exists(name: str) -> bool:
    name = name.rstrip("/")
    if "*" in name:
        import glob

        return any(glob.glob(os.path.join(base, name)) for base in BASES)
    if any(os.path.exists(os.path.join(base, name)) for base in BASES):
        return True
    # a bare file name, read with the folder its sentence names: somewhere in the sources, scripts or tests
    return "/" not in name and any(name in files or name in dirs for top in ("src", "bench", "scripts", "tests")
                                   for _, dirs, files in os.walk(os.path.join(ROOT, top)))


def test_the_diagrams_name_only_files_that_exist() -> None:
    layers = _diagrams("docs/architecture.md")[0]
    code = next(b for b in _diagrams("CONTRIBUTING.md") if "RUNTIME" in b)
    assert "RUNTIME" in layers and "TOOLS" in layers and "TOOLS" in code
    names = {n for block in (layers, code) for n in NAME.findall(block)}
    assert {"core.py", "registry.py", "patches/*.py", "metrics.py", "cli/", "stress/", "tune/"} <= names, sorted(names)
    missing = sorted(n for n in names if not NOT_OURS.search(n) and not _exists(n))
    assert not missing, missing


def test_the_layers_diagram_fits_one_screen() -> None:
    lines = _diagrams("docs/architecture.md")[0].splitlines()
    assert len(lines) <= 40 and max(len(ln) for ln in lines) <= 110, (len(lines), max(len(ln) for ln in lines))


def test_every_path_in_backticks_exists() -> None:
    missing = {}
    for rel in DOCS:
        ticked = set(re.findall(r"`([\w./*-]+(?:\.py|\.json|\.md|/))`", _text(rel)))
        bad = sorted(n for n in ticked if not NOT_OURS.search(n) and not _exists(n))
        if bad:
            missing[rel] = bad
    assert not missing, missing


def test_the_check_sees_a_name_that_does_not_exist() -> None:
    assert _exists("core.py") and _exists("cli/main.py") and _exists("bench/stack/") and _exists("patches/*.py")
    assert not _exists("kernels/tq_reference.py") and not _exists("no_such_module.py")


STACK_FILES = ("server", "measure", "collect", "verdicts", "schedule", "cli")


def test_the_stack_driver_is_a_package_of_small_named_files() -> None:
    folder = os.path.join(ROOT, "bench", "stack")
    assert os.path.isfile(os.path.join(folder, "__init__.py"))
    files = sorted(f for f in os.listdir(folder) if f.endswith(".py"))
    assert {f"{n}.py" for n in STACK_FILES} <= set(files), files
    sizes = {f: sum(1 for _ in open(os.path.join(folder, f), encoding="utf-8")) for f in files}
    assert all(n < 600 for n in sizes.values()), sizes
    with open(os.path.join(ROOT, "bench", "stack.py"), encoding="utf-8") as f:  # the script's path, kept
        assert sum(1 for _ in f) < 600
