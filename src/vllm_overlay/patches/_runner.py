"""Shared helpers for patches on vLLM's V1 model runner (GPUModelRunner; CPUModelRunner
inherits from it)."""

from __future__ import annotations

from typing import Any

RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
RUNNER = "GPUModelRunner"


def forward_tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """Token rows of a ``_model_forward(input_ids, positions, ..., inputs_embeds)`` call."""
    names = ("input_ids", "positions", "intermediate_tensors", "inputs_embeds")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    for key in ("input_ids", "inputs_embeds"):
        t = bound.get(key)
        if t is not None:
            return int(t.shape[0])
    pos = bound.get("positions")
    if pos is not None:
        return int(pos.shape[-1])
    return None


def dummy_tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    return int(kwargs["num_tokens"] if "num_tokens" in kwargs else args[0])


def _rank_in(group_getter: str) -> int | None:
    try:
        from vllm.distributed import parallel_state

        return int(getattr(parallel_state, group_getter)().rank_in_group)
    except Exception:  # noqa: BLE001 - not initialised (e.g. a bare runner in a test)
        return None


def worker_rank() -> int | None:
    return _rank_in("get_world_group")


def tp_rank() -> int | None:
    """This worker's tensor-parallel rank (TP ranks run the same forwards: telemetry counts rank 0)."""
    return _rank_in("get_tp_group")
