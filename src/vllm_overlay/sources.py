"""Reading vLLM sources without importing vLLM: a wheel's files or the installed package's, and
finding where ``module:qualname`` is defined with ``ast`` (used by the support sweep)."""

from __future__ import annotations

import ast
import os
import zipfile
from collections.abc import Callable
from dataclasses import dataclass

Reader = Callable[[str], str]  # path relative to the vllm package -> file text


def module_path(module: str, read: Reader) -> str:
    """The file of ``module`` (``vllm.a.b``) relative to the vllm package: a/b.py or a/b/__init__.py."""
    parts = module.split(".")
    if parts[0] != "vllm":
        raise KeyError(f"{module}: not a vllm module")
    base = "/".join(parts[1:])
    for path in (f"{base}.py", f"{base}/__init__.py"):
        try:
            read(path)
            return path
        except (OSError, KeyError):
            continue
    raise KeyError(f"{module}: no {base}.py or {base}/__init__.py")


@dataclass(frozen=True)
class Found:
    module: str  # where the attribute is really defined (a base class may live elsewhere)
    qualname: str
    path: str
    line: int
    params: tuple[str, ...] = ()  # a function's parameter names (positional and keyword)


def _defs(body: list[ast.stmt]) -> dict[str, ast.AST]:
    out: dict[str, ast.AST] = {}
    for n in body:
        if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            out[n.name] = n
        elif isinstance(n, ast.Assign):
            for t in n.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = n
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.value is not None:
            out[n.target.id] = n
    return out


def _imported(tree: ast.Module, name: str, module: str) -> tuple[str, str] | None:
    """(module, name) that ``from X import name [as alias]`` at the top of a module binds to ``name``."""
    for n in tree.body:
        if isinstance(n, ast.ImportFrom):
            for alias in n.names:
                if (alias.asname or alias.name) == name:
                    src = n.module or ""
                    if n.level:  # relative import
                        pkg = module.split(".")[: -n.level]
                        src = ".".join(pkg + ([src] if src else []))
                    return src, alias.name
    return None


def find(module: str, qualname: str, read: Reader, _depth: int = 0) -> Found:
    """Where ``module:qualname`` is defined; a method missing from its class is looked up in the
    class's bases (followed through ``from X import Base`` into other modules). Raises KeyError."""
    if _depth > 8:
        raise KeyError(f"{module}:{qualname}: base classes nested too deep")
    path = module_path(module, read)
    tree = ast.parse(read(path))
    first, *rest = qualname.split(".")
    node = _defs(tree.body).get(first)
    if node is None:
        imp = _imported(tree, first, module)
        if imp is not None and imp[0].startswith("vllm"):
            return find(imp[0], ".".join([imp[1], *rest]), read, _depth + 1)
        raise KeyError(f"{module}:{qualname}: {first} is not defined in vllm/{path}")
    for i, part in enumerate(rest):
        if not isinstance(node, ast.ClassDef):
            raise KeyError(f"{module}:{qualname}: {'.'.join([first, *rest[:i]])} is not a class")
        member = _defs(node.body).get(part)
        if member is None:
            for base in node.bases:
                base_name = ast.unparse(base)
                if "." in base_name or "[" in base_name:
                    continue
                try:
                    return find(module, ".".join([base_name, *rest[i:]]), read, _depth + 1)
                except KeyError:
                    continue
            raise KeyError(f"{module}:{qualname}: {node.name} (vllm/{path}) and its bases have no {part!r}")
        node = member
    params: tuple[str, ...] = ()
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        a = node.args
        params = tuple(x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs))
    return Found(module, qualname, path, getattr(node, "lineno", 0), params)


def wheel_reader(wheel: str) -> Reader:
    zf = zipfile.ZipFile(wheel)

    def read(path: str) -> str:
        return zf.read(f"vllm/{path}").decode("utf-8")

    return read


def installed_reader() -> Reader:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise OSError("vLLM is not installed in this environment")
    root = list(spec.submodule_search_locations)[0]

    def read(path: str) -> str:
        with open(os.path.join(root, path), encoding="utf-8") as f:
            return f.read()

    return read
