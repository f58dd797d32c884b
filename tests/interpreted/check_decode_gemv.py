"""decode-gemv's kernel and op under Triton's interpreter (TRITON_INTERPRET=1, set by the caller,
tests/test_decode_gemv.py): outputs against the exact product, the op inside torch.compile
(fullgraph, dynamic batch, Inductor) taking the GEMV for one row and F.linear otherwise.

The interpreter rounds float32 to bf16 by truncation, the GPU (``fp_downcast_rounding="rtne"``) to
nearest: here an output may be one bf16 step from the exact product; bench/decode_gemv_h200.py counts
the steps on the GPU."""

from __future__ import annotations

import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_decode_gemv.py"

from vllm_overlay.kernels.decode_gemv import Config, gemv, heuristic  # noqa: E402
from vllm_overlay.patches import decode_gemv as patch  # noqa: E402
from vllm_overlay.report import STATE  # noqa: E402


def steps_from_exact(y: torch.Tensor, exact: torch.Tensor) -> float:
    _, e = torch.frexp(exact.abs())
    spacing = torch.ldexp(torch.ones_like(exact), (e - 8).float())
    return ((y.float() - exact) / spacing).abs().max().item()


@pytest.mark.parametrize("n,k,bias,cfg", [
    (64, 256, False, None),  # heuristic: EVEN
    (37, 300, True, None),  # masked N and K, bias
    (1, 512, False, None),  # the shared expert's gate shape (N = 1)
    (48, 96, False, Config(16, 64, 4, 1)),  # several rows a program, several K tiles
    (33, 200, True, Config(8, 64, 2, 1)),  # masked, several programs and tiles
])
def test_gemv_is_the_product(n: int, k: int, bias: bool, cfg: Config | None) -> None:
    g = torch.Generator().manual_seed(n * 1000 + k)
    x = torch.randn((1, k), generator=g).to(torch.bfloat16)
    w = (torch.randn((n, k), generator=g) / k ** 0.5).to(torch.bfloat16)
    b = torch.randn((n,), generator=g).to(torch.bfloat16) if bias else None
    y = gemv(x, w, b, cfg or heuristic(n, k, 132))
    assert y.shape == (1, n) and y.dtype == torch.bfloat16
    exact = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double()).float()
    assert steps_from_exact(y, exact) <= 1.0


def test_heuristic_configs_for_the_geometry() -> None:
    """The shapes of the 35B-A3B geometry on an H200 (132 SMs): >= 2 programs a SM where N allows,
    BLOCK_N * BLOCK_K = 4096."""
    got = {(n, k): heuristic(n, k, 132).as_list() for n, k in
           [(12288, 2048), (64, 2048), (2048, 4096), (9216, 2048), (1024, 2048), (2048, 512), (1, 2048)]}
    assert got == {(12288, 2048): [16, 256, 4, 1], (64, 2048): [1, 2048, 4, 1], (2048, 4096): [4, 1024, 4, 1],
                   (9216, 2048): [16, 256, 4, 1], (1024, 2048): [2, 2048, 4, 1], (2048, 512): [4, 512, 4, 1],
                   (1, 2048): [1, 2048, 4, 1]}


class _Linear(torch.nn.Module):
    """Stands in for a vLLM linear layer (vLLM itself is not imported here: its CPU build replaces
    `triton` with a placeholder): apply() calls the method's _gemm_impl as vLLM 0.29-0.33 do."""

    def __init__(self, n: int, k: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn((n, k)).to(torch.bfloat16) / k ** 0.5, requires_grad=False)
        self._gemm_impl = patch.overlay_gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._gemm_impl(self, x, self.weight, None)


def test_op_under_torch_compile_takes_the_gemv_for_one_row_only() -> None:
    patch.ensure_op()
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Linear(96, 64), torch.nn.ReLU(), _Linear(64, 96))
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for rows, gemv_calls in ((1, 2), (3, 0), (1, 2)):
        x = torch.randn((rows, 64)).to(torch.bfloat16)
        before = STATE.counters.get("decode_gemv_calls", 0)
        y = compiled(x)
        assert STATE.counters.get("decode_gemv_calls", 0) - before == gemv_calls
        if rows == 1:
            h = gemv(x, model[0].weight, None, heuristic(96, 64, 132)).relu()
            ref = gemv(h, model[2].weight, None, heuristic(64, 96, 132))
        else:
            ref = torch.nn.functional.linear(torch.nn.functional.linear(x, model[0].weight).relu(), model[2].weight)
        assert torch.equal(y, ref)


def test_op_falls_back_to_linear_where_the_gemv_does_not_fit() -> None:
    patch.ensure_op()
    w = torch.randn((8, 16)).to(torch.bfloat16)
    cases = [torch.randn((2, 16)).to(torch.bfloat16),  # two rows
             torch.randn((1, 16)),  # float32 input
             torch.randn((0, 16)).to(torch.bfloat16)]  # no rows
    for x in cases:
        before = STATE.counters.get("decode_gemv_calls", 0)
        y = torch.ops.vllm_overlay.decode_gemv(x, w.to(x.dtype), None)
        assert STATE.counters.get("decode_gemv_calls", 0) == before
        assert torch.equal(y, torch.nn.functional.linear(x, w.to(x.dtype)))
    wt = torch.randn((16, 8)).to(torch.bfloat16).t()  # K not contiguous
    x = torch.randn((1, 16)).to(torch.bfloat16)
    assert torch.equal(torch.ops.vllm_overlay.decode_gemv(x, wt, None), torch.nn.functional.linear(x, wt))
