"""In-memory source rewrite, the last resort for code that cannot be wrapped.

The pristine source of the target function is read from the installed vLLM file (located with
``ast``, so the same bytes are hashed here and in the textual check against a wheel). The
rewrite applies only if the sha256 of those lines equals the value recorded for this exact vLLM
version and every anchor occurs exactly once. The new function is compiled against the live
module globals, with the target module's own ``from __future__`` flags and none of this file's
(``dont_inherit=True``), and rebound; nothing is ever written to disk. A target that someone
already wrapped (a ``__wrapped__`` chain, a wrapt proxy, one of our own wrappers) is refused:
rebinding it would silently drop that wrapper.
"""

from __future__ import annotations

import __future__
import ast
import hashlib
import importlib
import textwrap
from dataclasses import dataclass
from typing import Any

from vllm_overlay.errors import AnchorError
from vllm_overlay.mechanisms import wrap as wrapmech
from vllm_overlay.spec import Rewrite


_DESCRIPTORS = {"classmethod": classmethod, "staticmethod": staticmethod}


@dataclass(frozen=True)
class Located:
    source: str  # the function's lines as in the file, from ``def`` (indentation kept)
    first_line: int  # the ``def`` line
    decorator: str | None = None  # "classmethod" | "staticmethod" | None
    code_first_line: int = 0  # where the code object starts (the decorator's line, if any)


def locate(file_text: str, qualname: str, where: str) -> Located:
    """The lines of ``qualname`` (``Class.method`` or ``function``) in ``file_text``."""
    tree = ast.parse(file_text)
    body: list[ast.stmt] = tree.body
    node: ast.AST | None = None
    for part in qualname.split("."):
        node = next(
            (n for n in body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
             and n.name == part),
            None,
        )
        if node is None:
            raise AnchorError(f"{where}: {qualname} not found in the source")
        body = getattr(node, "body", [])
    assert node is not None and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    decorator = None
    if node.decorator_list:
        names = [d.id for d in node.decorator_list if isinstance(d, ast.Name)]
        if len(node.decorator_list) != 1 or names[0:1] not in (["classmethod"], ["staticmethod"]):
            raise AnchorError(
                f"{where}: {qualname} has decorators other than one @classmethod/@staticmethod; "
                "rewrite refuses it"
            )
        decorator = names[0]
    lines = file_text.splitlines(keepends=True)
    end = node.end_lineno or node.lineno
    first_code = node.decorator_list[0].lineno if node.decorator_list else node.lineno
    return Located("".join(lines[node.lineno - 1 : end]), node.lineno, decorator, first_code)


def future_flags(file_text: str) -> int:
    """Compiler flags of the ``from __future__ import ...`` statements of a module's source."""
    flags = 0
    for node in ast.parse(file_text).body:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            for alias in node.names:
                feature = getattr(__future__, alias.name, None)
                if isinstance(feature, __future__._Feature):
                    flags |= feature.compiler_flag
    return flags


def _refuse_wrapped(func: Any, where: str) -> None:
    """Rebinding a wrapped target would drop its wrapper: say whose it is and refuse."""
    chain = wrapmech.wrapper_chain(func)
    ours = wrapmech.marks(func)
    if ours:
        raise AnchorError(
            f"{where}: already wrapped by vllm-overlay patch {ours[0]!r}; a rewrite would drop that "
            "wrapper (rewrites must apply before wraps of the same target); refusing to rewrite"
        )
    if len(chain) > 1:
        outer = chain[0]
        raise AnchorError(
            f"{where}: already wrapped by someone else ({type(outer).__module__}.{type(outer).__qualname__} "
            f"over {len(chain) - 1} level(s), via __wrapped__); a rewrite would drop that wrapper; "
            "refusing to rewrite"
        )


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def rewritten_source(rw: Rewrite, pristine: Located, where: str) -> str:
    """Check hash and anchors; return the rewritten (dedented) function source."""
    got = sha256(pristine.source)
    if got != rw.sha256:
        raise AnchorError(
            f"{where}: pristine source hash mismatch for vLLM {rw.version}: recorded "
            f"{rw.sha256[:16]}..., found {got[:16]}... (the installed file differs from vLLM "
            f"{rw.version}'s; refusing to rewrite)"
        )
    text = textwrap.dedent(pristine.source)
    for i, edit in enumerate(rw.edits):
        count = text.count(edit.anchor)
        if count != 1:
            raise AnchorError(
                f"{where}: anchor #{i + 1} occurs {count} times (expected exactly 1): "
                f"{edit.anchor.strip().splitlines()[0]!r}"
            )
        text = text.replace(edit.anchor, _same_line_count(edit.anchor, edit.replacement))
    return text


