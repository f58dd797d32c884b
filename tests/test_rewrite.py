"""The source rewrite compiles with its target module's semantics and refuses wrapped targets
(modules written here, no vLLM needed)."""

from __future__ import annotations

import functools
import importlib
import sys

import pytest
import wrapt

from vllm_overlay.errors import AnchorError
from vllm_overlay.mechanisms import rewrite
from vllm_overlay.mechanisms import wrap as wrapmech
from vllm_overlay.spec import Edit, Rewrite, Target

PLAIN = "def f(x: int) -> int:\n    return x + 1\n"
FUTURE = "from __future__ import annotations\n\n" + PLAIN
EDIT = Edit("    return x + 1\n", "    return x + 2\n")


def _module(tmp_path, monkeypatch, name: str, text: str):  # type: ignore[no-untyped-def]
    (tmp_path / f"{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(name, None)
    mod = importlib.import_module(name)
    monkeypatch.setitem(sys.modules, name, mod)
    rw = Rewrite(Target(name, "f"), "test", f"{name}.py",
                 rewrite.sha256(rewrite.locate(text, "f", "f").source), (EDIT,))
    return mod, rw


@pytest.mark.parametrize("text,expect", [(PLAIN, int), (FUTURE, "int")], ids=["plain", "future-annotations"])
def test_rewrite_compiles_with_the_target_modules_future_flags(tmp_path, monkeypatch, text, expect) -> None:  # type: ignore[no-untyped-def]
    """This file (like rewrite.py) has ``from __future__ import annotations``; the rewritten
    function's annotations follow the target module's choice, not ours."""
    name = f"vo_rw_{'future' if 'future' in text else 'plain'}"
    mod, rw = _module(tmp_path, monkeypatch, name, text)
    assert mod.f.__annotations__["x"] == expect
    inst = rewrite.apply(rw, "t")
    try:
        assert mod.f(1) == 3
        assert mod.f.__annotations__["x"] == expect and mod.f.__annotations__["return"] == expect
    finally:
        inst.undo()
    assert mod.f(1) == 2


def test_future_flags_reads_the_modules_own_imports() -> None:
    import __future__

    assert rewrite.future_flags(PLAIN) == 0
    assert rewrite.future_flags(FUTURE) == __future__.annotations.compiler_flag


def _refused(mod, rw, match: str) -> None:  # type: ignore[no-untyped-def]
    before = mod.f
    with pytest.raises(AnchorError, match=match):
        rewrite.apply(rw, "t")
    assert mod.f is before  # the wrapper stays in place


def test_refuses_a_target_wrapped_by_functools_wraps(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    mod, rw = _module(tmp_path, monkeypatch, "vo_rw_wrapped", PLAIN)
    inner = mod.f

    @functools.wraps(inner)
    def outer(x: int) -> int:
        return inner(x) * 10

    mod.f = outer
    _refused(mod, rw, r"already wrapped by someone else \(builtins.function over 1 level")


def test_refuses_a_target_wrapped_by_a_foreign_wrapt_proxy(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    mod, rw = _module(tmp_path, monkeypatch, "vo_rw_wrapt", PLAIN)
    mod.f = wrapt.FunctionWrapper(mod.f, lambda w, i, a, k: w(*a, **k))
    _refused(mod, rw, "already wrapped by someone else")


def test_refuses_a_target_wrapped_by_one_of_our_patches(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    mod, rw = _module(tmp_path, monkeypatch, "vo_rw_ours", PLAIN)
    inst = wrapmech.wrap("vo_rw_ours", "f", lambda w, i, a, k: w(*a, **k), patch="patch-a")
    try:
        _refused(mod, rw, "already wrapped by vllm-overlay patch 'patch-a'")
    finally:
        inst.undo()
