"""The decode GEMV's tile configs and config tables, without torch or Triton.

``Config`` is one launch of ``kernels/decode_gemv.py`` (BLOCK_N, BLOCK_K, num_warps, num_stages),
``heuristic`` the config picked from a shape and the SM count alone, and ``read_table`` / ``load_table``
parse a table file ({"devices": {name: {"NxK": config or "cublas"}}}). The kernel, decode-gemv, the check
of VLLM_OVERLAY_DECODE_GEMV_CONFIGS at start-up and `vllm-overlay tune-gemv` all read them from here, so a
table is checked, and a heuristic config planned, the same way on a machine without Triton.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

CUBLAS = "cublas"  # a table entry: this shape keeps torch.nn.functional.linear on this device


@dataclass(frozen=True)
class Config:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1

    def as_list(self) -> list[int]:
        return [self.block_n, self.block_k, self.num_warps, self.num_stages]

    @classmethod
    def from_list(cls, raw: list[int], where: str) -> Config:
        if (not isinstance(raw, list) or len(raw) != 4 or not all(isinstance(v, int) and v > 0 for v in raw)
                or any(v & (v - 1) for v in raw[:3])):
            raise ValueError(f"{where}: {raw!r}: expected [BLOCK_N, BLOCK_K, num_warps, num_stages], "
                             "the first three powers of two, all positive integers")
        return cls(*raw)


def _pow2_floor(v: int) -> int:
    return 1 << (max(1, v).bit_length() - 1)


def pow2_at_least(v: int) -> int:
    """The smallest power of two >= v (1 for v <= 1)."""
    return 1 << max(0, (v - 1).bit_length())


def heuristic(n: int, k: int, sms: int) -> Config:
    """A config from the shape and the SM count alone: at least two programs per SM where N allows,
    8 K elements of W per program per K tile (BLOCK_N * BLOCK_K = 4096, 8 KiB of bf16)."""
    block_n = 16
    while block_n > 1 and -(-n // block_n) < 2 * sms:
        block_n //= 2
    block_k = min(_pow2_floor(4096 // block_n), pow2_at_least(k), 2048)
    return Config(block_n, max(block_k, 16), 4, 1)


def read_table(path: str, where: str) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """({device name: {"NxK": Config or CUBLAS}}, {device name: where its table was measured}) from a JSON
    file {"devices": {name: {"NxK": [bn, bk, warps, stages] or "cublas"}}, "measured": {name: {"vllm":
    "X.Y.Z", ...}}} ("cublas": cuBLAS was faster for that shape on that device, F.linear keeps it;
    "measured" is optional: `vllm-overlay tune-gemv` writes it). Raises ValueError naming ``where``, the
    entry and what is accepted."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}={path}: cannot read a JSON config table ({exc})") from None
    devices = raw.get("devices") if isinstance(raw, dict) else None
    if not isinstance(devices, dict):
        raise ValueError(f"{where}={path}: expected {{\"devices\": {{DEVICE NAME: {{\"NxK\": [BLOCK_N, BLOCK_K, "
                         "num_warps, num_stages]}}}}}}")
    out: dict[str, dict[str, Any]] = {}
    for name, shapes in devices.items():
        if not isinstance(shapes, dict):
            raise ValueError(f"{where}={path}: device {name!r}: expected an object of \"NxK\" -> config")
        table = {}
        for key, cfg in shapes.items():
            n, _, k = str(key).partition("x")
            if not (n.isdigit() and k.isdigit()):
                raise ValueError(f"{where}={path}: device {name!r}: key {key!r}: expected \"NxK\" (e.g. \"2048x4096\")")
            table[f"{int(n)}x{int(k)}"] = CUBLAS if cfg == CUBLAS else Config.from_list(
                cfg, f"{where}={path}: device {name!r}: {key}")
        out[name] = table
    measured = raw.get("measured", {})
    if not isinstance(measured, dict) or not all(
            isinstance(m, dict) and isinstance(m.get("vllm"), str) and m["vllm"] for m in measured.values()):
        raise ValueError(f"{where}={path}: \"measured\": expected {{DEVICE NAME: {{\"vllm\": \"X.Y.Z\", ...}}}} (where "
                         "each device's table was measured), or no such key")
    return out, {str(k): dict(v) for k, v in measured.items()}


def load_table(path: str, where: str) -> dict[str, dict[str, Any]]:
    """{device name: {"NxK": Config or CUBLAS}} (see read_table)."""
    return read_table(path, where)[0]
