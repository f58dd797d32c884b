"""The compiled path of the CPU build (torch.compile / Inductor): profile cap, the capacity
guard against a forced small buffer, and the compile cache across patched / unpatched runs."""

from __future__ import annotations

import os

import pytest

from conftest import worker_report

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):  # type: ignore[no-untyped-def]
    return str(tmp_path_factory.mktemp("vllm-cache"))


def run(scenarios, name, cache_root, **env):  # type: ignore[no-untyped-def]
    return scenarios.run(name, ["--shape", "bug", "--compile"], {"VLLM_CACHE_ROOT": cache_root, **env})


def test_cap_bounds_only_the_profile_forward(scenarios, cache_root) -> None:  # type: ignore[no-untyped-def]
    r = run(scenarios, "compiled-cap", cache_root, VLLM_OVERLAY_PROFILE_RUN_CAP="4096")
    assert r["ok"], r.get("traceback") or r["log"][-3000:]
    w = worker_report(r["reports"])
    assert w["telemetry"]["profile_forward_tokens"] == [4096]
    assert w["patches"]["profile-run-cap"]["status"] == "applied"
    assert "profiling forward capped from 8192 to 4096" in r["log"]
    (buf,) = w["buffers"]
    assert buf["rows"] == 8192  # the cap never sizes a buffer
    assert w["telemetry"]["forwards"]["sizes"].get("7820") == 1
    assert w["counters"]["guard_trips"] == 0
    # the cap's hooks on the V1 runner: _dummy_run fired (the capped profile); capture_model is in
    # place though the CPU worker never captures
    rec = w["patches"]["profile-run-cap"]["runner"]
    assert rec["kind"] == "V1" and rec["missing"] == [] and rec["fired"] == ["_dummy_run"]
    assert "did not fire" not in r["log"]


def test_compile_cache_never_crosses_patch_sets(scenarios, cache_root) -> None:  # type: ignore[no-untyped-def]
    patched = run(scenarios, "compiled-cap", cache_root, VLLM_OVERLAY_PROFILE_RUN_CAP="4096")
    stock = run(scenarios, "compiled-stock", cache_root, VLLM_OVERLAY="0")
    again = run(scenarios, "compiled-cap-again", cache_root, VLLM_OVERLAY_PROFILE_RUN_CAP="4096")
    for r in (patched, stock, again):
        assert r["ok"], r.get("traceback") or r["log"][-3000:]
    assert patched["token_ids"] == stock["token_ids"] == again["token_ids"]
    diffs = [abs(a - b) for la, lb in zip(patched["logprobs"], stock["logprobs"]) for a, b in zip(la, lb)]
    assert max(diffs) <= 1e-4, max(diffs)
    aot = os.path.join(cache_root, "torch_compile_cache", "torch_aot_compile")
    keys = sorted(os.listdir(aot)) if os.path.isdir(aot) else []
    assert len(keys) == 2, keys  # one graph per patch set, never shared
    assert worker_report(again["reports"])["patches"]["gdn-output-prealloc"]["status"] == "applied"


def test_guard_holds_in_compiled_code(scenarios, cache_root) -> None:  # type: ignore[no-untyped-def]
    # the bug report's runtime crash configuration: 4096-row buffer, cap 4096, mnbt 8192 (without
    # memory-headroom, whose forward of 8192 tokens at boot would trip the guard before traffic)
    r = run(scenarios, "compiled-forced-4096", cache_root, VLLM_OVERLAY_PROFILE_RUN_CAP="4096",
            VLLM_OVERLAY_TEST_BUFFER_ROWS="4096", VLLM_OVERLAY_MEMORY_HEADROOM="0")
    assert not r["ok"]
    text = r["log"] + r.get("error", "") + r.get("traceback", "")
    assert "a forward of 7820 tokens exceeds the GDN output buffer of 4096 rows" in r["error"]
    assert "setStorage" not in text
    assert worker_report(r["reports"])["counters"]["guard_trips"] == 1


def test_memory_headroom_measures_what_the_cap_left_out(scenarios, cache_root) -> None:  # type: ignore[no-untyped-def]
    """torch.compile: the CPU worker's warm-up runs vLLM's profiling forward, here capped at 4096
    tokens; memory-headroom's forward of 8192 tokens peaks higher, the difference leaves the KV
    cache, and the KV cache vLLM allocates is the one the report predicts."""
    from test_memory_headroom import headroom_record, vllm_kv_tokens

    r = run(scenarios, "compiled-cap", cache_root, VLLM_OVERLAY_PROFILE_RUN_CAP="4096")
    rec = headroom_record(r)
    assert rec["profile"] is not None and rec["profile_run_cap"] == 4096
    assert rec["measured_peak"] > rec["profiled_peak"] > 0
    assert rec["moved"] == rec["measured"] - rec["reserved"] > 0
    assert vllm_kv_tokens(r) == rec["kv_tokens_after"]
    assert "vLLM profiled 4096 tokens: VLLM_OVERLAY_PROFILE_RUN_CAP" in r["log"]
