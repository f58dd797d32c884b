"""Planning and judging, without an engine (pure functions)."""

from __future__ import annotations

import pytest

from vllm_overlay.tools.stress.plan import Limits, UsageError, make_plan
from vllm_overlay.tools.stress.verdict import DID_NOT_TEST, FAILED, PASSED, Outcome, judge, sizes_delta

WORKER = [{"patches": {"forward-telemetry": {"status": "applied"}}, "counters": {"guard_trips": 0}}]


def forwards_of(p, lim: Limits) -> list[int]:  # type: ignore[no-untyped-def]
    """What vLLM's scheduler makes of each shape: the decodes + each prompt's first chunk."""
    return [p.decode_streams * (1 + lim.spec_tokens) + sum(lim.first_chunk(n) for n in sh.prompts)
            for sh in p.shapes]


LIMITS = [Limits(8192, 40960, 64), Limits(8192, 40960, 64, block_size=256, mamba_aligned=True),
          Limits(32768, 40960, 64, block_size=1056, mamba_aligned=True, spec_tokens=2)]


@pytest.mark.parametrize("lim", LIMITS)
@pytest.mark.parametrize(("lo", "hi"), [(1024, 2048), (4096, 8192), (3000, 3100), (0, 64), (2048, 6144)])
def test_plan_spreads_over_the_band_and_reaches_its_top(lo: int, hi: int, lim: Limits) -> None:
    p = make_plan(lo, hi, lim, 10, None)
    assert [sh.forward for sh in p.shapes] == forwards_of(p, lim)  # the plan's sizes are the scheduler's
    assert all(lo < f <= hi for f in forwards_of(p, lim))
    top = p.shapes[0].forward
    assert top >= 0.95 * hi and top == p.target_forward  # the top shape comes first
    quarters = {next(i for i in range(4) if f <= lo + (hi - lo) * (i + 1) // 4) for f in forwards_of(p, lim)}
    if hi - lo >= 64:
        assert quarters == {0, 1, 2, 3}
    assert all(n <= 3000 for sh in p.shapes for n in sh.prompts) and p.waves >= 10
    if lim.mamba_aligned:  # prompts longer than a block end one token past a block boundary
        assert all(n <= lim.block_size or (n - 1) % lim.block_size == 0 for sh in p.shapes for n in sh.prompts)


def test_the_demo_plan_on_the_cpu_engine_chunking() -> None:
    # the tiny hybrid on vLLM's CPU build: block 256, prefix caching on (mamba align mode). A
    # prompt of 892 tokens runs 768 in its first step: 2 of them with 8 decodes made 1544, not 1792
    lim = Limits(2048, 4096, 32, block_size=256, mamba_aligned=True)
    assert lim.first_chunk(892) == 768 and lim.first_chunk(256) == 256 and lim.first_chunk(257) == 256
    p = make_plan(1024, 2048, lim, 10, None)
    assert p.shapes[0].forward >= 1946 and p.shapes[0].prompts == (1793, 228)


def test_plan_respects_the_clamp_and_seqs() -> None:
    p = make_plan(4096, 8192, Limits(8192, 40960, 64, prefill_chunk_clamp=1000), 10, None)
    assert max(n for sh in p.shapes for n in sh.prompts) <= 1000
    with pytest.raises(UsageError, match="--max-num-seqs"):
        make_plan(4096, 8192, Limits(8192, 40960, 4, prefill_chunk_clamp=500), 10, None)


def test_requests_bound_the_waves() -> None:
    p = make_plan(4096, 8192, Limits(8192, 40960, 64), 10, 9)
    assert sum(len(p.shape(w).prompts) for w in range(p.waves)) <= 9
    assert sum(len(p.shape(w).prompts) for w in range(p.waves + 1)) > 9


def test_judge() -> None:
    ok = Outcome(requests_ok=5, wall_s=1.0, generated_tokens=10, ttft_s=[0.1, 0.2])
    assert judge(10, 20, 2, {15: 3, 19: 1, 5: 9}, ok, WORKER)["exit_code"] == PASSED
    r = judge(10, 20, 5, {15: 3}, ok, WORKER)
    assert r["exit_code"] == DID_NOT_TEST and "only 3" in r["why"]
    assert judge(10, 20, 1, {15: 3}, ok, [])["exit_code"] == DID_NOT_TEST
    bad = Outcome(requests_ok=4, requests_failed=1, wall_s=1.0)
    assert judge(10, 20, 1, {15: 3}, bad, WORKER)["exit_code"] == FAILED
    assert sizes_delta({15: 1}, {15: 4, 3: 1}) == {15: 3, 3: 1}


def test_the_verdict_needs_the_top_quarter_and_says_how_much_of_the_band_it_saw() -> None:
    ok = Outcome(requests_ok=5, wall_s=1.0, generated_tokens=10)
    # band (4096, 12288]: 462 forwards, the largest 7,587: the top quarter (10240, 12288] saw nothing
    r = judge(4096, 12288, 10, {5000: 200, 7587: 262}, ok, WORKER)
    assert r["exit_code"] == DID_NOT_TEST and "none in its top quarter (10240, 12288]" in r["why"]
    assert "--allow-partial-band" in r["why"] and r["top_quarter_covered"] is False
    assert [q["forwards"] for q in r["band_quarters"]] == [200, 262, 0, 0]
    assert r["max_forward_share_of_hi"] == round(7587 / 12288, 3)
    partial = judge(4096, 12288, 10, {5000: 200, 7587: 262}, ok, WORKER, allow_partial=True)
    assert partial["exit_code"] == PASSED and "PARTIAL BAND accepted" in partial["why"]
    assert partial["partial_band_accepted"] is True
    full = judge(4096, 12288, 10, {5000: 200, 12000: 5}, ok, WORKER)
    assert full["exit_code"] == PASSED and "quarter(s) 2, 3 saw no forward" in full["why"]
    # /metrics buckets: a bucket reaching below the top quarter does not claim it
    edges = [4096, 8192, 12288]
    b = judge(4096, 12288, 10, {12288: 20}, ok, WORKER, bucket_edges=edges)
    assert b["exit_code"] == DID_NOT_TEST and b["band_quarters_exact"] is False
    exact_max = judge(4096, 12288, 10, {12288: 20}, ok, WORKER, bucket_edges=edges, max_forward=12000)
    assert exact_max["exit_code"] == PASSED
    q = judge(4096, 12288, 10, {6144: 5, 8192: 5, 10240: 5, 12288: 5}, ok, WORKER,
              bucket_edges=[4096, 6144, 8192, 10240, 12288])
    assert q["band_quarters_exact"] is True and [x["forwards"] for x in q["band_quarters"]] == [5, 5, 5, 5]


def test_tensor_parallel_ranks_are_counted_once() -> None:
    # with TP=2 both worker ranks run (and record) every forward: only rank 0 counts
    from vllm_overlay.telemetry import merge_sizes

    def rep(tp_rank: int | None, sizes: dict[str, int]) -> dict:  # type: ignore[type-arg]
        return {"tp_rank": tp_rank, "telemetry": {"forwards": {"sizes": sizes}}}

    reports = [rep(0, {"7166": 3, "9": 10}), rep(1, {"7166": 3, "9": 10}), rep(None, {"12": 1}), {"role": "driver"}]
    assert merge_sizes(reports) == {7166: 3, 9: 10, 12: 1}


def test_slow_waves_are_named() -> None:
    from vllm_overlay.tools.stress.verdict import slow_waves

    assert slow_waves([1.0, 1.1, 0.9, 5.0, 1.0]) == [{"wave": 4, "s": 5.0, "median_s": 1.0}]
    assert slow_waves([1.0, 1.1]) == []  # too few waves for a median to mean anything
    assert slow_waves([]) == []
