"""prefill-chunk-clamp on the installed CPU build (vLLM 0.32.0), through vLLM's real Scheduler with
the patch applied: since 0.31.0 vLLM applies long_prefill_token_threshold only when more than one
request is running or waiting, so one long prompt alone is not clamped and two are. No engine is
booted: the scheduler is built from a VllmConfig of the tiny hybrid model and a KV cache config of
one full-attention group (the scheduler never touches the device)."""

from __future__ import annotations

import importlib
import os

import pytest
from packaging.version import Version

from vllm_overlay import core, versions
from vllm_overlay.tools.models import __file__ as models_file
from vllm_overlay.patches import prefill_chunk_clamp as clamp
from vllm_overlay.report import STATE

MNBT, CLAMP, PROMPT = 2048, 256, 1000


@pytest.fixture
def clamped(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("VLLM_OVERLAY_REPORT_DIR", str(tmp_path / "reports"))
    monkeypatch.setenv("VLLM_OVERLAY_PREFILL_CHUNK_CLAMP", str(CLAMP))
    importlib.import_module(clamp.MODULE)
    core.revert()
    STATE.reset()
    core.register()
    yield
    core.revert()
    STATE.reset()


def _schedule(n_requests: int) -> dict[str, int]:
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    model = os.path.join(os.path.dirname(models_file), "tiny-hybrid")
    mc = ModelConfig(model=model, skip_tokenizer_init=True, max_model_len=4096)
    sc = SchedulerConfig(max_num_batched_tokens=MNBT, max_num_seqs=8, max_model_len=4096,
                         enable_chunked_prefill=True, is_encoder_decoder=False)
    cc = CacheConfig(block_size=16, enable_prefix_caching=False)
    cc.num_gpu_blocks = 1000
    vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=1000, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    sched = Scheduler(vc, kv, StructuredOutputManager(vc), block_size=16)
    assert sched.scheduler_config.long_prefill_token_threshold == CLAMP  # set by the patch
    for i in range(n_requests):
        sched.add_request(Request(f"r{i}", [1] * PROMPT, SamplingParams(max_tokens=2), None))
    return dict(sched.schedule().num_scheduled_tokens)


def test_installed_release_applies_the_threshold_only_to_shared_steps(clamped) -> None:  # type: ignore[no-untyped-def]
    inst = versions.installed_vllm()
    assert inst is not None and inst.version == "0.32.0"
    row = clamp.SPEC.support_for(inst.version)
    assert row is not None and row is clamp.SPEC.support[1] and "alone is not clamped" in row.reason
    assert STATE.patches["prefill-chunk-clamp"]["status"] == "applied"
    assert _schedule(1) == {"r0": PROMPT}  # alone: not clamped on 0.32
    assert _schedule(2) == {"r0": CLAMP, "r1": CLAMP}  # shared: each chunk bounded
    # the patch's own line says what it bounds on this release
    assert any("prefill-chunk-clamp: long_prefill_token_threshold 0 -> 256" in e and "alone is not clamped" in e
               for e in STATE.events), STATE.events


def test_what_the_clamp_bounds_per_release() -> None:
    bounds = {v: clamp.SPEC.support_for(v).reason for v in versions.RELEASES}  # type: ignore[union-attr]
    assert all(bounds[v] == clamp.BOUNDS_EVERY for v in versions.RELEASES if Version(v) < Version("0.31.0"))
    assert all(bounds[v] == clamp.BOUNDS_SHARED for v in ("0.31.0", "0.32.0", "0.33.0"))
