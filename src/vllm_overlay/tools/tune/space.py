"""The search space of fused-MoE Triton configs, and the shapes and batch sizes to tune.

One config drives both GEMMs of vLLM's fused-MoE kernel (gate-up: N=2*I, K=hidden; down: N=hidden,
K=I), so a tile must fit both. Candidates are pruned per batch size: an M tile far taller than the
tokens one expert sees only multiplies padding, grouping M blocks needs more than one M block per
expert, and a config whose pipelined tiles do not fit the GPU's shared memory cannot launch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

# Batch sizes a server runs (tokens in one forward): every CUDA-graph decode size up to 64 streams,
# the larger decode batches of a busy server, and the prefill chunks that max_num_batched_tokens
# 2048-8192 produce. vLLM looks up the nearest tuned size, so the grid is dense where the best tile
# changes fastest (small M: tokens per expert go from under 1 to a few) and sparse above 1024.
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096, 8192)

# The hybrid MoE shapes served: Qwen3-Next / Qwen3.6-35B-A3B (256 experts, top-8, hidden 2048,
# moe_intermediate_size 512): N=512 at one GPU, N=256 at tensor parallel 2.
DEFAULT_EXPERTS, DEFAULT_HIDDEN, DEFAULT_TOPK = 256, 2048, 8
DEFAULT_INTERMEDIATE = (512, 256)

DTYPES = {"bf16": None, "fp8_w8a8": "fp8_w8a8"}  # --dtype -> vLLM's dtype string in the file name
ELEMENT_BYTES = {"bf16": 2, "fp8_w8a8": 1}

SEARCH = {
    "quick": {"BLOCK_SIZE_M": (16, 32, 64, 128), "BLOCK_SIZE_N": (32, 64, 128, 256), "BLOCK_SIZE_K": (64, 128, 256),
              "GROUP_SIZE_M": (1, 16), "num_warps": (4, 8), "num_stages": (3, 4)},
    "full": {"BLOCK_SIZE_M": (16, 32, 64, 128, 256), "BLOCK_SIZE_N": (32, 64, 128, 256),
             "BLOCK_SIZE_K": (64, 128, 256), "GROUP_SIZE_M": (1, 16, 32, 64), "num_warps": (4, 8),
             "num_stages": (2, 3, 4, 5)},
}


@dataclass(frozen=True)
class Shape:
    experts: int
    intermediate: int  # N in vLLM's file name: moe_intermediate_size / tensor parallel size
    hidden: int
    topk: int
    dtype: str  # a key of DTYPES

    @property
    def vllm_dtype(self) -> str | None:
        return DTYPES[self.dtype]

    def label(self) -> str:
        return f"E={self.experts},N={self.intermediate},dtype={self.dtype}"


def config_file_name(shape: Shape, device: str) -> str:
    """vLLM's file name for a shape on a device (the format of get_config_file_name, no block shape)."""
    dtype = f",dtype={shape.vllm_dtype}" if shape.vllm_dtype else ""
    return f"E={shape.experts},N={shape.intermediate},device_name={device}{dtype}.json"


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def fits(config: dict[str, int], shape: Shape, smem_bytes: int | None) -> bool:
    bm, bn, bk = config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"], config["BLOCK_SIZE_K"]
    if bk > min(shape.hidden, shape.intermediate) or bn > max(2 * shape.intermediate, shape.hidden):
        return False
    if smem_bytes is None:
        return True
    need = (bm * bk + bk * bn) * ELEMENT_BYTES[shape.dtype] * config["num_stages"]
    return need <= smem_bytes


def candidates(shape: Shape, batch: int, search: str, smem_bytes: int | None) -> list[dict[str, int]]:
    """Configs worth timing at this batch size (pruned as the module docstring says)."""
    space = SEARCH[search]
    tokens_per_expert = max(1, batch * shape.topk // shape.experts)
    max_bm = max(16, _next_pow2(tokens_per_expert) * 4)  # vLLM's tuned files pick about 2 x tokens per expert
    out = []
    keys = tuple(space)
    for values in itertools.product(*(space[k] for k in keys)):
        cfg = dict(zip(keys, values))
        if cfg["BLOCK_SIZE_M"] > max_bm:
            continue
        if cfg["GROUP_SIZE_M"] > 1 and tokens_per_expert <= cfg["BLOCK_SIZE_M"]:
            continue
        if not fits(cfg, shape, smem_bytes):
            continue
        out.append(cfg)
    return out


def key(config: dict[str, int]) -> tuple[int, ...]:
    return tuple(int(config.get(k, 0)) for k in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M",
                                                 "num_warps", "num_stages"))
