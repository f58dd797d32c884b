"""The real Backend: vLLM's own fused-MoE kernel (``fused_experts`` under ``override_config``) on a
CUDA GPU, timed inside a CUDA graph as a server runs it. Needs CUDA; imported only when present.

Weights are random (the kernel's speed does not depend on their values); routing is uniform random
top-k over the experts, as a server sees on average. One timed unit is one fused-MoE call (gate-up
GEMM, activation, down GEMM) on ``batch`` tokens.
"""

from __future__ import annotations

import importlib
import inspect
import os
from typing import Any

from vllm_overlay.tools.tune.gpu import torch_cuda_problem
from vllm_overlay.tools.tune.space import Shape, config_file_name

GRAPH_CALLS = 10  # calls captured in one CUDA graph; one replay is timed as GRAPH_CALLS calls


def cuda_problem() -> str | None:
    """None when a CUDA GPU and vLLM's Triton fused-MoE kernel are usable; else why not, in one clause."""
    why = torch_cuda_problem()
    if why is not None:
        return why
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts, override_config  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"vLLM's fused-MoE kernel cannot be imported ({type(exc).__name__}: {exc})"
    return None


def fp8_problem() -> str | None:
    """fp8 weights need compute capability 8.9 or newer (Ada, Hopper, Blackwell)."""
    import torch

    major, minor = torch.cuda.get_device_capability(0)
    if (major, minor) < (8, 9):
        return f"{torch.cuda.get_device_name(0)} is compute capability {major}.{minor}"
    return None


class CudaBench:
    def __init__(self, iters: int = 5, seed: int = 0) -> None:
        import torch

        self.torch = torch
        self.iters, self.seed = iters, seed
        self.weights: dict[Shape, Any] = {}
        self.inputs: dict[tuple[Shape, int], Any] = {}

    def _weights(self, shape: Shape) -> Any:
        if shape not in self.weights:
            self.weights.clear()  # one shape's weights at a time
            self.inputs.clear()
            torch = self.torch
            g = torch.Generator(device="cuda").manual_seed(self.seed)
            e, n, k = shape.experts, shape.intermediate, shape.hidden
            w1 = torch.randn(e, 2 * n, k, device="cuda", dtype=torch.bfloat16, generator=g) / 16
            w2 = torch.randn(e, k, n, device="cuda", dtype=torch.bfloat16, generator=g) / 16
            qc = None
            if shape.dtype == "fp8_w8a8":
                from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

                w1, w2 = w1.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn)
                one = torch.ones(e, device="cuda", dtype=torch.float32)
                qc = fp8_w8a8_moe_quant_config(w1_scale=one, w2_scale=one.clone(),
                                               a1_scale=torch.ones(1, device="cuda", dtype=torch.float32),
                                               a2_scale=torch.ones(1, device="cuda", dtype=torch.float32))
            self.weights[shape] = (w1, w2, qc)
        return self.weights[shape]

    def _inputs(self, shape: Shape, batch: int) -> Any:
        if (shape, batch) not in self.inputs:
            torch = self.torch
            g = torch.Generator(device="cuda").manual_seed(self.seed + batch)
            x = torch.randn(batch, shape.hidden, device="cuda", dtype=torch.bfloat16, generator=g) / 4
            logits = torch.randn(batch, shape.experts, device="cuda", dtype=torch.float32, generator=g)
            weights, ids = torch.topk(torch.softmax(logits, dim=-1), shape.topk, dim=-1)
            weights = weights / weights.sum(dim=-1, keepdim=True)
            self.inputs[(shape, batch)] = (x, weights.to(torch.float32), ids.to(torch.int32))
        return self.inputs[(shape, batch)]

    def __call__(self, shape: Shape, batch: int, config: dict[str, int]) -> float:
        from vllm.model_executor.layers.fused_moe import fused_experts, override_config

        torch = self.torch
        w1, w2, qc = self._weights(shape)
        x, topk_w, topk_ids = self._inputs(shape, batch)

        kwargs: dict[str, Any] = {"quant_config": qc}
        if "inplace" in inspect.signature(fused_experts).parameters:  # 0.22.0 takes it; 0.26.0-0.33.0 do not
            kwargs["inplace"] = False

        def call() -> Any:
            return fused_experts(x, w1, w2, topk_w, topk_ids, **kwargs)

        with override_config(dict(config)):
            call()  # compiles this config's kernels outside the graph
            torch.cuda.synchronize()
            stream = torch.cuda.Stream()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream):
                with torch.cuda.graph(graph, stream=stream):
                    for _ in range(GRAPH_CALLS):
                        call()
            torch.cuda.synchronize()
        graph.replay()  # warm
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(self.iters):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000.0 / GRAPH_CALLS)  # ms -> us per call
        del graph
        times.sort()
        return times[len(times) // 2]


def backend(iters: int = 5, seed: int = 0):  # type: ignore[no-untyped-def]
    """The real Backend on this CUDA GPU (call only when cuda_problem() is None)."""
    import torch
    import triton
    import vllm
    fm = importlib.import_module("vllm.model_executor.layers.fused_moe.fused_moe")  # the module, not a name

    from vllm_overlay.tools.tune.run import Backend

    probe = fm.get_config_file_name(1, 1, None)
    device = probe.split("device_name=", 1)[1].removesuffix(".json")
    props = torch.cuda.get_device_properties(0)
    smem = getattr(props, "shared_memory_per_block_optin", None)

    def vllm_choice(shape: Shape, batch: int) -> dict[str, int]:
        n, k, e = shape.intermediate, shape.hidden, shape.experts
        return dict(fm.try_get_optimal_moe_config((e, 2 * n, k), (e, k, n), shape.topk, shape.vllm_dtype, batch))

    def vllm_file(shape: Shape) -> str | None:
        path = os.path.join(os.path.dirname(os.path.realpath(fm.__file__)), "configs",
                            fm.get_config_file_name(shape.experts, shape.intermediate, shape.vllm_dtype))
        return path if os.path.exists(path) else None

    return Backend(device=device, bench=CudaBench(iters, seed), vllm_choice=vllm_choice,
                   file_name=lambda shape: config_file_name(shape, device), smem_bytes=int(smem) if smem else None,
                   versions={"vllm": vllm.__version__, "triton": triton.__version__, "torch": torch.__version__},
                   vllm_file=vllm_file)
