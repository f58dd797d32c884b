"""A real vLLM engine (CPU build, eager) with the tiny hybrid model: the bug report's traffic
shape at max_num_batched_tokens 8192, stock vs overlay, a forced small buffer, the clamp and
a legacy alias. Every boot is its own process (tests/scenario.py)."""

from __future__ import annotations

import pytest

from conftest import worker_report

pytestmark = pytest.mark.engine

BAND = (4096, 8192)


def band_forwards(rep: dict) -> int:  # type: ignore[type-arg]
    return sum(c for s, c in rep["telemetry"]["forwards"]["sizes"].items() if BAND[0] < int(s) <= BAND[1])


@pytest.fixture(scope="module")
def overlay(scenarios):  # type: ignore[no-untyped-def]
    return scenarios.run("eager-overlay", ["--shape", "bug"], {})


@pytest.fixture(scope="module")
def stock(scenarios):  # type: ignore[no-untyped-def]
    return scenarios.run("eager-stock", ["--shape", "bug"], {"VLLM_OVERLAY": "0"})


def test_overlay_applies_in_the_worker_and_sees_the_band(overlay) -> None:  # type: ignore[no-untyped-def]
    assert overlay["ok"], overlay.get("traceback") or overlay["log"][-3000:]
    w = worker_report(overlay["reports"])
    assert band_forwards(w) >= 1, "DID NOT TEST: no forward landed in (4096, 8192]"
    assert {p: w["patches"][p]["status"] for p in ("forward-telemetry", "gdn-output-prealloc", "compile-cache-key")} \
        == dict.fromkeys(("forward-telemetry", "gdn-output-prealloc", "compile-cache-key"), "applied")
    # the bug report's step: 2500 + 2600 + 2400 + 8 x 40 = 7820 tokens in one forward
    assert w["telemetry"]["forwards"]["sizes"].get("7820") == 1
    assert band_forwards(w) >= 1 and w["telemetry"]["forwards"]["max"] == 7820
    assert w["counters"]["guard_trips"] == 0 and w["counters"]["guard_checks"] >= 1
    (buf,) = w["buffers"]
    assert buf["rows"] == 8192 and buf["source"] == "live scheduler_config.max_num_batched_tokens"
    assert buf["layers"] == 3  # the tiny model's three GDN layers share it
    assert w["engine_config"]["max_num_batched_tokens"] == 8192
    # the CPU build's worker builds the V1 runner; every runner hook of the patches fired or is in place
    assert w["runner"] == {"kind": "V1", "class": "vllm.v1.worker.cpu_model_runner.CPUModelRunner"}
    for p in ("forward-telemetry", "gdn-output-prealloc"):
        assert w["patches"][p]["runner"]["kind"] == "V1" and w["patches"][p]["runner"]["missing"] == [], p
    assert "_model_forward" in w["patches"]["gdn-output-prealloc"]["runner"]["fired"]
    assert "runner_hooks_not_fired" not in w["counters"] and "did not fire" not in overlay["log"]
    # a summary line names pid and role (engine core in-process here: VLLM_ENABLE_V1_MULTIPROCESSING=0).
    # Whether the GDN layer module is imported before or after the worker's rank is known depends on
    # the machine; a line written before names an earlier role and is followed by one with the final
    # role, so the process's last summary line is the one to assert on.
    summaries = [ln for ln in overlay["log"].splitlines() if f"[vllm-overlay] pid {w['pid']} role " in ln]
    assert f"pid {w['pid']} role worker rank 0: 7 applied" in summaries[-1], summaries
    # moe-configs applies in the worker too (the CPU MoE reads no Triton config, so it records none)
    assert w["patches"]["moe-configs"]["status"] == "applied"
    # register() decides and arms in about 0.05 s here; the bound is loose enough for a busy 2-core CI machine
    assert all(r["load_apply_s"] < 5.0 for r in overlay["reports"])


