"""compile-cache-key folds the settings the traced-code patches declare (``traced_settings``) into
vLLM's compile-cache key: the list comes from the specs, and the key is what it always was."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from vllm_overlay import __version__, core
from vllm_overlay.patches import compile_cache_key as cck
from vllm_overlay.patches import gdn_output_prealloc as gdn
from vllm_overlay.spec import PatchSpec, Support, Target

GDN_TRACED = ("VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET", "VLLM_OVERLAY_GDN_MAX_BATCHED_TOKENS",
              "VLLM_OVERLAY_TEST_BUFFER_ROWS", "VLLM_OVERLAY_TEST_GUARD")


def test_traced_settings_come_from_the_traced_patches_specs() -> None:
    traced = [s for s in core.specs() if s.changes_traced_code]
    assert [s.id for s in traced] == ["gdn-output-prealloc", "decode-gemv"]  # decode-gemv: no traced settings
    assert cck.traced_settings() == gdn.SPEC.traced_settings == GDN_TRACED
    assert cck.SPEC.settings == GDN_TRACED  # what `plan --ledger` prints for it
    assert "VLLM_OVERLAY_STRICT" in gdn.SPEC.settings and "VLLM_OVERLAY_STRICT" not in cck.traced_settings()


def test_a_changed_declaration_changes_what_enters_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gdn, "SPEC", dataclasses.replace(gdn.SPEC, traced_settings=GDN_TRACED[:1]))
    assert cck.traced_settings() == GDN_TRACED[:1]


def test_the_key_factor_is_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    """What core binds (PatchContext) decides the factor; the patch never asks core."""
    monkeypatch.setattr(cck, "_context", [cck.UNBOUND])
    assert cck.overlay_factor() == ""  # nothing bound: no live patch
    monkeypatch.setattr(core, "traced_code_digest_parts", lambda: [])
    cck.bind(core.context())
    assert cck.overlay_factor() == ""
    monkeypatch.setattr(core, "traced_code_digest_parts", lambda: ["gdn-output-prealloc"])
    assert cck.overlay_factor() == ""  # the context holds the function it was handed
    cck.bind(core.context())
    monkeypatch.setenv("VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET", "4096")
    env = ["VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET=4096", "VLLM_OVERLAY_GDN_MAX_BATCHED_TOKENS=None",
           "VLLM_OVERLAY_TEST_BUFFER_ROWS=None", "VLLM_OVERLAY_TEST_GUARD=True"]
    want = hashlib.sha256("|".join([__version__, "gdn-output-prealloc", *env]).encode()).hexdigest()
    assert cck.overlay_factor() == want
    monkeypatch.setenv("VLLM_OVERLAY_STRICT", "1")  # read by the GDN patch, not by its traced code
    assert cck.overlay_factor() == want
    monkeypatch.setenv("VLLM_OVERLAY_TEST_GUARD", "0")
    assert cck.overlay_factor() != want


def _w(wrapped, instance, args, kwargs):  # type: ignore[no-untyped-def]
    """A pass-through wrapper for the specs built here (never installed)."""
    return wrapped(*args, **kwargs)


def _spec(**kw: object) -> PatchSpec:
    return PatchSpec(id="p", title="p", why="", upstream="", mechanism="wrap", default=True, retire_when="",
                     targets=(Target("m", "f", wrapper=_w),), support=(Support(">=0.20.0", "applies", "t"),),
                     **kw)  # type: ignore[arg-type]


def test_traced_settings_are_checked() -> None:
    with pytest.raises(ValueError, match=r"traced_settings=\('B',\): expected a tuple of names from its settings \(A\)"):
        _spec(settings=("A",), traced_settings=("B",), changes_traced_code=True)
    with pytest.raises(ValueError, match="expected changes_traced_code=True"):
        _spec(settings=("A",), traced_settings=("A",))
    assert _spec(settings=("A",), traced_settings=("A",), changes_traced_code=True).traced_settings == ("A",)


def test_compile_factors_gets_one_entry_only_while_traced_code_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.34.0 keys its compile cache on VllmConfig.compile_factors(), a dict; the installed 0.32.0 has
    no such method, so a stand-in that records its arguments and answers a dict of 0.34.0's kind plays it."""
    from vllm.config import VllmConfig

    assert not hasattr(VllmConfig, "compile_factors")  # why the stand-in
    stock = {"vllm_version": "0.34.0", "model": "abc123", "compilation": "def456"}
    calls = []
    answer: list[object] = [stock]  # what the stand-in returns

    def compile_factors(*args: object, **kwargs: object) -> object:
        calls.append((args, kwargs))
        return answer[0]

    monkeypatch.setattr(cck, "overlay_factor", lambda: "")
    assert cck._compile_factors(compile_factors, None, (), {"include_version": False}) is stock
    assert calls == [((), {"include_version": False})]

    digest = hashlib.sha256(b"x").hexdigest()
    monkeypatch.setattr(cck, "overlay_factor", lambda: digest)
    got = cck._compile_factors(compile_factors, None, (True,), {})
    assert calls[-1] == ((True,), {})
    assert got == {**stock, cck.FACTOR_KEY: digest} and set(got) - set(stock) == {cck.FACTOR_KEY}
    assert cck.FACTOR_KEY not in stock  # vLLM's dict is not changed in place

    for other in (None, "0123abcd", ["factors"]):  # not a dict: passed through as vLLM gave it
        answer[0] = other
        assert cck._compile_factors(compile_factors, None, (), {}) is other
