"""memory-headroom in the worker: what it measures, where it stands aside (loudly), and, with a real
vLLM CPU engine, that the KV cache vLLM allocates is the corrected one.

The CPU worker sizes its KV cache from the resident set (requested memory - VmRSS after its
warm-up, which runs a profiling forward only under torch.compile); the patch meters the same
resident set (VmHWM reset through /proc/self/clear_refs). The CUDA meter (allocator bytes) and
CUDA graph capture cannot run here: bench/memory_headroom_h200.py measures them on the H200.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from conftest import worker_report
from vllm_overlay import core, versions
from vllm_overlay.patches import _memory_meters as meters
from vllm_overlay.patches import _memory_watch as watch
from vllm_overlay.patches import memory_headroom as mh
from vllm_overlay.report import STATE


def test_rss_meter_reads_and_resets_the_peak_of_this_process() -> None:
    m = meters.RssMeter()
    m.reset_peak()
    before = m.peak()
    assert before >= m.current() - (1 << 20) > 0
    blob = bytearray(64 << 20)  # 64 MiB touched: the peak rises by about that much
    for i in range(0, len(blob), 4096):
        blob[i] = 1
    assert m.peak() - before >= 60 << 20
    del blob
    m.reset_peak()
    assert m.peak() - m.current() < 16 << 20


def test_rss_meter_that_cannot_reset_says_why(tmp_path) -> None:  # type: ignore[no-untyped-def]
    m = meters.RssMeter(clear_refs=str(tmp_path / "no-such-dir" / "clear_refs"))
    with pytest.raises(meters.MeterUnavailable, match="cannot reset the peak resident set"):
        m.reset_peak()


def test_targets_per_build() -> None:
    assert mh.SPEC.modules("0.32.0", "cpu") == ["vllm.v1.worker.cpu_worker", "vllm.v1.worker.gpu.model_runner",
                                                 "vllm.v1.worker.gpu_model_runner"]
    assert mh.SPEC.modules("0.20.2", "cuda") == ["vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu_worker"]
    assert mh.SPEC.modules("0.31.0", "cuda") == ["vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu_worker"]
    v2 = [t.qualname for t in mh.SPEC.wrap_targets("0.33.0") if t.module == "vllm.v1.worker.gpu.model_runner"]
    assert v2 == ["GPUModelRunner.profile_run", "GPUModelRunner.initialize_kv_cache"]


def test_v2_cells_follow_the_releases_it_measures() -> None:
    from vllm_overlay import levels

    assert levels.cell(mh.SPEC, "0.31.0", "V2", "cuda").level == "unsupported"
    assert "acts on V2 of >=0.32.0 only" in levels.cell(mh.SPEC, "0.26.0", "V2", "cuda").why
    assert levels.cell(mh.SPEC, "0.32.0", "V2", "cuda").level == "source-checked"
    assert levels.cell(mh.SPEC, "0.33.0", "V2", "cuda").level == "gpu-proven"  # series memory, H200, 2026-12-04
    assert levels.cell(mh.SPEC, "0.32.0", "V2", "cpu").level == "source-checked"  # V2 cannot run on the CPU build
    assert levels.cell(mh.SPEC, "0.32.0", "V1", "cpu").level == "cpu-proven"


def test_zero_turns_it_off_with_the_setting_named(monkeypatch, tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    d = {x.spec.id: x for x in core.decide({"VLLM_OVERLAY_MEMORY_HEADROOM": "0"},
                                           vllm=versions.Installed("vllm", "0.20.2", "cuda"))}
    assert d["memory-headroom"].status == "off"
    assert d["memory-headroom"].reason == "VLLM_OVERLAY_MEMORY_HEADROOM=0 turns it off"
    d = {x.spec.id: x for x in core.decide({}, vllm=versions.Installed("vllm", "0.33.0", "cuda"))}
    assert d["memory-headroom"].status == "planned" and d["memory-headroom"].reason == "on by default"
    monkeypatch.setenv("VLLM_OVERLAY_REPORT_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_OVERLAY_MEMORY_HEADROOM", "0")
    core.revert()
    STATE.reset()
    try:
        with caplog.at_level("WARNING", logger="vllm_overlay"):
            core.register()
        assert STATE.patches["memory-headroom"]["status"] == "off"
        lines = [r.getMessage() for r in caplog.records if "memory-headroom" in r.getMessage()]
        assert lines == ["patch memory-headroom off: VLLM_OVERLAY_MEMORY_HEADROOM=0 turns it off (1 or 0 (0 turns "
                         "the correction off: UNSAFE, the KV cache may take memory a forward of "
                         "max_num_batched_tokens needs))"]
    finally:
        core.revert()
        STATE.reset()


def test_doctor_warns_when_it_is_off() -> None:
    from vllm_overlay.tools.cli.doctor import findings

    off = findings(None, {"VLLM_OVERLAY_MEMORY_HEADROOM": "0", "VLLM_OVERLAY_PROFILE_RUN_CAP": "4096"})
    assert any(level == "warning" and "VLLM_OVERLAY_MEMORY_HEADROOM=0: unsafe" in text for level, text in off)
    assert any("with VLLM_OVERLAY_MEMORY_HEADROOM=0 nothing measures them" in text for _, text in off)
    on = findings(None, {"VLLM_OVERLAY_PROFILE_RUN_CAP": "4096"})
    assert any("memory-headroom measures a forward of max_num_batched_tokens" in text for _, text in on)
    dry = findings(None, {"VLLM_OVERLAY_MEMORY_HEADROOM_DRY_RUN": "1"})
    assert [(lv, t.split(":")[0]) for lv, t in dry] == [("warning", "VLLM_OVERLAY_MEMORY_HEADROOM_DRY_RUN=1")]
    assert not any("DRY_RUN" in t for _, t in findings(None, {"VLLM_OVERLAY_MEMORY_HEADROOM": "0",
                                                             "VLLM_OVERLAY_MEMORY_HEADROOM_DRY_RUN": "1"}))


# Stand-ins for a worker (plain objects with the attributes the patch reads): what it does where it
# must not measure is decided before vLLM's runner is touched.


def test_explicit_kv_size_is_left_alone_and_said_once(caplog) -> None:  # type: ignore[no-untyped-def]
    STATE.reset()
    mh._warned.clear()
    worker = SimpleNamespace(cache_config=SimpleNamespace(kv_cache_memory_bytes=4 << 30), model_runner=None,
                             device=SimpleNamespace(type="cpu"))
    with caplog.at_level("WARNING", logger="vllm_overlay"):
        assert mh.correct(worker, 4 << 30) == 4 << 30
        assert mh.correct(worker, 4 << 30) == 4 << 30
    lines = [r.getMessage() for r in caplog.records if "NOT corrected" in r.getMessage()]
    assert len(lines) == 1 and "kv_cache_memory_bytes is set" in lines[0]
    assert STATE.counters["headroom_not_corrected"] == 2
    assert "kv_cache_memory_bytes" in STATE.patches["memory-headroom"]["not_corrected"]
    STATE.reset()


def v2_runner() -> object:
    """An instance of the installed vLLM's real Model Runner V2 class, without its __init__ (which
    needs CUDA or Triton: the CPU build refuses V2 at config time, "Model Runner V2 requires
    Triton.")."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    return object.__new__(GPUModelRunner)