def test_overlay_outputs_equal_stock(overlay, stock) -> None:  # type: ignore[no-untyped-def]
    assert stock["ok"], stock.get("traceback")
    (rep,) = stock["reports"]  # VLLM_OVERLAY=0: the process still reports, and says all is off
    assert all(p["status"] == "off" for p in rep["patches"].values())
    assert rep["telemetry"]["forwards"]["count"] == 0
    assert overlay["token_ids"] == stock["token_ids"]
    diffs = [abs(a - b) for la, lb in zip(overlay["logprobs"], stock["logprobs"]) for a, b in zip(la, lb)]
    assert max(diffs) <= 1e-4, max(diffs)


def test_forced_small_buffer_fails_with_our_error(scenarios) -> None:  # type: ignore[no-untyped-def]
    # memory-headroom off: its forward of max_num_batched_tokens at boot would trip the guard first
    # (next test); here the guard is shown under traffic, where the legacy tree crashed
    r = scenarios.run("eager-forced-4096", ["--shape", "bug"],
                      {"VLLM_OVERLAY_TEST_BUFFER_ROWS": "4096", "VLLM_OVERLAY_MEMORY_HEADROOM": "0"})
    assert not r["ok"]
    text = r["log"] + r.get("error", "") + r.get("traceback", "")
    assert r["error"].startswith("CapacityError: vllm-overlay: a forward of 7820 tokens exceeds the GDN "
                                 "output buffer of 4096 rows (size from TEST env VLLM_OVERLAY_TEST_BUFFER_ROWS)")
    assert "setStorage" not in text
    w = worker_report(r["reports"])
    assert w["counters"]["guard_trips"] == 1


def test_forced_small_buffer_fails_at_boot_with_memory_headroom(scenarios) -> None:  # type: ignore[no-untyped-def]
    """memory-headroom runs a forward of max_num_batched_tokens before the KV cache is sized, so a
    buffer below it is refused at boot, by the guard, before any request is accepted."""
    r = scenarios.run("eager-forced-4096-headroom", ["--shape", "bug"], {"VLLM_OVERLAY_TEST_BUFFER_ROWS": "4096"})
    assert not r["ok"] and "boot_s" not in r
    assert r["error"].startswith("CapacityError: vllm-overlay: a dummy forward of 8192 tokens exceeds the GDN "
                                 "output buffer of 4096 rows"), r["error"]
    assert "memory_headroom.py" in r["traceback"]
    assert worker_report(r["reports"])["counters"]["guard_trips"] == 1


def test_legacy_configuration_fails_inside_the_gdn_kernel(scenarios) -> None:  # type: ignore[no-untyped-def]
    # the reference tree's configuration: 4096-row buffer, no guard, no memory-headroom; on the CPU
    # build the GDN kernel's write into the short slice fails (on the H200 it is Inductor's setStorage: bench/)
    r = scenarios.run("eager-legacy-4096", ["--shape", "bug"],
                      {"VLLM_OVERLAY_TEST_BUFFER_ROWS": "4096", "VLLM_OVERLAY_TEST_GUARD": "0",
                       "VLLM_OVERLAY_MEMORY_HEADROOM": "0"})
    w = worker_report(r["reports"])
    assert band_forwards(w) >= 1, "DID NOT TEST: no forward landed in (4096, 8192]"
    assert not r["ok"]
    assert r["error"].startswith("RuntimeError: The expanded size of the tensor (4096) must match the existing "
                                 "size (7820) at non-singleton dimension 0")
    assert "ops/cpu/gdn_attention.py" in r["traceback"] and "core_attn_out[" in r["traceback"]
    assert w["counters"]["guard_trips"] == 0 and w["counters"]["guard_checks"] == 0


def test_user_budget_below_mnbt_is_refused_under_strict(scenarios) -> None:  # type: ignore[no-untyped-def]
    r = scenarios.run("eager-strict-budget", ["--shape", "short"],
                      {"VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET": "4096", "VLLM_OVERLAY_STRICT": "1"})
    assert not r["ok"]
    assert "BudgetError" in r["error"] and "token budget 4096" in r["error"]
    # the floor is read from the live model runner (its max_num_tokens), not guessed from the config
    assert "(8192, the model runner's max_num_tokens)" in r["error"]


