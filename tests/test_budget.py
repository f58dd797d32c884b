"""The token-budget resolver, rung by rung.

The live-config rung is exercised with a stand-in object carrying only the two config fields
the resolver reads (scheduler_config, speculative_config): building a full VllmConfig needs a
model. The engine tests (test_engine.py) cover the same rung inside a real vLLM boot.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_overlay import budget
from vllm_overlay.errors import BudgetError


class Cfg(SimpleNamespace):
    """A stand-in VllmConfig (weak-referenceable, as the real one is)."""


def cfg(mnbt: int, seqs: int = 16, spec: int = 0) -> SimpleNamespace:
    return Cfg(
        scheduler_config=SimpleNamespace(max_num_batched_tokens=mnbt, max_num_seqs=seqs),
        speculative_config=SimpleNamespace(num_speculative_tokens=spec) if spec else None,
    )


def test_live_config(monkeypatch: pytest.MonkeyPatch) -> None:
    b = budget.resolve("t", vllm_config=cfg(8192))
    assert (b.value, b.source, b.raised) == (8192, "live scheduler_config.max_num_batched_tokens", False)


def test_fallback_only_without_any_config() -> None:
    b = budget.resolve("t")  # no vLLM config is current in this process
    assert b.value == 4096 and b.source.startswith("fallback 4096") and b.floor is None


def test_gdn_env_beats_live_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_OVERLAY_GDN_MAX_BATCHED_TOKENS", "12000")
    b = budget.resolve("t", vllm_config=cfg(8192))
    assert (b.value, b.source) == (12000, "env VLLM_OVERLAY_GDN_MAX_BATCHED_TOKENS")


def test_prealloc_env_beats_gdn_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_OVERLAY_GDN_MAX_BATCHED_TOKENS", "12000")
    monkeypatch.setenv("VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET", "16000")
    b = budget.resolve("t", vllm_config=cfg(8192))
    assert (b.value, b.source) == (16000, "env VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET")


def test_hint_beats_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET", "16000")
    b = budget.resolve("t", hint=20000, vllm_config=cfg(8192))
    assert (b.value, b.source) == (20000, "explicit hint")


def test_alias_rung(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GENESIS_PREALLOC_TOKEN_BUDGET", "9000")
    b = budget.resolve("t", vllm_config=cfg(8192))
    assert (b.value, b.source) == (9000, "alias GENESIS_PREALLOC_TOKEN_BUDGET")


def test_below_floor_is_raised_with_warning(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET", "4096")
    b = budget.resolve("floor-test", vllm_config=cfg(8192))
    assert (b.value, b.requested, b.floor, b.raised) == (8192, 4096, 8192, True)


def test_below_floor_names_the_floor_as_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET", "4096")
    b = budget.resolve("t", vllm_config=cfg(8192))
    assert b.source == "floor: " + budget.RUNNER_LIMIT_RULE
    assert b.requested_source == "env VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET"


def test_speculative_tokens_do_not_raise_the_floor() -> None:
    # the scheduler counts verify tokens inside max_num_batched_tokens; the runner's input
    # buffers hold exactly that many (the engine test reads the runner's own limit)
    b = budget.resolve("t", vllm_config=cfg(8192, seqs=16, spec=3))
    assert (b.floor, b.value, b.raised) == (8192, 8192, False)
    assert b.source == "live scheduler_config.max_num_batched_tokens"


def test_a_live_runner_limit_is_the_floor() -> None:
    c = cfg(8192)
    budget.note_runner_limit(c, 8200)  # a runner that could run more than the scheduler's budget
    b = budget.resolve("t", vllm_config=c)
    assert (b.floor, b.value, b.raised) == (8200, 8200, True)
    assert b.source == "floor: the model runner's max_num_tokens"


def test_strict_refuses_to_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET", "4096")
    monkeypatch.setenv("VLLM_OVERLAY_STRICT", "1")
    with pytest.raises(BudgetError) as err:
        budget.resolve("t", vllm_config=cfg(8192))
    assert "4096" in str(err.value) and "8192" in str(err.value)


@pytest.mark.parametrize("hint", [0, -5, 1048577, 2.5, "8192", True])
def test_bad_hint(hint: object) -> None:
    with pytest.raises(BudgetError) as err:
        budget.resolve("t", hint=hint, vllm_config=cfg(8192))  # type: ignore[arg-type]
    assert "hint=" in str(err.value) and "[1, 1048576]" in str(err.value)


def test_no_caching_between_configs() -> None:
    assert budget.resolve("t", vllm_config=cfg(2048)).value == 2048
    assert budget.resolve("t", vllm_config=cfg(8192)).value == 8192
