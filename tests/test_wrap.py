"""The wrap mechanism on a module made here (no vLLM needed): marks, several patches on one
method, the same patch twice refused, revert order. tests/test_wrapt_majors.py runs this file
again under the other wrapt major."""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Iterator

import pytest
import wrapt

from vllm_overlay.mechanisms import wrap as wrapmech

MOD = "overlay_test_target_mod"


@pytest.fixture
def target() -> Iterator[types.ModuleType]:
    mod = types.ModuleType(MOD)

    class Runner:
        def run(self, n: int) -> int:
            return n

    def plain(n: int) -> int:
        return n + 1

    mod.Runner = Runner  # type: ignore[attr-defined]
    mod.plain = plain  # type: ignore[attr-defined]
    sys.modules[MOD] = mod
    yield mod
    del sys.modules[MOD]


def _adder(k: int):  # type: ignore[no-untyped-def]
    def wrapper(wrapped, instance, args, kwargs):  # type: ignore[no-untyped-def]
        return wrapped(*args, **kwargs) + k

    return wrapper


def test_several_patches_on_one_method_and_revert(target: types.ModuleType) -> None:
    original = vars(target.Runner)["run"]
    a = wrapmech.wrap(MOD, "Runner.run", _adder(10), patch="patch-a")
    b = wrapmech.wrap(MOD, "Runner.run", _adder(100), patch="patch-b")
    assert target.Runner().run(1) == 111
    assert wrapmech.marks(vars(target.Runner)["run"]) == ["patch-b", "patch-a"]
    # an outer wrapper reports its own mark, never the inner one's through the proxy
    assert wrapmech.mark_of(vars(target.Runner)["run"]) == "patch-b"
    assert wrapmech.mark_of(original) is None
    b.undo()
    a.undo()
    assert vars(target.Runner)["run"] is original and target.Runner().run(1) == 1


def test_same_patch_twice_is_refused(target: types.ModuleType) -> None:
    a = wrapmech.wrap(MOD, "Runner.run", _adder(10), patch="patch-a")
    b = wrapmech.wrap(MOD, "Runner.run", _adder(100), patch="patch-b")
    with pytest.raises(RuntimeError, match="already wrapped by vllm-overlay patch 'patch-a'"):
        wrapmech.wrap(MOD, "Runner.run", _adder(1), patch="patch-a")
    p = wrapmech.wrap(MOD, "plain", _adder(1), patch="patch-b")
    with pytest.raises(RuntimeError, match="'patch-b'"):
        wrapmech.wrap(MOD, "plain", _adder(1), patch="patch-b")
    p.undo()
    b.undo()
    a.undo()


def test_patch_id_comes_from_installing(target: types.ModuleType) -> None:
    with pytest.raises(ValueError, match="patch=None"):
        wrapmech.wrap(MOD, "plain", _adder(1))
    with wrapmech.installing("patch-c"):
        inst = wrapmech.wrap(MOD, "plain", _adder(1))
    assert wrapmech.mark_of(target.plain) == "patch-c" and target.plain(1) == 3
    inst.undo()


def test_foreign_wrappers_are_not_ours(target: types.ModuleType) -> None:
    """A wrapt proxy or functools.wraps wrapper made by someone else carries no mark, and wrapping
    over it still works (our mark sits on our own wrapper only)."""
    foreign = wrapt.FunctionWrapper(target.plain, _adder(5))
    target.plain = foreign  # type: ignore[attr-defined]
    assert wrapmech.marks(foreign) == []

    @functools.wraps(foreign)
    def outer(n: int) -> int:
        return foreign(n)

    assert wrapmech.marks(outer) == [] and len(wrapmech.wrapper_chain(outer)) == 3
    inst = wrapmech.wrap(MOD, "plain", _adder(1), patch="patch-a")
    assert target.plain(1) == 8 and wrapmech.marks(target.plain) == ["patch-a"]
    inst.undo()
    assert target.plain is foreign


def test_undo_refuses_to_restore_over_someone_elses_change(target: types.ModuleType) -> None:
    inst = wrapmech.wrap(MOD, "plain", _adder(1), patch="patch-a")
    theirs = lambda n: n  # noqa: E731
    target.plain = theirs  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="changed by someone else"):
        inst.undo()
    assert target.plain is theirs


def test_undo_cuts_a_wrapper_out_from_under_another_patch(target: types.ModuleType) -> None:
    """A patch that fails (or is reverted) after another patch wrapped over it leaves no wrapper
    behind: it is cut out of the chain, and the outer patch's own undo still restores the original."""
    original = vars(target.Runner)["run"]
    a = wrapmech.wrap(MOD, "Runner.run", _adder(10), patch="patch-a")
    b = wrapmech.wrap(MOD, "Runner.run", _adder(100), patch="patch-b")
    c = wrapmech.wrap(MOD, "Runner.run", _adder(1000), patch="patch-c")
    b.undo()  # the middle one
    assert wrapmech.marks(vars(target.Runner)["run"]) == ["patch-c", "patch-a"]
    assert target.Runner().run(1) == 1011
    a.undo()  # now the innermost
    assert wrapmech.marks(vars(target.Runner)["run"]) == ["patch-c"] and target.Runner().run(1) == 1001
    c.undo()
    assert vars(target.Runner)["run"] is original and target.Runner().run(1) == 1
    assert not any(id(i.replacement) in wrapmech._LIVE for i in (a, b, c))
