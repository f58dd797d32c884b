"""prefill-chunk-clamp acts only where vLLM itself chunks prefills, and says so when it stands
aside. A stand-in Scheduler.__init__ (vLLM's needs a KV-cache config), wrapped as the patch wraps
the real one; the configs are plain objects with vLLM's field names."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import wrapt

from vllm_overlay.patches import prefill_chunk_clamp as pcc
from vllm_overlay.report import STATE


class Scheduler:
    def __init__(self, chunked: bool = True, enc_dec: bool = False, runner: str = "generate") -> None:
        self.scheduler_config = SimpleNamespace(enable_chunked_prefill=chunked, long_prefill_token_threshold=0,
                                                max_num_batched_tokens=8192, runner_type=runner)
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(is_encoder_decoder=enc_dec,
                                                                        runner_type=runner))
        self.is_encoder_decoder = enc_dec


Wrapped = type("Wrapped", (Scheduler,), {"__init__": wrapt.FunctionWrapper(Scheduler.__init__, pcc._init)})


@pytest.mark.parametrize("kwargs,why", [
    ({"chunked": False}, "chunked prefill is off"),
    ({"enc_dec": True}, "an encoder-decoder model"),
    ({"runner": "pooling"}, "a pooling model"),
])
def test_stands_aside_where_vllm_does_not_chunk(monkeypatch, caplog, kwargs, why) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("VLLM_OVERLAY_PREFILL_CHUNK_CLAMP", "512")
    STATE.reset()
    with caplog.at_level("INFO", logger="vllm_overlay"):
        s = Wrapped(**kwargs)
    assert s.scheduler_config.long_prefill_token_threshold == 0
    assert any(f"stands aside: {why}" in m for m in caplog.messages)
    assert STATE.counters["clamp_stood_aside"] == 1 and any("stands aside" in e for e in STATE.events)
    STATE.reset()


def test_clamps_a_decoder_only_model_with_chunked_prefill(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("VLLM_OVERLAY_PREFILL_CHUNK_CLAMP", "512")
    STATE.reset()
    s = Wrapped()
    assert s.scheduler_config.long_prefill_token_threshold == 512
    assert "clamp_stood_aside" not in STATE.counters
    STATE.reset()


@pytest.fixture
def clamp_on(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    from vllm_overlay import core

    monkeypatch.setenv("VLLM_OVERLAY_REPORT_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_OVERLAY_PREFILL_CHUNK_CLAMP", "512")
    core.revert()
    STATE.reset()
    core.register()
    assert STATE.patches["prefill-chunk-clamp"]["status"] in ("applied", "armed")
    yield
    core.revert()
    STATE.reset()


def _real_scheduler(chunked: bool):  # type: ignore[no-untyped-def]
    """vLLM's own Scheduler with real configs (the tiny hybrid's model config; one attention KV
    group is all the scheduler needs to admit requests)."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from vllm_overlay.tools.models import tiny_hybrid_dir

    sched = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=1024, max_model_len=1024,
                            enable_chunked_prefill=chunked, is_encoder_decoder=False)
    model = ModelConfig(model=tiny_hybrid_dir(), dtype="float16", seed=0, skip_tokenizer_init=True,
                        max_model_len=1024)
    cache = CacheConfig(block_size=16, enable_prefix_caching=False)
    cfg = VllmConfig(scheduler_config=sched, model_config=model, cache_config=cache)
    cache.num_gpu_blocks = 1000
    kv = KVCacheConfig(num_blocks=1000, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layer"], FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32))])
    return VllmScheduler(vllm_config=cfg, kv_cache_config=kv, log_stats=True,
                         structured_output_manager=StructuredOutputManager(cfg), block_size=16)


@pytest.mark.parametrize("chunked,expect", [(False, {"0": 800}), (True, {"0": 512, "1": 512})])
def test_real_scheduler_with_the_clamp_on(clamp_on, chunked, expect) -> None:  # type: ignore[no-untyped-def]
    """The case of vLLM's tests/v1/core/test_scheduler.py::test_schedule_order (two long and two
    short prompts, 1024-token budget): with chunked prefill off the clamp stands aside and vLLM
    schedules the first long prompt alone, as stock does; with it on, each long prompt is chunked
    to the clamp."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    s = _real_scheduler(chunked)
    for i, n in enumerate([800, 800, 10, 10]):
        s.add_request(Request(request_id=str(i), prompt_token_ids=[i] * n,
                              sampling_params=SamplingParams(max_tokens=4), pooling_params=None))
    assert dict(s.schedule().num_scheduled_tokens) == expect
    assert s.scheduler_config.long_prefill_token_threshold == (512 if chunked else 0)
