"""A patch module declares its targets as constants before its SPEC and binds each wrapper to them with
``@wraps(TARGET, ...)`` on the function (spec.wraps): the installer wraps with that function object, and
the registry check refuses a target left without a wrapper or rewrite, and a function bound to a target
its SPEC does not list, naming the patch and the target. ``why_from`` is the one way a spec's why is
built from its module's docstring. Pure: no engine (the installer runs on a stand-in module)."""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import Any

import pytest

from vllm_overlay import core
from vllm_overlay.errors import OverlayError
from vllm_overlay.mechanisms import install as installmech
from vllm_overlay.mechanisms import wrap as wrapmech
from vllm_overlay.patches import compile_cache_key as cck
from vllm_overlay.patches import prefill_chunk_clamp as pcc
from vllm_overlay.spec import PatchSpec, Support, Target, binding_problems, why_from, wraps


def _spec(*targets: Target) -> PatchSpec:
    return PatchSpec(id="p", title="p", why="", upstream="", mechanism="wrap", default=True, retire_when="",
                     targets=targets, support=(Support(">=0.20.0", "applies", "t"),))


def test_wraps_binds_the_function_object_to_each_target() -> None:
    a, b = Target("m", "C.f"), Target("m", "C.g", params=("x",))

    @wraps(a, b)
    def _f(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return wrapped(*args, **kwargs)

    assert a.wrapper is _f and b.wrapper is _f and a.wrapper_name == "_f"
    assert _spec(a, b).wrap_targets("0.32.0") == (a, b)
    assert binding_problems(_spec(a, b)) == []
    assert a == Target("m", "C.f")  # the binding is no part of a target's value
    with pytest.raises(ValueError, match=r"@wraps\(m:C.f\) on .*\._g: the target is already bound to .*\._f; "
                                         "expected one wrapper per target"):
        @wraps(a)
        def _g(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            return None


def test_a_wrapper_named_by_a_string_or_a_bad_decorator_is_refused() -> None:
    with pytest.raises(TypeError, match=r"Target m:C.f: wrapper='_f': expected the wrapper function itself"):
        Target("m", "C.f", wrapper="_f")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"wraps\(\): no target given"):
        wraps()
    with pytest.raises(TypeError, match=r"wraps\('m:C.f'\): expected Target objects"):
        wraps("m:C.f")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"@wraps\(m:C.f\) on 3: expected a function"):
        wraps(Target("m", "C.f"))(3)  # type: ignore[type-var]


def test_an_unbound_target_is_named_by_the_check_and_refused_by_the_installer() -> None:
    loose = Target("overlay_test_binding_mod", "f")
    spec = _spec(loose)
    want = ("PatchSpec 'p': target overlay_test_binding_mod:f has no wrapper and no recorded rewrite; expected the "
            "patch module's wrapper function bound to it with @wraps(TARGET) (or a rewrite of it in rewrites)")
    assert binding_problems(spec) == [want]
    mod = types.ModuleType("overlay_test_binding_mod")
    mod.f = lambda: 1  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    try:
        with wrapmech.installing("p"), pytest.raises(ValueError, match="has no wrapper and no recorded rewrite"):
            installmech.install(spec, types.ModuleType("patch"), mod.__name__, "0.32.0")
        assert mod.f() == 1  # nothing installed
    finally:
        del sys.modules[mod.__name__]


def test_the_registry_names_an_unbound_target_of_a_patch(monkeypatch: pytest.MonkeyPatch) -> None:
    extra = Target(pcc.MODULE, "Scheduler.schedule")
    monkeypatch.setattr(pcc, "SPEC", dataclasses.replace(pcc.SPEC, targets=(*pcc.SPEC.targets, extra)))
    with pytest.raises(OverlayError, match=r"vllm_overlay.patches.prefill_chunk_clamp: its targets and wrappers "
                                           r"are not bound consistently: PatchSpec 'prefill-chunk-clamp': target "
                                           r"vllm.v1.core.sched.scheduler:Scheduler.schedule has no wrapper"):
        core.registry()


def test_the_registry_names_a_wrapper_bound_to_a_target_its_spec_does_not_list(
        monkeypatch: pytest.MonkeyPatch) -> None:
    stray = Target(pcc.MODULE, "Scheduler.schedule")

    def _schedule(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return wrapped(*args, **kwargs)

    monkeypatch.setattr(pcc, "_schedule", wraps(stray)(_schedule), raising=False)
    with pytest.raises(OverlayError, match=r"PatchSpec 'prefill-chunk-clamp': vllm_overlay.patches."
                                           r"prefill_chunk_clamp._schedule is bound with @wraps to target "
                                           r"vllm.v1.core.sched.scheduler:Scheduler.schedule, which SPEC.targets "
                                           r"does not list; expected a Target of SPEC.targets "
                                           r"\(vllm.v1.core.sched.scheduler:Scheduler.__init__\)"):
        core.registry()


def test_every_registry_patch_binds_each_target_once_by_object() -> None:
    for spec, mod in core.registry():
        assert binding_problems(spec, mod) == [], spec.id
        for t in spec.targets:
            if t.wrapper is not None:
                assert getattr(mod, t.wrapper_name) is t.wrapper, (spec.id, str(t))
    assert cck.COMPUTE_HASH.wrapper is cck._compute_hash  # the lazily built SPEC lists the bound constants
    assert cck.SPEC.targets == (cck.COMPUTE_HASH, cck.COMPILE_FACTORS)


def test_why_from_joins_paragraphs_two_and_three_with_whitespace_normalised() -> None:
    doc = "title: the line.\n\nFirst  paragraph\nwraps here.\n\n- a list\n  item\n\nNot this one."
    assert why_from(doc) == "First paragraph wraps here. - a list item"
    assert why_from("title.\n\nOnly one.\n") == "Only one."
    with pytest.raises(ValueError, match=r"why_from\(doc='title only'...\): expected a module docstring"):
        why_from("title only")
    with pytest.raises(ValueError, match="expected a module docstring"):
        why_from(None)


def test_every_patch_module_reads_docstring_then_spec_then_behaviour() -> None:
    """Each registry patch module: its docstring first; every Target constant before the SPEC (or the
    function that builds a lazy SPEC, compile-cache-key's _spec); every function bound with @wraps after
    it; a function before the SPEC only where the SPEC's own data calls it (traced_settings, _edit)."""
    import ast
    import importlib

    from vllm_overlay.registry import PATCH_MODULES

    problems = []
    for name in PATCH_MODULES:
        path = importlib.import_module(name).__file__
        assert path is not None
        tree = ast.parse(open(path).read(), path)
        if not (ast.get_docstring(tree) or "").strip() or not isinstance(tree.body[0], ast.Expr):
            problems.append(f"{name}: no docstring first")
        spec = next((n for n in tree.body if (isinstance(n, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "SPEC" for t in n.targets))
            or (isinstance(n, ast.FunctionDef) and n.name == "_spec")), None)
        if spec is None:
            problems.append(f"{name}: no SPEC")
            continue
        before = tree.body[: tree.body.index(spec) + 1]
        called = {n.func.id for node in before if not isinstance(node, ast.FunctionDef) or node is spec
                  for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "Target" \
                    and node.lineno > spec.lineno:
                problems.append(f"{name}:{node.lineno}: a Target after the SPEC")
            if isinstance(node, ast.FunctionDef):
                bound = any(ast.unparse(d).startswith("wraps(") for d in node.decorator_list)
                if node.lineno < spec.lineno and (bound or node.name not in called):
                    problems.append(f"{name}:{node.lineno}: {node.name} before the SPEC")
    assert not problems, problems
