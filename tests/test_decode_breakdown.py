"""bench/decode_breakdown.py: families, steps and CUDA-graph replays on a synthetic trace with vLLM 0.33.0's
kernel names; the floors; bad options; and (engine) one tiny-hybrid `vllm serve` of the CPU build, profiled
through /start_profile, its real trace (CPU operators) parsed end to end."""

from __future__ import annotations

import json, os, subprocess, sys  # noqa: E401

import pytest

from bench import decode_breakdown as db  # the project root is on the tests' path (pyproject.toml)

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
X = {"ph": "X"}


def test_graph_replays_families_and_gap() -> None:
    ev = [{**X, "cat": "user_annotation", "name": f"execute_context_0(0)_generation_2(2)", "ts": t, "dur": 50} for t in (0, 1000, 2000)]
    names = [("nvjet_tst_128x8_64x6_2x1_v_bz_splitK_TNT", 7), "topkGatingSoftmax", "fused_moe_kernel", ("nvjet_tst_64x8", 9),
             "_causal_conv1d_update_kernel", "fused_recurrent_gated_delta_rule_packed_decode_kernel", "layer_norm_gated_fwd_kernel",
             "kernel_unified_attention", ("nvjet_tst_lm_head", 7), "_gumbel_sample_kernel"]
    ev += [{**X, "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": t, "dur": 5, "args": {"correlation": c}} for t, c in ((10, 1), (1010, 2))]
    for i, n in enumerate(names):  # step 1 replays one graph; step 2's graph shows no kernels
        name, stream = n if isinstance(n, tuple) else (n, 7)
        ev.append({**X, "cat": "kernel", "name": name, "ts": 100 + 50 * i, "dur": 40, "args": {"correlation": 1, "stream": stream}})
    r = db.analyse({"traceEvents": ev}, 2)
    fam = r["families_ms_per_step"]
    assert r["decode_steps"] == 2 and r["kernels_in_graphs_per_step"] == 5.0 and r["graphs_hide_kernels"]
    assert fam["moe_router"] == fam["lm_head_sampler"] == 0.04 and fam["dense_proj"] == 0.0  # GEMM + its neighbour
    assert {fam[f] for f in ("shared_expert", "expert_gemm", "gdn_conv", "gdn_recurrent", "glue", "attention")} == {0.02}
    assert r["wall_ms_per_step"]["mean"] == 1.0 and r["host_gap_ms_per_step"] == 0.8
    with pytest.raises(db.BadTrace, match="no decode step of 16 streams"):
        db.analyse({"traceEvents": ev}, 16)


def test_floors_and_bad_options() -> None:
    bf16, awq = (db.floors(db.model_config(m), 16, 2048, 2, 2) for m in ("qwen36-35b-a3b-slice8", "qwen36-35b-a3b-slice8-awq"))
    one = db.floors(db.model_config("qwen36-35b-a3b-slice8"), 1, 2048, 2, 2)
    assert one["expert_gemm"] == 8 * 8 * 3 * 2048 * 512 * 2 and 3.5 < bf16["expert_gemm"] / awq["expert_gemm"] < 4
    assert bf16["attention"] == 2 * 16 * 2048 * 2 * 2 * 256 * 2 and awq["moe_router"] == bf16["moe_router"]  # gate stays bf16
    for argv, said in ((["--streams", "0,16"], "--streams '0,16': expected comma-separated integers >= 1"),
                       (["--steps", "x"], "--steps 'x': expected an integer >= 2"), (["--graphs", "maybe"], "expected on or off"),
                       (["--model", "nope"], "--model 'nope': expected a model directory"),
                       (["--boot-only", "--url", "http://127.0.0.1:8011", "--trace-dir", "/tmp"],
                        "--boot-only 'http://127.0.0.1:8011': expected no --url")):
        with pytest.raises(SystemExit) as e:
            db.parse_args(argv)
        assert said in str(e.value)


