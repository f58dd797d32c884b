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