def test_short_prompt_clamp_and_alias(scenarios) -> None:  # type: ignore[no-untyped-def]
    r = scenarios.run("eager-short-clamp-alias", ["--shape", "short", "--max-tokens", "4"],
                      {"VLLM_OVERLAY_PREFILL_CHUNK_CLAMP": "128", "GENESIS_PREALLOC_TOKEN_BUDGET": "4096"})
    assert r["ok"], r.get("traceback")
    w = worker_report(r["reports"])
    fw = w["telemetry"]["forwards"]
    # 300 + 40 + 40 prompt tokens, then 3 requests x 3 more decode steps: every token counted once
    assert fw["tokens"] == 380 + 3 * 3
    # the clamp bounds each request's chunk, so no forward holds the 300-token prompt whole
    assert fw["max"] <= 128 + 40 + 40
    assert w["patches"]["prefill-chunk-clamp"]["status"] == "applied" or any(
        "prefill-chunk-clamp" in e for r2 in r["reports"] for e in r2["events"])
    # a user budget of 4096 (legacy alias) is raised to max_num_batched_tokens with the named warning
    # and the floor is named as the source of the size it raised
    (buf,) = w["buffers"]
    assert buf["rows"] == 8192 and buf["source"] == "floor: the model runner's max_num_tokens"
    (b,) = [b for b in w["budgets"] if b["purpose"] == "gdn-output"]
    assert (b["requested"], b["requested_source"], b["raised"]) == (4096, "alias GENESIS_PREALLOC_TOKEN_BUDGET", True)
    assert ("token budget for gdn-output: 4096 from alias GENESIS_PREALLOC_TOKEN_BUDGET is below the largest "
            "schedulable forward 8192; raised to 8192 (source: floor: the model runner's max_num_tokens)") in r["log"]


def test_turboquant_k8v4_on_the_hybrid_with_the_overlay(scenarios) -> None:  # type: ignore[no-untyped-def]
    # vLLM 0.32 supports TurboQuant on hybrids upstream (full-attention layers only); the overlay's
    # GDN buffer and guard must compose with it on the bug report's traffic
    r = scenarios.run("eager-turboquant-k8v4", ["--shape", "bug", "--kv-cache-dtype", "turboquant_k8v4"], {})
    assert r["ok"], r.get("traceback") or r["log"][-3000:]
    assert "TQ hybrid: full-attention layers [3]" in r["log"]
    w = worker_report(r["reports"])
    assert band_forwards(w) >= 1, "DID NOT TEST: no forward landed in (4096, 8192]"
    assert w["patches"]["gdn-output-prealloc"]["status"] == "applied" and w["counters"]["guard_trips"] == 0
    # our 0.20.x hybrid-turboquant patch stands aside: upstream does it here (vLLM PR 39931)
    assert w["patches"]["hybrid-turboquant"]["status"] == "upstream-merged", w["patches"]["hybrid-turboquant"]


def test_speculative_decoding_does_not_inflate_the_buffer(scenarios) -> None:  # type: ignore[no-untyped-def]
    # vLLM's ngram drafter (it runs on the CPU build) with 3 speculative tokens: the scheduler counts
    # verify tokens inside max_num_batched_tokens, and the runner's input buffers hold exactly that
    # many, so the buffer has the runner's rows, not max_num_batched_tokens + max_num_seqs x 3
    r = scenarios.run("eager-ngram-spec3", ["--shape", "short", "--ngram-spec", "3"], {})
    assert r["ok"], r.get("traceback") or r["log"][-3000:]
    w = worker_report(r["reports"])
    cfg = w["engine_config"]
    assert cfg["num_speculative_tokens"] == 3 and cfg["max_num_seqs"] == 32
    (buf,) = w["buffers"]
    assert buf["rows"] == cfg["runner_max_num_tokens"] == cfg["max_num_batched_tokens"] == 8192
    assert buf["source"] == "live scheduler_config.max_num_batched_tokens"
    assert w["telemetry"]["forwards"]["max"] <= buf["rows"]
