"""The GPU side of `vllm-overlay tune-gemv`: one-row calls captured in a CUDA graph and timed with CUDA
events, as bench/decode_gemv_h200.py times them.

Per shape the weight is copied until the copies hold at least ``min_mib`` (512 MiB, several times an
H100's or H200's L2; at most 4,096 copies, so the smallest weights stay in L2: they are latency-bound
either way) and one graph holds ``calls`` calls cycling over the copies, so each call reads its weight
from memory as a decode step does. The time per call is a replay's time over its calls, the median of
``reps`` replays. cuBLAS is torch.nn.functional.linear captured the same way (with any split-K
reduction kernel it launches): what vLLM's CUDA GEMM for unquantized layers runs
(``default_unquantized_gemm``; from vLLM 0.34.0 ``cuda_unquantized_gemm`` outside its skinny-GEMM plans,
which the patch leaves to vLLM anyway).
"""

from __future__ import annotations

import statistics
from typing import Any

from vllm_overlay.tools.tune.gemv_shapes import GemvShape
from vllm_overlay.tools.tune.gpu import torch_cuda_problem


def cuda_problem() -> str | None:
    """None when a CUDA GPU, Triton and the overlay's kernel are usable; else why not, in one clause."""
    why = torch_cuda_problem()
    if why is not None:
        return why
    try:
        from vllm_overlay.kernels import decode_gemv  # noqa: F401 - imports Triton
    except Exception as exc:  # noqa: BLE001
        return f"the GEMV kernel cannot be imported ({type(exc).__name__}: {exc})"
    return None


def graph_call_times_us(calls: list[Any], reps: int) -> list[float]:
    """``calls`` captured in one CUDA graph (two of them run first on a side stream, as capture wants),
    the graph replayed ``reps`` times: each replay's time over its calls, in microseconds."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls[:2]:
            c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / len(calls))
    del graph
    return times


class CudaTimer:
    def __init__(self, reps: int = 7, calls: int = 200, min_mib: int = 512, seed: int = 0) -> None:
        import torch
        import triton

        self.torch = torch
        self.reps, self.calls, self.min_mib, self.seed = reps, calls, min_mib, seed
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        self.device, self.sms = props.name, props.multi_processor_count
        self.versions = {"torch": torch.__version__, "triton": triton.__version__}
        from vllm_overlay.versions import installed_vllm

        inst = installed_vllm()  # the release as the overlay's start-up reads it (the cache file's key)
        if inst:  # else said by the command: a table is kept per vLLM release
            self.versions["vllm"] = inst.version
        self._held: tuple[GemvShape, list[Any], Any] | None = None

    def _weights(self, shape: GemvShape) -> tuple[list[Any], Any]:
        if self._held is None or self._held[0] != shape:
            self._held = None
            torch = self.torch
            torch.cuda.empty_cache()
            g = torch.Generator(device="cuda").manual_seed(self.seed)
            copies = max(1, min(4096, -(-self.min_mib * 2**20 // (shape.n * shape.k * 2))))
            ws = [(torch.randn((shape.n, shape.k), device="cuda", generator=g) / shape.k ** 0.5).to(torch.bfloat16)
                  for _ in range(copies)]
            x = torch.randn((1, shape.k), device="cuda", generator=g).to(torch.bfloat16)
            self._held = (shape, ws, x)
        return self._held[1], self._held[2]

    def _per_call_us(self, calls: list[Any]) -> float:
        return statistics.median(graph_call_times_us(calls, self.reps))

    def _order(self, ws: list[Any]) -> list[Any]:
        return [ws[i % len(ws)] for i in range(max(len(ws), self.calls))]

    def cublas_us(self, shape: GemvShape) -> float:
        ws, x = self._weights(shape)
        linear = self.torch.nn.functional.linear
        return self._per_call_us([lambda w=w: linear(x, w) for w in self._order(ws)])

    def gemv_us(self, shape: GemvShape, cfg: tuple[int, int, int, int]) -> float:
        from vllm_overlay.kernels.decode_gemv import Config, gemv

        ws, x = self._weights(shape)
        c = Config(*cfg)
        try:
            gemv(x, ws[0], None, c)  # compiles outside the capture
            return self._per_call_us([lambda w=w: gemv(x, w, None, c) for w in self._order(ws)])
        except Exception:
            self.torch.cuda.synchronize()
            raise
