"""The routed-experts decode kernel under Triton's interpreter (TRITON_INTERPRET=1, set by the caller,
tests/test_moe_decode.py): outputs of 1 to 4 tokens against the same computation in torch, rounded
where vLLM's fused_experts rounds (gate and up sums, SiLU-and-mul, each slot's weighted down sum, the
sum over slots), for even and masked shapes and several configs.

The interpreter rounds float32 to bf16 by truncation where the GPU rounds to nearest, so the reference
here truncates at the same five points (rounded to nearest, the compounded truncations of gate, up and
the activation put outputs about 2 % below it); bench/moe_decode_kernel.py compares the GPU's outputs
against vLLM's own kernels."""

from __future__ import annotations

import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_moe_decode.py"

from vllm_overlay.kernels.moe_decode import MAX_TOKENS, Config, heuristic, routed_experts  # noqa: E402


def steps(y: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    _, e = torch.frexp(ref.abs().clamp_min(1e-30))
    spacing = torch.ldexp(torch.ones_like(ref), (e - 8).to(torch.int32))
    return ((y.double() - ref) / spacing).abs().max().item()


def bf16(v: torch.Tensor) -> torch.Tensor:
    """float32 -> bf16 as the interpreter rounds: truncation (the low 16 bits dropped)."""
    return (v.float().contiguous().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


def as_vllm_rounds(x, w13, w2, wts, ids) -> torch.Tensor:  # type: ignore[no-untyped-def]
    inter = w13.shape[1] // 2
    out = torch.zeros((x.shape[0], w2.shape[1]), dtype=torch.float32)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            h = bf16(w13[e].float() @ x[t].float()).float()
            act = bf16(h[:inter] / (1.0 + torch.exp(-h[:inter])) * h[inter:]).float()
            out[t] += bf16((w2[e].float() @ act) * float(wts[t, s])).float()
    return bf16(out)


@pytest.mark.parametrize("m,e,top_k,h,inter,up,down", [
    (1, 8, 4, 64, 32, None, None),  # heuristic configs
    (2, 8, 4, 64, 32, Config(8, 32, 4, 1), Config(16, 16, 4, 1)),  # several K tiles in both launches
    (3, 6, 3, 48, 24, Config(16, 32, 2, 1), Config(8, 16, 2, 1)),  # masked rows and K in both launches
    (4, 8, 2, 64, 32, Config(1, 64, 4, 1), Config(2, 32, 4, 1)),  # one row a program
])
def test_routed_experts_match_the_torch_computation(m, e, top_k, h, inter, up, down) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(m * 100 + e)
    x = torch.randn((m, h), generator=g).to(torch.bfloat16)
    w13 = (torch.randn((e, 2 * inter, h), generator=g) / h ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn((e, h, inter), generator=g) / inter ** 0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(m)]).to(torch.int32)
    wts = torch.softmax(torch.randn((m, top_k), generator=g), -1)
    up = up or heuristic(inter, h, m * top_k, 132)
    down = down or heuristic(h, inter, m, 132)
    y = routed_experts(x, w13, w2, wts, ids, up, down)
    assert y.shape == (m, h) and y.dtype == torch.bfloat16
    assert steps(y, as_vllm_rounds(x, w13, w2, wts, ids)) <= 2.0


def test_int64_ids_and_a_given_output() -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn((2, 64), generator=g).to(torch.bfloat16)
    w13 = (torch.randn((4, 64, 64), generator=g) / 8).to(torch.bfloat16)
    w2 = (torch.randn((4, 64, 32), generator=g) / 6).to(torch.bfloat16)
    ids = torch.tensor([[3, 0], [1, 3]])
    wts = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    out = torch.empty((2, 64), dtype=torch.bfloat16)
    y = routed_experts(x, w13, w2, wts, ids, Config(8, 64, 4, 1), Config(8, 32, 4, 1), out=out)
    assert y.data_ptr() == out.data_ptr()
    assert steps(y, as_vllm_rounds(x, w13, w2, wts, ids)) <= 2.0


def test_refuses_what_it_does_not_compute() -> None:
    x = torch.zeros((MAX_TOKENS + 1, 64), dtype=torch.bfloat16)
    w13 = torch.zeros((4, 64, 64), dtype=torch.bfloat16)
    w2 = torch.zeros((4, 64, 32), dtype=torch.bfloat16)
    ids = torch.zeros((MAX_TOKENS + 1, 2), dtype=torch.int32)
    with pytest.raises(ValueError, match="takes 1 to 4"):
        routed_experts(x, w13, w2, ids.float(), ids, Config(8, 64), Config(8, 32))
    with pytest.raises(ValueError, match="do not fit"):
        routed_experts(x[:1], w13, w2[:, :, :16], ids[:1].float(), ids[:1], Config(8, 64), Config(8, 32))


def test_heuristic_for_the_geometry() -> None:
    """35B-A3B (E 256, top 8, H 2048, I 512) on 132 SMs: at least two programs a SM where n allows."""
    assert heuristic(512, 2048, 8, 132).as_list() == [1, 1024, 4, 1]  # up, one token: 4,096 programs
    assert heuristic(2048, 512, 1, 132).as_list() == [2, 512, 4, 1]  # down, one token: 1,024 programs
    assert heuristic(2048, 512, 4, 132).as_list() == [2, 512, 4, 1]  # down, four tokens: 4,096 programs


# ---- the patch's wrapper on stand-ins for vLLM's method and layer ------------------------------------
# vLLM is not imported here (its CPU build replaces Triton with a placeholder once imported), and its
# Triton MoE backend exists on CUDA only: the method and layer below stand in for what the wrapper reads
# of UnquantizedFusedMoEMethod and RoutedExperts, and on_cuda is made to answer True for CPU tensors.

from types import SimpleNamespace  # noqa: E402

from vllm_overlay.patches import moe_decode as patch  # noqa: E402
from vllm_overlay.report import STATE  # noqa: E402


def _method() -> SimpleNamespace:
    finalize = SimpleNamespace(supports_async=lambda: False)
    return SimpleNamespace(unquantized_backend=SimpleNamespace(name="TRITON"), moe=SimpleNamespace(has_bias=False),
                           moe_kernel=SimpleNamespace(fused_experts=SimpleNamespace(),
                                                      impl=SimpleNamespace(prepare_finalize=finalize)))


def _layer(g: torch.Generator, activation: str = "silu") -> SimpleNamespace:
    return SimpleNamespace(w13_weight=(torch.randn((8, 64, 64), generator=g) / 8).to(torch.bfloat16),
                           w2_weight=(torch.randn((8, 64, 32), generator=g) / 6).to(torch.bfloat16),
                           activation=SimpleNamespace(value=activation), expert_map=None,
                           apply_router_weight_on_input=False)


def test_the_wrapper_serves_small_forwards_and_passes_the_rest(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(patch, "on_cuda", lambda x: True)
    g = torch.Generator().manual_seed(3)
    method, layer = _method(), _layer(g)
    vllm_calls: list[int] = []

    def vllm_apply(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):  # type: ignore[no-untyped-def]
        vllm_calls.append(x.shape[0])
        return "vllm"

    for m in (2, 5):
        x = torch.randn((m, 64), generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(m)]).to(torch.int32)
        wts = torch.softmax(torch.randn((m, 3), generator=g), -1)
        out = patch._apply(vllm_apply, method, (layer,), {"x": x, "topk_weights": wts, "topk_ids": ids,
                                                          "shared_experts": None, "shared_experts_input": None})
        if m == 2:
            assert steps(out, as_vllm_rounds(x, layer.w13_weight, layer.w2_weight, wts, ids)) <= 2.0
        else:
            assert out == "vllm"
    assert vllm_calls == [5] and getattr(method, patch.DECIDED) is None
    assert STATE.counters["moe_decode_calls"] == 1 and STATE.counters["moe_decode_layers"] == 1


def test_a_layer_that_does_not_qualify_keeps_vllms_kernel_loudly(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(patch, "on_cuda", lambda x: True)
    g = torch.Generator().manual_seed(4)
    method, layer = _method(), _layer(g, activation="gelu")
    x = torch.randn((1, 64), generator=g).to(torch.bfloat16)
    ids, wts = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([[0.5, 0.5]])
    for _ in range(2):
        assert patch._apply(lambda *a, **k: "vllm", method, (layer, x, wts, ids, None, None), {}) == "vllm"
    assert getattr(method, patch.DECIDED) == "activation " + str(layer.activation) + " (SiLU only)"
    assert STATE.counters["moe_decode_stood_aside"] == 1
    assert sum("moe-decode: stands aside: activation" in e for e in STATE.events) == 1
    other = _method()
    other.unquantized_backend = SimpleNamespace(name="FLASHINFER_CUTLASS")
    assert patch.refusal(other, _layer(g), x).startswith("vLLM chose its FLASHINFER_CUTLASS backend")
    other = _method()
    other.moe_kernel.impl.prepare_finalize = SimpleNamespace(supports_async=lambda: True)
    assert "asynchronous" in patch.refusal(other, _layer(g), x)
    monkeypatch.setattr(patch, "on_cuda", lambda x: False)
    assert patch.refusal(_method(), _layer(g), x) == "the input is not on a CUDA device"