def test_model_runner_v2_is_measured_from_0_32_0_and_named_before() -> None:
    worker = SimpleNamespace(cache_config=SimpleNamespace(kv_cache_memory_bytes=None))
    saved = STATE.vllm_version
    try:
        STATE.vllm_version = "0.31.0"
        why = mh._why_not(worker, v2_runner(), cpu=False)
        assert why is not None and "Model Runner V2) on vLLM 0.31.0" in why and ">=0.32.0" in why
        assert "VLLM_USE_V2_MODEL_RUNNER=0" in why
        STATE.vllm_version = "0.32.0"
        assert mh._why_not(worker, v2_runner(), cpu=False) is None
        assert "neither vLLM's V1 model runner nor Model Runner V2" in mh._why_not(worker, object(), cpu=False)
    finally:
        STATE.vllm_version = saved


def test_the_extensible_kv_cache_is_left_alone_before_any_runner_check(caplog) -> None:  # type: ignore[no-untyped-def]
    """vLLM 0.34.0's extensible KV cache (CacheConfig.enable_extensible_kv_cache, on by default on CUDA)
    sizes the cache after warm-up steps, not from profiling: nothing to correct, said before the runner is
    looked at. The worker and its cache_config are stand-ins with the fields read: 0.34.0's Worker cannot be
    built here (no CUDA, and the installed vLLM is 0.32.0, whose CacheConfig has no such field)."""
    ext = "vLLM's extensible KV cache is on (vLLM 0.34.0's default on CUDA)"
    on = SimpleNamespace(cache_config=SimpleNamespace(kv_cache_memory_bytes=None, enable_extensible_kv_cache=True))
    saved = STATE.vllm_version
    try:
        for version in ("0.31.0", "0.34.0"):
            STATE.vllm_version = version
            for runner, cpu in ((object(), False), (v2_runner(), False), (None, True)):
                why = mh._why_not(on, runner, cpu)
                assert why is not None and why.startswith(ext), (version, runner, why)
                assert "--no-enable-extensible-kv-cache" in why
        # the user's KV cache size still comes first
        both = SimpleNamespace(cache_config=SimpleNamespace(kv_cache_memory_bytes=4 << 30,
                                                            enable_extensible_kv_cache=True))
        assert mh._why_not(both, v2_runner(), cpu=False).startswith("kv_cache_memory_bytes is set")
        # off, or a release without the field: what it was
        for cache_config in (SimpleNamespace(kv_cache_memory_bytes=None, enable_extensible_kv_cache=False),
                             SimpleNamespace(kv_cache_memory_bytes=None, enable_extensible_kv_cache=None),
                             SimpleNamespace(kv_cache_memory_bytes=None)):
            worker = SimpleNamespace(cache_config=cache_config)
            assert mh._why_not(worker, v2_runner(), cpu=False) is None
            assert "neither vLLM's V1 model runner nor Model Runner V2" in mh._why_not(worker, object(), cpu=False)
        STATE.vllm_version = "0.31.0"
        off = SimpleNamespace(cache_config=SimpleNamespace(kv_cache_memory_bytes=None, enable_extensible_kv_cache=False))
        assert "Model Runner V2) on vLLM 0.31.0" in mh._why_not(off, v2_runner(), cpu=False)
        # through correct(): the budget is vLLM's, with one warning and the reason in the report
        STATE.reset()
        mh._warned.clear()
        worker = SimpleNamespace(cache_config=on.cache_config, model_runner=v2_runner(),
                                 device=SimpleNamespace(type="cuda", index=0))
        with caplog.at_level("WARNING", logger="vllm_overlay"):
            assert mh.correct(worker, 8 << 30) == 8 << 30
            assert mh.correct(worker, 8 << 30) == 8 << 30
        lines = [r.getMessage() for r in caplog.records if "NOT corrected" in r.getMessage()]
        assert lines == [f"memory-headroom: KV cache NOT corrected: {mh._why_not(worker, None, False)}"]
        assert STATE.counters["headroom_not_corrected"] == 2
        assert STATE.patches["memory-headroom"]["not_corrected"].startswith(ext)
    finally:
        STATE.vllm_version = saved
        STATE.reset()


