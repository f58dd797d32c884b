"""The order of wrappers on a vLLM function that several patches change is declared in the specs
(``PatchSpec.wraps_outside``) and checked: the registry's install order agrees with every
declaration, and two patches that change one module:qualname on a release without an order
between them stop the registry from loading."""

from __future__ import annotations

import dataclasses
import importlib

import pytest

from vllm_overlay import core, versions
from vllm_overlay.errors import OverlayError
from vllm_overlay import levels
from vllm_overlay.mechanisms import wrap as wrapmech
from vllm_overlay.patches import _runner
from vllm_overlay.patches import gdn_output_prealloc as gdn
from vllm_overlay.report import STATE
from vllm_overlay.spec import PatchSpec, Support, Target, wrap_order, wrap_order_problems


def _w(wrapped, instance, args, kwargs):  # type: ignore[no-untyped-def]
    """A pass-through wrapper for the specs built here (never installed)."""
    return wrapped(*args, **kwargs)


DUMMY_RUN = f"{_runner.RUNNER_CLASS}._dummy_run"


def test_the_registry_declares_every_shared_function_in_install_order() -> None:
    assert wrap_order_problems(core.specs()) == []


@pytest.mark.parametrize("module", _runner.RUNNER_MODULES)
def test_profile_run_cap_is_outermost_on_dummy_run(module: str) -> None:
    cap = next(s for s in core.specs() if s.id == "profile-run-cap")
    assert cap.releases()
    for v in cap.releases():
        if module == _runner.V1_MODULE and not levels.runner_exists(v, "V1"):
            assert wrap_order(core.specs(), f"{module}:{DUMMY_RUN}", v) == [], v  # no V1 runner to wrap
            continue
        order = wrap_order(core.specs(), f"{module}:{DUMMY_RUN}", v)
        assert order == ["forward-telemetry", "gdn-output-prealloc", "profile-run-cap"], (v, order)


def _spec(pid: str, *targets: str, outside: tuple[str, ...] = ()) -> PatchSpec:
    return PatchSpec(
        id=pid, title=pid, why="", upstream="", mechanism="wrap", default=True, retire_when="",
        targets=tuple(Target("m", q, wrapper=_w) for q in targets),
        support=(Support(f">={versions.RELEASES[0]}", "applies", "test"),), wraps_outside=outside,
    )


def test_two_patches_on_one_function_without_an_order_are_named() -> None:
    problems = wrap_order_problems([_spec("a", "C.f"), _spec("b", "C.f", "C.g")])
    assert len(problems) == 1
    assert "'a' and 'b' both change m:C.f" in problems[0]
    assert "wraps_outside=('a',) on 'b'" in problems[0]
    assert wrap_order_problems([_spec("a", "C.f"), _spec("b", "C.f", "C.g", outside=("a",))]) == []
    assert wrap_order_problems([_spec("a", "C.f"), _spec("b", "C.g")]) == []  # nothing shared


def test_registry_order_contradicting_a_declaration_is_named() -> None:
    problems = wrap_order_problems([_spec("a", "C.f", outside=("b",)), _spec("b", "C.f")])
    assert problems == ["PatchSpec 'a': wraps_outside names 'b', but the registry installs 'a' first, so its "
                        "wrappers end up inside; expected 'b' listed before 'a' in PATCH_MODULES"]


def test_mutual_unknown_and_unshared_declarations_are_named() -> None:
    mutual = wrap_order_problems([_spec("a", "C.f", outside=("b",)), _spec("b", "C.f", outside=("a",))])
    assert any("each names the other" in p for p in mutual)
    unknown = wrap_order_problems([_spec("a", "C.f"), _spec("b", "C.f", outside=("a", "zz"))])
    assert unknown == ["PatchSpec 'b': wraps_outside names 'zz', which is no patch of the registry; "
                       "expected ids of: a, b"]
    unshared = wrap_order_problems([_spec("a", "C.f"), _spec("b", "C.g", outside=("a",))])
    assert len(unshared) == 1 and "change no vLLM function in common" in unshared[0]
    with pytest.raises(ValueError, match="names the patch itself"):
        _spec("a", "C.f", outside=("a",))
    with pytest.raises(ValueError, match="expected a tuple of patch ids"):
        _spec("a", "C.f", outside="b")  # type: ignore[arg-type]


def test_a_dropped_declaration_stops_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gdn, "SPEC", dataclasses.replace(gdn.SPEC, wraps_outside=()))
    with pytest.raises(OverlayError, match="'forward-telemetry' and 'gdn-output-prealloc' both change"):
        core.specs()


def test_installed_wrappers_follow_the_declared_order(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("VLLM_OVERLAY_REPORT_DIR", str(tmp_path / "reports"))
    monkeypatch.setenv("VLLM_OVERLAY_PROFILE_RUN_CAP", "64")
    mods = [importlib.import_module(m) for m in _runner.RUNNER_MODULES]
    importlib.import_module(_runner.WORKER_MODULE)  # imported first, so every hook fires at register()
    core.revert()
    STATE.reset()
    try:
        core.register()
        assert STATE.patches["profile-run-cap"]["status"] == "applied"
        version = STATE.vllm_version or ""
        for mod in mods:
            got = wrapmech.marks(vars(mod.GPUModelRunner)["_dummy_run"])
            declared = wrap_order(core.specs(), f"{mod.__name__}:{DUMMY_RUN}", version)
            assert got == list(reversed(declared)) == ["profile-run-cap", "gdn-output-prealloc",
                                                       "forward-telemetry"], mod.__name__
    finally:
        core.revert()
        STATE.reset()


def test_hooks_are_declared_in_the_spec(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A patch module's prepare()/on_revert()/bind() run only as its spec declares them (PatchSpec.hooks): a
    module that defines one its spec does not declare (or declares one it lacks) stops the registry."""
    import dataclasses

    import pytest

    from vllm_overlay import core
    from vllm_overlay.errors import OverlayError
    from vllm_overlay.patches import turboquant_v1_kv_shape as mod
    from vllm_overlay.spec import HOOKS, PatchSpec

    for spec, module in core.registry():
        defined = {h for h in HOOKS if callable(getattr(module, h, None))}
        assert set(spec.hooks) == defined, spec.id
    monkeypatch.setattr(mod, "SPEC", dataclasses.replace(mod.SPEC, hooks=()))
    core._order_checked[0] = ()
    with pytest.raises(OverlayError, match=r"turboquant_v1_kv_shape: SPEC.hooks=\(\) but the module defines "
                                           r"\('on_revert',\)"):
        core.registry()
    with pytest.raises(ValueError, match="hooks=\\('undo',\\): expected a tuple of distinct names from prepare, "
                                         "on_revert"):
        PatchSpec(**{**{f.name: getattr(mod.SPEC, f.name) for f in dataclasses.fields(PatchSpec)},
                     "hooks": ("undo",)})
