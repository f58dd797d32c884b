"""The token-budget resolver: the only source of a token count for a preallocated buffer.

Priority (``priority_text()``): explicit hint > each of ``BUDGET_SETTINGS`` in order > the live
``scheduler_config.max_num_batched_tokens`` > 4096 (only when no vLLM config exists).

It resolves when a buffer is allocated, from the vLLM config that is current then (vLLM sets it
while it builds the model), and never caches: a resolution made before the config exists can
never leak into a later allocation. A budget below the largest forward the engine can schedule
is raised to that size with a WARNING naming both numbers, or refused under
VLLM_OVERLAY_STRICT=1. Each distinct resolution is logged once.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Any

from vllm_overlay import settings
from vllm_overlay.errors import BudgetError
from vllm_overlay.report import LOG, STATE

# The settings that give a buffer's token count, highest priority first (after an explicit hint,
# before the live max_num_batched_tokens): the one place this order is written.
BUDGET_SETTINGS: tuple[str, ...] = ("VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET", "VLLM_OVERLAY_GDN_MAX_BATCHED_TOKENS")

FALLBACK_TOKENS = 4096  # used only when no vLLM config exists at all (e.g. a bare unit test)

_seen: set[tuple[Any, ...]] = set()
_seen_lock = threading.Lock()


@dataclass(frozen=True)
class Budget:
    value: int  # the rows to allocate
    source: str  # where the value came from
    requested: int  # the value before the floor was applied
    floor: int | None  # the largest forward the engine can schedule, None without a config
    raised: bool  # True when requested < floor and the floor was used


def priority_text() -> str:
    """The priority in words, for the README and `doctor` (generated, never written twice)."""
    return " > ".join(["explicit hint", *(f"`{n}`" for n in BUDGET_SETTINGS),
                       "the live `scheduler_config.max_num_batched_tokens`",
                       f"{FALLBACK_TOKENS} (only when no vLLM config exists)"])


def current_vllm_config() -> Any | None:
    """The vLLM config that is current now, or None (never vLLM's default-constructed one)."""
    try:
        import vllm.config.vllm as cfgmod
    except Exception:  # noqa: BLE001 - vLLM absent
        return None
    return getattr(cfgmod, "_current_vllm_config", None)


def largest_forward(vllm_config: Any) -> int:
    """max_num_batched_tokens, plus every sequence's speculative tokens where enabled."""
    sched = vllm_config.scheduler_config
    n = int(sched.max_num_batched_tokens)
    spec = getattr(vllm_config, "speculative_config", None)
    k = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0
    if k:
        n += k * int(sched.max_num_seqs)
    return n


def _check_hint(hint: Any) -> int:
    if isinstance(hint, bool) or not isinstance(hint, int) or not 1 <= hint <= settings.TOKEN_MAX:
        raise BudgetError(f"hint={hint!r}: expected an integer in [1, {settings.TOKEN_MAX}]")
    return hint


def resolve(purpose: str, hint: int | None = None, vllm_config: Any | None = None) -> Budget:
    """Resolve the token budget for the buffer named ``purpose``."""
    cfg = vllm_config if vllm_config is not None else current_vllm_config()
    floor = largest_forward(cfg) if cfg is not None else None
    if hint is not None:
        requested, source = _check_hint(hint), "explicit hint"
    else:
        requested, source = 0, ""
        for name in BUDGET_SETTINGS:
            r = settings.resolve(name)
            if r.is_set:
                requested, source = int(r.value), r.source
                break
        if not source:
            if cfg is not None:
                requested = int(cfg.scheduler_config.max_num_batched_tokens)
                source = "live scheduler_config.max_num_batched_tokens"
            else:
                requested, source = FALLBACK_TOKENS, f"fallback {FALLBACK_TOKENS} (no vLLM config is current)"
    value, raised = requested, False
    if floor is not None and requested < floor:
        if settings.value("VLLM_OVERLAY_STRICT"):
            raise BudgetError(
                f"token budget {requested} for {purpose} (from {source}) is below the largest "
                f"forward the engine can schedule ({floor}); VLLM_OVERLAY_STRICT=1 refuses to raise "
                f"it: set it to at least {floor} or unset it"
            )
        value, raised = floor, True
    budget = Budget(value, source, requested, floor, raised)
    key = (purpose, value, source, requested, floor)
    with _seen_lock:
        first = key not in _seen
        _seen.add(key)
    if first:
        if raised:
            LOG.warning(
                "token budget for %s: %d from %s is below the largest schedulable forward %d; "
                "raised to %d", purpose, requested, source, floor, value,
            )
        else:
            LOG.info("token budget for %s: %d (%s)", purpose, value, source)
        with STATE.lock:
            STATE.budgets.append({"purpose": purpose, **asdict(budget)})
            STATE.dirty = True
    return budget
