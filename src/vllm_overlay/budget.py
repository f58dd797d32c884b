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

import os
import threading
import weakref
from dataclasses import asdict, dataclass
from typing import Any

from vllm_overlay import report, settings
from vllm_overlay.errors import BudgetError
from vllm_overlay.report import LOG

# The settings that give a buffer's token count, highest priority first (after an explicit hint,
# before the live max_num_batched_tokens): the one place this order is written.
BUDGET_SETTINGS: tuple[str, ...] = ("VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET", "VLLM_OVERLAY_GDN_MAX_BATCHED_TOKENS")

FALLBACK_TOKENS = 4096  # used only when no vLLM config exists at all (e.g. a bare unit test)

_seen: set[tuple[Any, ...]] = set()
_seen_lock = threading.Lock()


class Budgets(report.Items):
    """The report's ``budgets``: each distinct resolution this process made (``purpose`` and the
    ``Budget``'s fields). A forked child keeps its parent's, each marked ``inherited_from``."""

    def after_fork(self, parent: int) -> None:
        self.items = [{**b, "inherited_from": parent} for b in self.items]


BUDGETS = report.section("budgets", Budgets)


def _renew_after_fork() -> None:
    """A forked child logs and records its own resolutions (its report carries the parent's as
    inherited), with a lock no parent thread can be holding."""
    global _seen, _seen_lock
    _seen = set()
    _seen_lock = threading.Lock()


os.register_at_fork(after_in_child=_renew_after_fork)


@dataclass(frozen=True)
class Budget:
    value: int  # the rows to allocate
    source: str  # where the value came from (the floor's source when the floor raised it)
    requested: int  # the value before the floor was applied
    floor: int | None  # the largest forward the model runner can run, None without a config
    raised: bool  # True when requested < floor and the floor was used
    requested_source: str = ""  # where ``requested`` came from


def priority_text() -> str:
    """The priority in words, for docs/settings.md and `doctor` (generated, never written twice)."""
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


# The largest forward the model runner can run, as each supported vLLM's runner defines it. Read
# from the runners' sources (0.20.2 and 0.32.0, V1 GPUModelRunner and Model Runner V2 alike):
#     self.max_num_tokens = scheduler_config.max_num_batched_tokens
# sizes input_ids / positions, and the scheduler counts speculative (verify) tokens inside
# max_num_batched_tokens, so speculative decoding adds nothing (measured on the H200 with MTP, 3
# speculative tokens and max_num_seqs 1024: the largest of 4,132 forwards was 7386 of 8192).
RUNNER_LIMIT_RULE = "model runner max_num_tokens (= scheduler_config.max_num_batched_tokens)"

_runner_limits: dict[int, tuple[weakref.ref[Any], int]] = {}  # id(vllm config) -> its runner's limit


def note_runner_limit(vllm_config: Any, max_num_tokens: int) -> None:
    """Record a live runner's own limit (its ``max_num_tokens``) for the config it serves."""
    try:
        ref = weakref.ref(vllm_config)
    except TypeError:
        return
    with _seen_lock:
        _runner_limits[id(vllm_config)] = (ref, int(max_num_tokens))


def largest_forward(vllm_config: Any) -> tuple[int, str]:
    """(tokens, where from): the live runner's max_num_tokens where a runner of this config has
    been built, else the same rule read from the config."""
    with _seen_lock:
        known = _runner_limits.get(id(vllm_config))
    if known is not None and known[0]() is vllm_config:
        return known[1], "the model runner's max_num_tokens"
    return int(vllm_config.scheduler_config.max_num_batched_tokens), RUNNER_LIMIT_RULE


def _check_hint(hint: Any) -> int:
    if isinstance(hint, bool) or not isinstance(hint, int) or not 1 <= hint <= settings.TOKEN_MAX:
        raise BudgetError(f"hint={hint!r}: expected an integer in [1, {settings.TOKEN_MAX}]")
    return hint


def resolve(purpose: str, hint: int | None = None, vllm_config: Any | None = None) -> Budget:
    """Resolve the token budget for the buffer named ``purpose``."""
    cfg = vllm_config if vllm_config is not None else current_vllm_config()
    floor, floor_source = largest_forward(cfg) if cfg is not None else (None, "")
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
    value, raised, requested_source = requested, False, source
    if floor is not None and requested < floor:
        if settings.value("VLLM_OVERLAY_STRICT"):
            raise BudgetError(
                f"token budget {requested} for {purpose} (from {source}) is below the largest "
                f"forward the engine can schedule ({floor}, {floor_source}); VLLM_OVERLAY_STRICT=1 "
                f"refuses to raise it: set it to at least {floor} or unset it"
            )
        value, raised, source = floor, True, f"floor: {floor_source}"
    budget = Budget(value, source, requested, floor, raised, requested_source)
    key = (purpose, value, source, requested, floor)
    with _seen_lock:
        first = key not in _seen
        _seen.add(key)
    if first:
        if raised:
            LOG.warning(
                "token budget for %s: %d from %s is below the largest schedulable forward %d; "
                "raised to %d (source: %s)", purpose, requested, requested_source, floor, value, source,
            )
        else:
            LOG.info("token budget for %s: %d (%s)", purpose, value, source)
        BUDGETS.add({"purpose": purpose, **asdict(budget)})
    return budget