def _same_line_count(anchor: str, replacement: str) -> str:
    """Pad a shorter replacement with comment lines, so every line after the edit keeps the line
    number it has in the installed file (tracebacks then point at the right source lines)."""
    missing = anchor.count("\n") - replacement.count("\n")
    if missing <= 0:
        return replacement
    last = replacement.rstrip("\n").splitlines()[-1]
    indent = last[: len(last) - len(last.lstrip())]
    return replacement + f"{indent}# (vllm-overlay rewrite: line kept so line numbers match the file)\n" * missing


def check_text(rw: Rewrite, file_text: str) -> str:
    """Textual check of a rewrite against a file's text (no import). Returns the new source."""
    where = f"{rw.target} (vLLM {rw.version})"
    return rewritten_source(rw, locate(file_text, rw.target.qualname, where), where)


def apply(rw: Rewrite, tag: str) -> wrapmech.Installed:
    """Rewrite ``rw.target`` in memory and rebind it. ``tag`` names the patch in the code object."""
    module = importlib.import_module(rw.target.module)
    where = f"{rw.target} (vLLM {rw.version})"
    owner, name, original = wrapmech.resolve(rw.target.module, rw.target.qualname)
    descriptor = next((k for k, t in _DESCRIPTORS.items() if isinstance(original, t)), None)
    func = original.__func__ if descriptor else original
    _refuse_wrapped(func, where)
    code = getattr(func, "__code__", None)
    if code is None:
        raise AnchorError(f"{where}: not a plain function; cannot rewrite")
    if code.co_freevars:
        raise AnchorError(f"{where}: uses closure variables {code.co_freevars}; cannot rewrite")
    file_name = module.__file__
    assert file_name is not None
    with open(file_name, encoding="utf-8") as f:
        file_text = f.read()
    pristine = locate(file_text, rw.target.qualname, where)
    if pristine.decorator != descriptor:
        raise AnchorError(
            f"{where}: the file declares it as {pristine.decorator or 'a plain function'} but the live "
            f"attribute is {descriptor or 'a plain function'}; refusing to rewrite"
        )
    if code.co_firstlineno != pristine.code_first_line or code.co_filename != file_name:
        raise AnchorError(
            f"{where}: the live function is not the one in {file_name} (already replaced by "
            "someone else?); refusing to rewrite"
        )
    new_source = rewritten_source(rw, pristine, where)
    # keep line numbers close to the file's for tracebacks; the filename stays the real one
    padded = "\n" * (pristine.first_line - 1) + new_source
    namespace: dict[str, Any] = {}
    code_obj = compile(padded, file_name, "exec", flags=future_flags(file_text), dont_inherit=True)
    exec(code_obj, module.__dict__, namespace)  # noqa: S102
    new = namespace[name]
    new.__qualname__ = func.__qualname__
    new.__module__ = func.__module__
    new.__doc__ = func.__doc__
    new.__vllm_overlay__ = tag
    return wrapmech.rebind(rw.target.module, rw.target.qualname,
                           _DESCRIPTORS[descriptor](new) if descriptor else new)
