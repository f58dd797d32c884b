"""Planning and judging, without an engine (pure functions)."""

from __future__ import annotations

import pytest

from vllm_overlay.stress.plan import Limits, UsageError, make_plan
from vllm_overlay.stress.verdict import DID_NOT_TEST, FAILED, PASSED, Outcome, judge, sizes_delta

WORKER = [{"patches": {"forward-telemetry": {"status": "applied"}}, "counters": {"guard_trips": 0}}]


@pytest.mark.parametrize(("lo", "hi", "mnbt"), [(1024, 2048, 2048), (4096, 8192, 8192), (3000, 3100, 8192),
                                                (0, 64, 64), (16000, 32768, 32768)])
def test_plan_lands_inside_the_band(lo: int, hi: int, mnbt: int) -> None:
    p = make_plan(lo, hi, Limits(mnbt, 40960, 64), 10, None)
    assert lo < p.decode_streams + p.prefills_per_wave * p.prompt_tokens == p.target_forward <= hi
    assert p.prompt_tokens <= 3000 and p.waves >= 10


def test_plan_respects_the_clamp_and_seqs() -> None:
    p = make_plan(4096, 8192, Limits(8192, 40960, 64, prefill_chunk_clamp=1000), 10, None)
    assert p.prompt_tokens <= 1000
    with pytest.raises(UsageError, match="--max-num-seqs"):
        make_plan(4096, 8192, Limits(8192, 40960, 4, prefill_chunk_clamp=500), 10, None)


def test_requests_bound_the_waves() -> None:
    p = make_plan(4096, 8192, Limits(8192, 40960, 64), 10, 9)
    assert p.waves == 9 // p.prefills_per_wave


def test_judge() -> None:
    ok = Outcome(requests_ok=5, wall_s=1.0, generated_tokens=10, ttft_s=[0.1, 0.2])
    assert judge(10, 20, 2, {15: 3, 5: 9}, ok, WORKER)["exit_code"] == PASSED
    r = judge(10, 20, 5, {15: 3}, ok, WORKER)
    assert r["exit_code"] == DID_NOT_TEST and "only 3" in r["why"]
    assert judge(10, 20, 1, {15: 3}, ok, [])["exit_code"] == DID_NOT_TEST
    bad = Outcome(requests_ok=4, requests_failed=1, wall_s=1.0)
    assert judge(10, 20, 1, {15: 3}, bad, WORKER)["exit_code"] == FAILED
    assert sizes_delta({15: 1}, {15: 4, 3: 1}) == {15: 3, 3: 1}


def test_tensor_parallel_ranks_are_counted_once() -> None:
    # with TP=2 both worker ranks run (and record) every forward: only rank 0 counts
    from vllm_overlay.telemetry import merge_sizes

    def rep(tp_rank: int | None, sizes: dict[str, int]) -> dict:  # type: ignore[type-arg]
        return {"tp_rank": tp_rank, "telemetry": {"forwards": {"sizes": sizes}}}

    reports = [rep(0, {"7166": 3, "9": 10}), rep(1, {"7166": 3, "9": 10}), rep(None, {"12": 1}), {"role": "driver"}]
    assert merge_sizes(reports) == {7166: 3, 9: 10, 12: 1}


def test_slow_waves_are_named() -> None:
    from vllm_overlay.stress.verdict import slow_waves

    assert slow_waves([1.0, 1.1, 0.9, 5.0, 1.0]) == [{"wave": 4, "s": 5.0, "median_s": 1.0}]
    assert slow_waves([1.0, 1.1]) == []  # too few waves for a median to mean anything
    assert slow_waves([]) == []