def test_v2_measurement_drives_vllms_own_v2_profiling_entry_points(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The V2 path of the measurement on the real V2 class: vLLM's V2 profiling KV cache helper with
    a block per state slot, one _dummy_run per shape with is_profile, valid_dummy_state_slots and
    the cached context, the request count set for the call and restored, vLLM's V2 teardown after,
    and the cap of profile-run-cap told to stand aside. What cannot run here is replaced, and only
    that: the helpers and _dummy_run need CUDA/Triton kernels (stand-ins record their calls), and
    _kv_facts reads a real KVCacheConfig (fixed numbers)."""
    import torch

    from vllm.v1.worker.gpu import cudagraph_utils

    from vllm_overlay.patches import _memory_measure as mm
    from vllm_overlay.patches import _runner

    calls: list[tuple] = []  # type: ignore[type-arg]
    r = v2_runner()
    cc = SimpleNamespace(max_cudagraph_capture_size=None)
    r.__dict__.update(compilation_config=cc, vllm_config=None, max_num_reqs=32, device=torch.device("cpu"),
                      scheduler_config=SimpleNamespace(max_num_seqs=32), speculator=None,
                      model_config=SimpleNamespace(max_model_len=8192))
    monkeypatch.setattr(cudagraph_utils, "_init_minimal_kv_cache_for_profiling",
                        lambda runner: calls.append(("init", cc.max_cudagraph_capture_size)))
    monkeypatch.setattr(cudagraph_utils, "_teardown_profiling_state", lambda runner: calls.append(("teardown",)))
    monkeypatch.setattr(mm, "_kv_facts", lambda runner: (1 << 20, 32, 1))
    monkeypatch.setattr(type(r), "_dummy_run", lambda self, n, **kw: calls.append(
        ("dummy", n, self.max_num_reqs, _runner.in_measurement(), kw)), raising=True)
    m = mm.measure(r, meters.RssMeter(), 8192)
    assert calls[0] == ("init", 32) and calls[-1] == ("teardown",)
    assert cc.max_cudagraph_capture_size is None and r.max_num_reqs == 32 and not _runner.in_measurement()
    common = {"skip_attn": False, "is_profile": True, "skip_eplb": True, "valid_dummy_state_slots": True}
    assert calls[1:-1] == [("dummy", 8192, 1, True, {**common, "context_len": 0}),
                           ("dummy", 129, 1, True, {**common, "context_len": 8192 - 129}),
                           ("dummy", 8192, 31, True, {**common, "context_len": 0})]
    assert [s["name"] for s in m["shapes"]] == ["longest prefill at context 8192",
                                               "tail chunk of 129 tokens at context 8192",
                                               "31 prefills (vLLM's profiling split)"]
    assert m["left_out"] == ["30 decodes + 1 prefill (vLLM's mixed batch): Model Runner V2's _dummy_run has no "
                             "mixed batch (its split's prefills take the same per-request GDN path)"]


# ---- a real engine (CPU build) -------------------------------------------------------------------

KV_LINE = re.compile(r"CPU KV cache size: ([0-9,]+) tokens")


def headroom_record(result: dict) -> dict:  # type: ignore[type-arg]
    """The worker's memory-headroom record of a scenario (tests/test_compiled.py uses it too)."""
    assert result["ok"], result.get("traceback") or result["log"][-3000:]
    w = worker_report(result["reports"])
    assert w["patches"]["memory-headroom"]["status"] == "applied"
    (rec,) = w["patches"]["memory-headroom"]["headroom"]
    return rec


def vllm_kv_tokens(result: dict) -> int:  # type: ignore[type-arg]
    (n,) = KV_LINE.findall(result["log"])
    return int(n.replace(",", ""))


@pytest.mark.engine
def test_eager_engine_allocates_the_corrected_kv_cache(scenarios) -> None:  # type: ignore[no-untyped-def]
    """Eager CPU worker: no profiling forward at all, so vLLM reserves nothing for activations; the
    measured forward of 8192 tokens moves its whole peak out of the KV cache, and the KV cache vLLM
    then sizes is exactly the one the report predicts. The bug report's traffic is served."""
    r = scenarios.run("eager-overlay", ["--shape", "bug"], {})  # shared with test_engine.py
    rec = headroom_record(r)
    assert rec["tokens"] == 8192 and rec["profiled_peak"] == 0 and rec["profile"] is None
    assert rec["moved"] == rec["measured_peak"] > 16 << 20
    assert [s["name"] for s in rec["shapes"]] == ["longest prefill at context 8192",
                                                  "tail chunk of 129 tokens at context 8192",
                                                  "32 prefills (vLLM's profiling split)",
                                                  "31 decodes + 1 prefill (vLLM's mixed batch)"]
    assert [(s["num_reqs"], s["seq_len"], s["mixed"]) for s in rec["shapes"]] == [
        (1, 8192, False), (1, 8192, False), (32, 256, False), (32, None, True)]
    assert isinstance(rec["left_allocated"], int)  # resident set the forwards left (allocator caches on CPU)
    # the CPU build's causal-conv kernel wants a state row per request: the temporary cache has 32
    assert rec["kv_temp_blocks"] == 32 and rec["left_out"] == [] and rec["dry_run"] is False
    assert rec["blocks_after"] < rec["blocks_before"]
    assert vllm_kv_tokens(r) == rec["kv_tokens_after"]
    line = next(ln for ln in r["log"].splitlines() if "memory-headroom: profiled peak" in ln)
    assert f"{rec['kv_tokens_before']} -> {rec['kv_tokens_after']} KV tokens" in line
    # in the overlay's format, although vLLM's CPU MoE check put Python's default handler on the root
    # logger before it (logs.py): no overlay line of the boot in another format
    assert "[vllm-overlay] memory-headroom: profiled peak" in line, line
    assert [ln for ln in r["log"].splitlines() if ":vllm_overlay:" in ln] == []


@pytest.mark.engine
def test_off_is_stock_sizing_and_the_same_outputs(scenarios) -> None:  # type: ignore[no-untyped-def]
    """VLLM_OVERLAY_MEMORY_HEADROOM=0: no measurement, vLLM's own KV size (larger), and the same
    tokens as with the correction (the measuring forward leaves nothing behind in the real cache)."""
    on = scenarios.run("eager-overlay", ["--shape", "bug"], {})
    off = scenarios.run("eager-headroom-off", ["--shape", "bug"], {"VLLM_OVERLAY_MEMORY_HEADROOM": "0"})
    assert off["ok"], off.get("traceback") or off["log"][-3000:]
    w = worker_report(off["reports"])
    assert w["patches"]["memory-headroom"]["status"] == "off"
    assert "headroom" not in w["patches"]["memory-headroom"]
    assert "patch memory-headroom off: VLLM_OVERLAY_MEMORY_HEADROOM=0 turns it off" in off["log"]
    assert vllm_kv_tokens(off) > headroom_record(on)["kv_tokens_after"]
    assert off["token_ids"] == on["token_ids"]
    diffs = [abs(a - b) for la, lb in zip(on["logprobs"], off["logprobs"]) for a, b in zip(la, lb)]
    assert max(diffs) <= 1e-4, max(diffs)


@pytest.mark.engine
def test_long_prefill_runs_at_the_context_of_max_model_len(scenarios) -> None:  # type: ignore[no-untyped-def]
    """mnbt 4096 with max_model_len 8192: the longest prefill is the last 4096-token chunk of an
    8192-token prompt (attention over 8192 tokens of context on the CPU attention backend)."""
    r = scenarios.run("eager-mnbt4096", ["--shape", "short", "--mnbt", "4096"], {})
    rec = headroom_record(r)
    assert rec["tokens"] == 4096 and rec["shapes"][0]["name"] == "longest prefill at context 8192"
    assert rec["shapes"][0]["seq_len"] == 8192 and len(rec["shapes"]) == 4 and rec["left_out"] == []
    assert vllm_kv_tokens(r) == rec["kv_tokens_after"]


@pytest.mark.engine
def test_mtp_measures_the_rejection_sampler_at_the_real_draft_count(scenarios) -> None:  # type: ignore[no-untyped-def]
    """The tiny hybrid with one MTP layer and num_speculative_tokens 3 (vLLM's Qwen3NextMTP drafter
    runs on the CPU build's V1 runner): after the forwards, vLLM's own dummy sampler run of the V1
    runner, and its rejection sampler called as that run calls it (both passes: mixed sampling and
    all-greedy) with 3 drafts per request instead of vLLM's one: 32 requests (max_num_seqs), 128
    logits rows; the engine then serves MTP decodes on the corrected KV cache."""
    r = scenarios.run("eager-mtp3", ["--shape", "short", "--mtp", "3"], {})
    rec = headroom_record(r)
    *forwards, sampler = rec["shapes"]
    assert [s["name"] for s in forwards][0] == "longest prefill at context 8192" and rec["left_out"] == []
    assert sampler["name"] == "spec-decode sampler: 32 requests x 3 drafts (num_speculative_tokens)"
    assert (sampler["num_reqs"], sampler["drafts_per_request"], sampler["drafts"], sampler["rows"],
            sampler["calls"]) == (32, 3, 96, 128, 2)
    assert sampler["peak"] >= sampler["before"]
    assert vllm_kv_tokens(r) == rec["kv_tokens_after"]
    assert all(len(t) == 4 for t in r["token_ids"])  # served with MTP drafts after the correction
    assert "Resolved architecture: Qwen3NextMTP" in r["log"]


@pytest.mark.engine
def test_dry_run_moves_nothing_and_the_watch_reports_a_window(scenarios) -> None:  # type: ignore[no-untyped-def]
    """VLLM_OVERLAY_MEMORY_HEADROOM_DRY_RUN=1: the same measurement, the line says what it would move,
    the KV cache is vLLM's own (the report's kv_tokens_before); once the KV cache exists the watch
    reads the peak, and a mark file written around generate() gives that call its own window (the
    CPU build meters the resident set: the numbers are the process's, not only tensors)."""
    r = scenarios.run("eager-dry-run", ["--shape", "bug", "--memory-windows"],
                      {"VLLM_OVERLAY_MEMORY_HEADROOM_DRY_RUN": "1"})
    rec = headroom_record(r)
    assert rec["dry_run"] is True and rec["moved"] > 0
    assert vllm_kv_tokens(r) == rec["kv_tokens_before"] > rec["kv_tokens_after"]
    line = next(ln for ln in r["log"].splitlines() if "memory-headroom: profiled peak" in ln)
    assert "would move" in line and "DRY RUN (VLLM_OVERLAY_MEMORY_HEADROOM_DRY_RUN=1): nothing moved" in line
    rt = r["runtime"]
    assert rt["budget"] == rec["reserved"] and rt["baseline"] == rec["baseline"]  # nothing moved: vLLM's own
    assert rt["kv_bytes"] > 0 and rt["meter"] == "resident set (VmRSS / VmHWM)" and "error" not in rt
    gen, idle = rt["windows"]
    assert (gen["seq"], gen["name"], idle["seq"], idle["name"]) == (1, "generate", 2, "idle")
    assert gen["end"] is not None and gen["end"] >= gen["start"] and idle["end"] is None
    assert gen["peak"] >= gen["idle"] and gen["above_idle"] == gen["peak"] - gen["idle"]
    assert gen["runtime_peak"] == gen["peak"] - rt["kv_bytes"] - rt["baseline"]
    assert rt["peak"] >= gen["peak"] and max(r["window_ack_s"]) < 5


def test_watch_windows_and_the_one_warning(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    """The watch's bookkeeping on a stand-in meter (numbers set by the test; the real meters are
    exercised by the engine tests and, for CUDA, bench/stack.py memory on the H200): the cumulative
    peak, a window per mark, a closed window keeps its own peak, a bad mark is named, and exceeding
    the budget is said once."""
    class Meter:
        name = "stand-in"

        def __init__(self) -> None:
            self.now, self.top = 100, 100

        def current(self) -> int:
            return self.now

        def peak(self) -> int:
            return self.top

        def reset_peak(self) -> None:
            self.top = self.now

    STATE.reset()
    m = Meter()
    mark = tmp_path / "memory-window.json"
    w = watch.Watch(m, kv_bytes=40, baseline=50, budget=80, mark_path=str(mark), warn=True,
                    patch_id=mh.PATCH_ID)
    w.start()
    w.stop.set()  # the test ticks by hand
    m.top = 110
    w.tick()
    assert w.record["peak"] == 110 and w.record["runtime_peak"] == 20 and w.record["over_budget"] == -10
    mark.write_text(json.dumps({"seq": 1, "name": "band"}))
    w.tick()
    (band,) = w.record["windows"]
    assert (band["name"], band["idle"], band["peak"], band["end"]) == ("band", 100, 100, None)
    m.top = 130  # 130 - 40 = 90 > budget 80
    with caplog.at_level("WARNING", logger="vllm_overlay"):
        w.tick()
        m.top = 140
        w.tick()
    warnings = [r.getMessage() for r in caplog.records if "reserved" in r.getMessage()]
    assert len(warnings) == 1 and "0.000 GiB (10 bytes) more than was reserved" in warnings[0]
    mark.write_text(json.dumps({"seq": 2, "name": "idle"}))
    w.tick()
    band, idle = w.record["windows"]
    assert band["end"] is not None and band["peak"] == 140 and band["above_idle"] == 40
    assert band["over_budget"] == 20 and idle["peak"] == idle["idle"] == 100 and w.record["peak"] == 140
    assert "reserved_peak" not in band  # the stand-in, like the CPU build's meter, has no reserved peak
    m.peak_reserved = lambda: 150  # type: ignore[attr-defined] - as CudaMeter: the allocator's cached blocks too
    w.tick()
    assert idle["reserved_peak"] == 150 and "reserved_peak" not in band  # a closed window keeps its own
    mark.write_text("not json")
    w.tick()
    assert "expected {\"seq\": N, \"name\": \"...\"}" in w.record["mark_error"]
    assert STATE.patches["memory-headroom"]["runtime"] is w.record
    STATE.reset()


def test_report_command_prints_the_headroom_line() -> None:
    """`vllm-overlay report` shows each worker's correction on one line (a recorded CPU record)."""
    from vllm_overlay import headroom
    from vllm_overlay.tools.cli.report import print_reports
    from vllm_overlay.tools.output import Out
    from test_headroom import CPU

    rec = headroom.plan(**CPU).to_json()  # type: ignore[arg-type]
    rep = {"pid": 7, "role": "worker rank 0", "vllm_version": "0.32.0", "load_apply_s": 0.01,
           "counts": {"applied": 6, "armed": 0, "skipped": 0, "off": 2, "upstream-merged": 1, "failed": 0},
           "patches": {"memory-headroom": {"status": "applied", "reason": "on by default", "headroom": [rec],
                                           "runtime": {**headroom.runtime(peak=rec["reserved"] + 3 * 2**30 + 2**29,
                                                                          kv_bytes=3 * 2**30,
                                                                          baseline=rec["baseline"],
                                                                          budget=rec["reserved"]),
                                                       "budget": rec["reserved"], "baseline": rec["baseline"],
                                                       "windows": [{}, {}]}}},
           "counters": {}, "buffers": [], "events": [], "written": 1.0,
           "telemetry": {"forwards": {"count": 0, "min": None, "max": None, "sizes": {}}}}
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_reports(Out(), [rep])
    assert ("pid 7: memory-headroom at 8192 tokens: profiled peak 0.000 GiB, measured 0.165 GiB, moved 0.165 GiB; "
            "KV tokens 6004736 -> 5708513") in buf.getvalue()
    assert ("pid 7: memory-headroom at runtime: peak 0.500 GiB above the pre-profiling baseline (KV cache left "
            "out), reserved 0.000 GiB: EXCEEDED by 0.500 GiB; 2 windows") in buf.getvalue()
    # the CPU build's resident set: the whole process, so the same numbers are explained, not an alarm
    rep["patches"]["memory-headroom"]["runtime"]["whole_process"] = True
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_reports(Out(), [rep])
    assert "EXCEEDED" not in buf.getvalue()
    assert ("reserved 0.000 GiB: 0.500 GiB above it in the resident set, which counts the whole process (the "
            "scheduler's block pool, requests, modules, an in-process caller), not forwards alone: no alarm "
            "(CUDA's allocator meter judges forwards); 2 windows") in buf.getvalue()