def test_profiled_round_again_when_no_step_has_every_stream(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """The server is stood in (no HTTP here): the first trace has the two streams apart, the second together."""
    def trace(gens: list[int]) -> dict:
        return {"traceEvents": [{**X, "cat": "user_annotation", "name": f"execute_context_0(0)_generation_{g}({g})",
                                 "ts": 1000 * i, "dur": 50} for i, g in enumerate(gens)]}
    traces, asked = [trace([1, 1, 1, 1]), trace([2, 2, 2, 2])], []
    monkeypatch.setattr(db, "served_model", lambda url: "m")
    monkeypatch.setattr(db, "post", lambda *a, **k: None)
    monkeypatch.setattr(db, "run_round", lambda port, model, n, ctx, mt, tag: asked.append(mt) or [])
    monkeypatch.setattr(db, "new_trace", lambda d, prefix, w: prefix)
    monkeypatch.setattr(db, "load_trace", lambda p: traces.pop(0))
    r = db.measure("http://127.0.0.1:1", "/t", 2, 6, 16, 2048)
    assert asked == [7, 7, 14] and r["profiled_rounds"] == 2 and r["decode_steps"] == 3
    assert "profiled round 1 of 3 had no step with all 2 decoding" in capsys.readouterr().err
    traces[:], asked[:] = [trace([2, 2, 1, 1]), trace([2, 2, 2, 2, 2])], []  # 2 full steps of the 3 needed, then 4
    r = db.measure("http://127.0.0.1:1", "/t", 2, 6, 16, 2048)
    assert asked == [7, 7, 14] and r["profiled_rounds"] == 2 and r["decode_steps"] == 4
    assert "profiled round 1 of 3 had 2 step(s) with all 2 decoding, fewer than 3" in capsys.readouterr().err
    traces[:] = [trace([1, 1])] * 3
    with pytest.raises(db.NoFullStep, match="3 profiled rounds, the last with max_tokens 28"):
        db.measure("http://127.0.0.1:1", "/t", 2, 6, 16, 2048)


@pytest.mark.engine
def test_cpu_serve_trace_end_to_end(tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = {**os.environ, "STACK_STATE_DIR": str(tmp_path / "state"), "OUT": str(tmp_path)}
    p = subprocess.run([sys.executable, os.path.join(BENCH, "decode_breakdown.py"), "--model", "tiny", "--streams", "1,2",
                        "--steps", "6", "--context", "16", "--mnbt", "2048", "--port", "8137", "--serve-extra=--enforce-eager",
                        "--boot-extra=--max-num-seqs 8 --mem 0.3"], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.load(open(tmp_path / "decode-breakdown-tiny-overlay-graphson.json"))["by_streams"]
    assert r["1"]["kernel_source"].startswith("CPU operators") and r["2"]["decode_steps"] >= 3
    top = {f: {k["name"] for k in ks} for f, ks in r["1"]["top_kernels"].items()}
    assert "vllm::cpu_gdn_attention_core" in top["gdn_recurrent"] and "_C::cpu_fused_moe" in top["expert_gemm"]
    assert r["1"]["host_gap_ms_per_step"] > 0 and r["1"]["floor_ms"]["expert_gemm"] > 0


def test_side_by_side_script_refuses_bad_settings() -> None:
    """bench/decode_breakdowns.sh: each bad setting is one line naming it, before any server boots."""
    script = os.path.join(BENCH, "decode_breakdowns.sh")
    for env, said in (({"MODELS": "nope"}, "MODELS 'nope': expected names of bench/models/*.json or tiny"),
                      ({"CONFIG": "legacy"}, "CONFIG 'legacy': expected stock or overlay"),
                      ({"KV_BYTES": "2GiB"}, "KV_BYTES '2GiB': expected bytes (a whole number) or empty"),
                      ({"STAGGER": "-1"}, "STAGGER '-1': expected whole seconds >= 0")):
        p = subprocess.run(["bash", script, "/nonexistent/out"], env={**os.environ, **env}, capture_output=True, text=True)
        assert p.returncode == 2 and p.stderr.strip() == f"decode_breakdowns: {said}", p.stderr
        assert not os.path.exists("/nonexistent/out")
