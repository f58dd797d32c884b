"""Resumable tuning state of one shape on one device, and the vLLM config file written from it.

The state file (``<out>/tune-state/<config name>.state.json``) gains one entry per finished batch
size, written atomically after each, so an interrupted or time-limited run resumes where it
stopped. The config file (``<out>/<vLLM's file name>``) is rewritten from the state after each
batch size too: measured batch sizes get their best config, the others vLLM's own default for that
size (so the file never makes a batch size slower than vLLM would run it), and the state says which
is which.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

SCHEMA = 1


def atomic_write_json(path: str, data: Any) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".tune-", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=4, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


@dataclass
class TuneState:
    path: str
    meta: dict[str, Any]
    batches: dict[int, dict[str, Any]] = field(default_factory=dict)  # batch -> {config, us, default_us, ...}

    @classmethod
    def load_or_new(cls, path: str, meta: dict[str, Any], fresh: bool) -> tuple[TuneState, str]:
        """(state, a sentence on what was resumed)."""
        if fresh or not os.path.exists(path):
            return cls(path, meta), "starting fresh" if not fresh else "starting fresh (--fresh)"
        try:
            with open(path) as f:
                raw = json.load(f)
            old_meta = raw["meta"]
            batches = {int(b): rec for b, rec in raw["batches"].items()}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return cls(path, meta), f"starting fresh: the state file {path} is unreadable ({exc})"
        differ = [k for k in ("device", "shape", "search", "vllm", "triton") if old_meta.get(k) != meta.get(k)]
        if differ:
            what = ", ".join(f"{k} {old_meta.get(k)!r} -> {meta.get(k)!r}" for k in differ)
            return cls(path, meta), f"starting fresh: the state in {path} was measured with other settings ({what})"
        return cls(path, meta, batches), f"resuming: {len(batches)} batch size(s) already done ({path})"

    def done(self, batch: int) -> bool:
        return batch in self.batches

    def record(self, batch: int, rec: dict[str, Any]) -> None:
        self.batches[batch] = rec
        atomic_write_json(self.path, {"schema": SCHEMA, "meta": self.meta,
                                      "batches": {str(b): self.batches[b] for b in sorted(self.batches)}})

    def vllm_config(self, batch_sizes: list[int], default_for: Any, triton_version: str | None) -> dict[str, Any]:
        """vLLM's format: {"<batch>": {BLOCK_SIZE_M: ...}, ..., "triton_version": ...}."""
        out: dict[str, Any] = {}
        if triton_version:
            out["triton_version"] = triton_version
        for b in sorted(set(batch_sizes) | set(self.batches)):
            out[str(b)] = dict(self.batches[b]["config"]) if b in self.batches else dict(default_for(b))
        return out
