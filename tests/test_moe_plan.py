"""The fused-MoE device runs (bench/moe_queue.json) on the CPU: bench.py's new
arguments and mixes, bench/devqueue.py across device-call-like invocations (the runner goes on between
them, a died runner's job runs once more, packs and unpack), bench/moe_merge.py and the BENCHMARKS
sections it feeds, and every command of the plan; then the plan's own job file with its commands turned
to the tiny model on the CPU build (engine-marked).

What cannot run here: the CUDA kernel timing of tune-moe (no CUDA: the job exits 2 as it would on a
machine without a GPU, and a stand-in for the timing writes the configs, as in tests/test_tune_moe.py)
and GPU kernels in the profiler's trace (the breakdown says "no GPU kernel events")."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tarfile

import pytest

from conftest import clean_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
sys.path.insert(0, BENCH)
import bench as benchpy  # noqa: E402
import devqueue  # noqa: E402
import make_table  # noqa: E402
import moe_merge  # noqa: E402

sys.path.remove(BENCH)

JOBS = os.path.join(BENCH, "moe_queue.json")


def bench_args(argv: list[str]):  # type: ignore[no-untyped-def]
    """bench.py's own parser and checks (its main() builds them; the same code path, no child)."""
    old = sys.argv
    sys.argv = ["bench.py", *argv, "--child", "x"]  # --child: no directory check, no run
    try:
        ns: dict = {}
        real_child = benchpy.child
        benchpy.child = lambda out, args: ns.update(args=args)  # type: ignore[assignment]
        try:
            benchpy.main()
        finally:
            benchpy.child = real_child  # type: ignore[assignment]
        return ns["args"]
    finally:
        sys.argv = old


# ---- bench.py ----------------------------------------------------------------------------------------


def test_the_mixes_are_the_reference_shapes() -> None:
    """The two mixes stock vLLM measured 1.46 x and 1.16 x on (mnbt 8192 over 4096, 2026-11-30):
    12 x 3000 + 8 x 64 with 16 out, 2000..3400 (8) + 16 x 64 with 64 out; TTFT of the long prompts."""
    lens, outs, long = benchpy.WORKLOADS["prefill-heavy"]
    assert lens == [3000] * 12 + [64] * 8 and outs == [16] * 20 and long == 12
    lens, outs, long = benchpy.WORKLOADS["mixed-long"]
    assert lens == [2000, 2200, 2400, 2600, 2800, 3000, 3200, 3400] + [64] * 16 and outs == [64] * 24 and long == 8
    assert benchpy.WORKLOADS["band-mix"][2] == 3 and benchpy.WORKLOADS["decode-1"][2] == 0


def test_bench_arguments_and_names() -> None:
    a = bench_args(["--config", "overlay", "--moe-config-dir", "/tmp/m", "--breakdown", "1,16", "--tag", "20261202"])
    assert a.breakdown == [1, 16] and a.moe_config_dir == "/tmp/m" and a.breakdown_steps == 30
    assert benchpy.result_name(a) == "bench-qwen36-35b-a3b-geometry-overlay-mnbt8192-moetuned-20261202"
    s = bench_args(["--config", "stock", "--mnbt", "4096", "--tag", "20261202"])
    assert benchpy.result_name(s) == "bench-qwen36-35b-a3b-geometry-stock-mnbt4096-20261202" and s.breakdown == []


@pytest.mark.parametrize(("argv", "expected"), [
    (["--workloads", "decode-1,nope"], "--workloads 'decode-1,nope': 'nope' is not one of decode-1, decode-16"),
    (["--breakdown", "1,x"], "--breakdown '1,x': expected comma-separated stream counts in [1, 64]"),
    (["--breakdown", "0"], "--breakdown '0': expected comma-separated stream counts in [1, 64]"),
    (["--breakdown-steps", "0"], "--breakdown-steps 0: expected an integer >= 1"),
    (["--config", "stock", "--moe-config-dir", "/tmp"], "--moe-config-dir with --config stock: the tuned configs are "
                                                        "read by the overlay's moe-configs patch"),
    (["--moe-config-dir", "/no/such/dir"], "--moe-config-dir '/no/such/dir': not a directory"),
])
def test_bench_bad_arguments(argv: list[str], expected: str) -> None:
    p = subprocess.run([sys.executable, os.path.join(BENCH, "bench.py"), *argv], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and expected in p.stderr, p.stderr


# ---- devqueue.py -------------------------------------------------------------------------------------


def write_jobs(path: str, jobs: list[dict], name: str = "t", env: dict | None = None) -> str:  # type: ignore[type-arg]
    with open(path, "w") as f:
        json.dump({"name": name, "env": env or {}, "jobs": jobs}, f)
    return path


def run_queue(jobs: str, deadline: float, out: str, state: str, *extra: str,
              script: str = os.path.join(BENCH, "devqueue.py")) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    env = clean_env(OUT=out, QUEUE_STATE_DIR=state)
    return subprocess.run([sys.executable, script, "run", jobs, "--deadline",
                           str(deadline), "--poll", "0.3", *extra], capture_output=True, text=True, env=env,
                          timeout=deadline + 60)


def test_queue_runs_on_between_calls_and_packs_each_job(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A first call returns while a job runs (NOT DONE, exit 10) and brings back what exists; the runner
    goes on without it; the next call finds the runner and returns when every job has ended. A job
    past its timeout is ended with its process group; its rc is recorded and the next job runs."""
    keep = tmp_path / "kept"
    keep.mkdir()
    (keep / "c.json").write_text("{}")
    jobs = write_jobs(str(tmp_path / "j.json"), [
        {"id": "a", "timeout": 60, "cmd": "echo $FOO $QUEUE_DATE; sleep 4; echo r > $OUT/r.json", "keep": [str(keep)]},
        {"id": "slow", "timeout": 2, "cmd": "sleep 60 & sleep 60"},
        {"id": "c", "timeout": 60, "cmd": "pwd > $OUT/pwd.txt; exit 3"}], env={"FOO": "bar"})
    state = str(tmp_path / "state")
    first = run_queue(jobs, 2, str(tmp_path / "o1"), state)
    assert first.returncode == 10 and "NOT DONE: run the same command again in the next call" in first.stdout
    assert sorted(os.listdir(tmp_path / "o1")) == ["a.tgz", "queue-t.json"]  # a: running, packed as it is
    # the next call comes from another copy of the checkout: the jobs started after it run there
    tree = tmp_path / "tree"
    (tree / "bench").mkdir(parents=True)
    (tree / "bench" / "devqueue.py").write_text(open(os.path.join(BENCH, "devqueue.py")).read())
    second = run_queue(jobs, 60, str(tmp_path / "o2"), state, script=str(tree / "bench" / "devqueue.py"))
    assert second.returncode == 0, second.stdout + second.stderr
    assert "the runner is running" in second.stdout and "t: all ended" in second.stdout
    assert (tmp_path / "state" / "t" / "c" / "pwd.txt").read_text().strip() == str(tree)
    st = json.load(open(tmp_path / "o2" / "queue-t.json"))["status"]
    assert (st["a"]["state"], st["a"]["rc"]) == ("done", 0)
    assert (st["slow"]["state"], st["slow"]["rc"]) == ("timeout", "timeout") and st["slow"]["wall_s"] < 25
    assert (st["c"]["state"], st["c"]["rc"]) == ("done", 3)
    assert sorted(os.listdir(tmp_path / "o2")) == ["a.tgz", "c.tgz", "queue-t.json", "slow.tgz"]
    with tarfile.open(tmp_path / "o2" / "a.tgz") as tar:
        names = set(tar.getnames())
        log = tar.extractfile("out/job.log").read().decode()  # type: ignore[union-attr]
    assert {"out/r.json", "out/job.log", "pack.json", f"keep{keep}/c.json"} <= names
    assert re.search(r"^bar 20\d{6}$", log, re.M)
    # here: each job's newest pack (o2 over o1), extracted per job
    dest = tmp_path / "un"
    p = subprocess.run([sys.executable, os.path.join(BENCH, "devqueue.py"), "unpack", str(tmp_path / "o1"),
                        str(tmp_path / "o2"), "--into", str(dest)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert sorted(os.listdir(dest)) == ["a", "c", "slow"]
    assert json.load(open(dest / "a" / "pack.json"))["status"]["state"] == "done"
    assert (dest / "a" / "keep" / str(keep).lstrip("/") / "c.json").exists()


def test_a_job_whose_runner_died_runs_once_more(tmp_path) -> None:  # type: ignore[no-untyped-def]
    jobs = write_jobs(str(tmp_path / "j.json"), [{"id": "a", "timeout": 60, "cmd": "echo attempt; sleep 4; echo ok"}])
    state = str(tmp_path / "state")
    assert run_queue(jobs, 2, str(tmp_path / "o1"), state).returncode == 10
    runner = json.load(open(tmp_path / "state" / "t" / "runner.json"))["pid"]
    job = json.load(open(tmp_path / "state" / "t" / "status.json"))["a"]["pid"]
    os.kill(runner, 9)
    os.killpg(job, 9)
    p = run_queue(jobs, 30, str(tmp_path / "o2"), state)
    assert p.returncode == 0 and "a was interrupted (its runner is gone); it runs again" in p.stdout, p.stdout
    st = json.load(open(tmp_path / "o2" / "queue-t.json"))["status"]["a"]
    assert st["state"] == "done" and st["attempts"] == 2
    # the tag date stays the one the queue started with
    assert json.load(open(tmp_path / "o2" / "queue-t.json"))["runner"]["date"] == json.load(
        open(tmp_path / "o1" / "queue-t.json"))["runner"]["date"]


@pytest.mark.parametrize(("jobs", "expected"), [
    ({"name": "t", "jobs": []}, 'expected {"name": ..., "jobs"'),
    ({"name": "a b", "jobs": [{"id": "x", "timeout": 1, "cmd": "true"}]}, "name 'a b': expected letters"),
    ({"name": "t", "jobs": [{"id": "x", "timeout": 0, "cmd": "true"}]}, "jobs[0] (x): timeout 0: expected whole seconds"),
    ({"name": "t", "jobs": [{"id": "x", "timeout": 1, "cmd": "true"}, {"id": "x", "timeout": 1, "cmd": "true"}]},
     "jobs[1]: id 'x': expected a new name"),
    ({"name": "t", "jobs": [{"id": "x", "timeout": 1, "cmd": " "}]}, "jobs[0] (x): cmd ' ': expected a bash command"),
    ({"name": "t", "jobs": [{"id": "x", "timeout": 1, "cmd": "true", "keep": ["rel"]}]}, "keep ['rel']: expected a list"),
    ({"name": "t", "jobs": [{"id": f"j{i}", "timeout": 1, "cmd": "true"} for i in range(8)]}, "8 jobs: expected at most 7"),
])
def test_bad_job_files_are_named(tmp_path, jobs: dict, expected: str) -> None:  # type: ignore[no-untyped-def,type-arg]
    path = tmp_path / "j.json"
    path.write_text(json.dumps(jobs))
    p = run_queue(str(path), 1, str(tmp_path / "o"), str(tmp_path / "s"))
    assert p.returncode == 2 and expected in p.stderr, p.stderr
    with pytest.raises(devqueue.JobsError, match=r"--only 'nope': expected job ids from .*: tune-decode"):
        devqueue.load_jobs(JOBS, "nope")


# ---- the plan's job file and calls ---------------------------------------------------------------------


def test_the_job_file_runs_as_written() -> None:
    """Every job of bench/moe_queue.json parses with the real parsers: bench.py's (and its checks),
    tune-moe's; the tuned configs go where the overlay boot reads them; results of one queue share a tag."""
    from vllm_overlay.cli import tune_moe
    from vllm_overlay.cli.main import build_parser

    q = devqueue.load_jobs(JOBS)
    assert [j["id"] for j in q["jobs"]] == ["tune-decode", "overlay-tuned", "stock-8192", "stock-4096",
                                            "overlay-default", "tune-all"]
    assert q["env"]["TRITON_CACHE_AUTOTUNING"] == "1"
    seen_bench = {}
    for job in q["jobs"]:
        for part in job["cmd"].split("; "):
            for piece in part.split(" && "):
                argv = shlex.split(piece.replace("$QUEUE_DATE", "20261202").replace("$OUT", "/tmp/o"))
                if argv[:2] == ["python3", "bench/bench.py"]:
                    a = bench_args(argv[2:])
                    assert a.out == "/tmp/o" and a.tag == "20261202" and a.timeout < job["timeout"]
                    seen_bench[job["id"]] = a
                elif argv[:3] == ["python3", "-m", "vllm_overlay"]:
                    opts = tune_moe.options(build_parser().parse_args(argv[3:]))
                    assert opts.out_dir == "/tmp/moe-configs" and opts.time_limit < job["timeout"] - 30
                    assert job["keep"] == ["/tmp/moe-configs"]
    tuned = seen_bench["overlay-tuned"]
    assert tuned.moe_config_dir == "/tmp/moe-configs" and tuned.breakdown == [1, 16]
    assert benchpy.result_name(tuned).replace("-overlay-", "-stock-").replace("-moetuned", "") == \
        benchpy.result_name(seen_bench["stock-8192"])  # make_table pairs them
    assert set(tuned.workloads.split(",")) == set(benchpy.WORKLOADS)
    low = seen_bench["stock-4096"]
    assert low.mnbt == 4096 and {"prefill-heavy", "mixed-long"} <= set(low.workloads.split(","))
    assert not seen_bench["overlay-default"].moe_config_dir and seen_bench["overlay-default"].mnbt == 8192


# ---- merge and the BENCHMARKS sections ---------------------------------------------------------------


def stat(x: float) -> dict:  # type: ignore[type-arg]
    return {"median": x, "min": x * 0.98, "max": x * 1.02, "n": 3}


def bench_result(config: str, mnbt: int, tuned: bool, tps: dict, breakdown: bool = False) -> dict:  # type: ignore[type-arg]
    w = {name: {"tokens_per_s": stat(v), "seconds": stat(100 / v)} for name, v in tps.items()}
    for name in w:
        if name.startswith("decode"):
            w[name]["ms_per_token_per_stream"] = stat(1000 / tps[name])
        if name in ("band-mix", "prefill-heavy", "mixed-long"):
            w[name]["ttft_long_prompts_s"] = {"p50": 0.2, "p99": 0.3, "n": 9}
    r = {"config": config, "mnbt": mnbt, "model": "qwen36-35b-a3b-geometry", "kv_cache_dtype": "auto",
         "profile_run_cap": 0, "ok": True, "workloads": w, "boot_s": 200, "settings": {"tensor_parallel_size": 1},
         "environment": {"gpu": "NVIDIA H200", "date": "2026-12-02 10:00:00 UTC"},
         "reports": {"processes": [], "moe_configs": {"E=256,N=512,dtype=bf16/fp16,device=NVIDIA_H200":
                                                      "/tmp/moe-configs/E=256,N=512,device_name=NVIDIA_H200.json"
                                                      if tuned else "vLLM default"} if config == "overlay" else {}}}
    if tuned:
        r["moe_config_dir"] = {"path": "/tmp/moe-configs", "files": ["E=256,N=512,device_name=NVIDIA_H200.json"]}
    if breakdown:
        fam = {"fused MoE": {"ms_per_step": 0.9, "share_of_wall": 0.2, "kernels_per_step": 240.0, "top": []},
               "GDN (linear attention)": {"ms_per_step": 1.5, "share_of_wall": 0.33, "kernels_per_step": 300.0, "top": []},
               "gaps (wall minus GPU busy)": {"ms_per_step": 0.5, "share_of_wall": 0.11}}
        one = {"steps": 30, "wall_ms_per_step": 4.5, "gpu_busy_ms_per_step": 4.0, "kernel_events": 30000,
               "cuda_graph_launches": 30, "families": fam, "wall_ms_per_step_under_profiler": 4.9}
        r["breakdown"] = {"steps": 30, "by_streams": {"1": one, "16": {"skipped": "not measured: the run's --timeout was near"}}}
    return r


def test_merge_and_the_page(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Unpacked job folders -> bench/results files (bench JSON, log, reports; the tune summary from the
    kept state; --ship copies the tuned files into the package folder); the page shows the overlay
    against stock on every workload, the trade on the two mixes against its targets, the breakdown
    and the tune table."""
    from vllm_overlay.output import Out
    from vllm_overlay.tune import run as tunerun
    from vllm_overlay.tune.space import Shape

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_tune_moe import FakeGPU  # the stand-in for the CUDA kernel timing

    dest = tmp_path / "runs"
    names = {"overlay-tuned": ("overlay", 8192, True), "stock-8192": ("stock", 8192, False),
             "stock-4096": ("stock", 4096, False)}
    tps = {8192: {"decode-1": 230.0, "decode-16": 1500.0, "prefill-8k": 6.0, "band-mix": 980.0,
                  "prefill-heavy": 400.0, "mixed-long": 700.0},
           4096: {"decode-1": 225.0, "band-mix": 930.0, "prefill-heavy": 270.0, "mixed-long": 600.0}}
    for job, (config, mnbt, tuned) in names.items():
        out = dest / job / "out"
        out.mkdir(parents=True)
        name = f"bench-qwen36-35b-a3b-geometry-{config}-mnbt{mnbt}{'-moetuned' if tuned else ''}-20261202"
        (out / f"{name}.json").write_text(json.dumps(bench_result(config, mnbt, tuned, tps[mnbt], tuned)))
        (out / f"{name}.log").write_text("log")
        (out / f"reports-{name}").mkdir()
        (out / f"reports-{name}" / "overlay-1.json").write_text("{}")
        (dest / job / "pack.json").write_text(json.dumps({"job": job, "packed": 1.0, "packed_utc": "2026-12-02T10:00:00Z",
                                                          "status": {"state": "done", "rc": 0}}))
    failed = dest / "overlay-default"
    (failed / "out").mkdir(parents=True)
    (failed / "out" / "job.log").write_text("Traceback: boom")
    (failed / "pack.json").write_text(json.dumps({"job": "overlay-default", "packed": 1.0,
                                                  "packed_utc": "2026-12-02T10:00:00Z",
                                                  "status": {"state": "done", "rc": 1}}))
    for job, packed in (("tune-decode", 1.0), ("tune-all", 2.0)):
        kept = dest / job / "keep" / "tmp" / "moe-configs"
        kept.mkdir(parents=True)
        (dest / job / "out").mkdir()
        (dest / job / "out" / "job.log").write_text(f"{job} log")
        (dest / job / "pack.json").write_text(json.dumps({"job": job, "packed": packed, "packed_utc": "x",
                                                          "status": {"state": "done", "rc": 3}}))
        sizes = [1, 16] if job == "tune-decode" else [1, 2, 16]
        tunerun.execute(tunerun.Options(shapes=[Shape(256, 512, 2048, 8, "bf16")], batch_sizes=sizes,
                                        out_dir=str(kept)), FakeGPU().backend(), Out(force_plain=True))
    results = tmp_path / "results"
    ship = tmp_path / "ship"
    real_ship = moe_merge.SHIP
    moe_merge.SHIP = str(ship)
    try:
        assert moe_merge.main([str(dest), "--results", str(results), "--ship"]) == 0
    finally:
        moe_merge.SHIP = real_ship
    files = sorted(os.listdir(results))
    assert "bench-qwen36-35b-a3b-geometry-overlay-mnbt8192-moetuned-20261202.json" in files
    (tune,) = [f for f in files if f.startswith("tune-moe-")]
    assert re.fullmatch(r"tune-moe-NVIDIA_H200-\d{8}\.json", tune)
    logs = sorted(os.listdir(results / "logs"))
    assert "reports-bench-qwen36-35b-a3b-geometry-stock-mnbt4096-20261202" in logs
    assert any(f.startswith("queue-overlay-default-") for f in logs)  # the failed job's log is kept
    assert sum(f.startswith("tune-moe-NVIDIA_H200-") for f in logs) == 2
    t = json.load(open(results / tune))
    rec = t["shapes"]["E=256,N=512,dtype=bf16"]
    assert rec["tuned"] == [1, 2, 16] and 8192 in rec["file_batch_sizes"]  # the newest pack: tune-all's
    assert os.listdir(ship) == ["E=256,N=512,device_name=NVIDIA_H200.json"]

    benches = []
    for f in files:
        if f.startswith("bench-"):
            benches.append(json.load(open(results / f)) | {"_file": f"bench/results/{f}", "_path": str(results / f)})
    text = "\n".join(make_table.overlay_vs_stock(benches) + make_table.breakdown_section(benches)
                     + make_table.tune_section([str(results / tune)]))
    assert "overlay (bench/results/bench-qwen36-35b-a3b-geometry-overlay-mnbt8192-moetuned-20261202.json) vs stock " \
           "(bench/results/bench-qwen36-35b-a3b-geometry-stock-mnbt8192-20261202.json)" in text
    assert "| prefill-heavy (tok/s) | 400.000" in text and "| mixed-long (tok/s) |" in text
    assert "stock at mnbt 4096 (bench/results/bench-qwen36-35b-a3b-geometry-stock-mnbt4096-20261202.json)" in text
    assert "| prefill-heavy: 12 prompts of 3000 tokens with 8 of 64, 16 out each | 400.0 (392.0-408.0) | 0.200/0.300 | " \
           "270.0 (264.6-275.4) | 0.200/0.300 | **1.481 x** | 1.481 x | >= 1.40 x: met |" in text
    assert "**1.167 x** | 1.167 x | >= 1.12 x: met |" in text
    assert "| fused MoE | 0.900 (20 %) | - |" in text and "16 stream(s): not measured: the run's --timeout" in text
    assert "E=256,N=512,dtype=bf16/fp16,device=NVIDIA_H200: /tmp/moe-configs/E=256,N=512,device_name=NVIDIA_H200.json" \
        in text
    assert "| E=256,N=512,dtype=bf16 | 16 |" in text and "not tuned: the file holds vLLM's own config" in text


def test_the_configs_lever_is_the_tuned_overlay_against_the_plain_one() -> None:
    tuned = bench_result("overlay", 8192, True, {"decode-1": 250.0, "decode-16": 1600.0})
    plain = bench_result("overlay", 8192, False, {"decode-1": 230.0, "decode-16": 1500.0})
    stock = bench_result("stock", 8192, False, {"decode-1": 225.0, "decode-16": 1490.0})
    for r, name in ((tuned, "overlay-mnbt8192-moetuned-20261202"), (plain, "overlay-mnbt8192-20261202"),
                    (stock, "stock-mnbt8192-20261202")):
        r["_file"] = f"bench/results/bench-qwen36-35b-a3b-geometry-{name}.json"
    text = "\n".join(make_table.overlay_vs_stock([plain, tuned, stock]))
    assert text.count("vs stock (bench/results/bench-qwen36-35b-a3b-geometry-stock-mnbt8192-20261202.json)") == 2
    assert "the overlay with them against the overlay without them (bench/results/bench-qwen36-35b-a3b-geometry-" \
           "overlay-mnbt8192-20261202.json)" in text
    assert "| decode-1 (ms/token) | 4.000 (3.920-4.080) | 4.348 (4.261-4.435) | 0.920 |" in text


# ---- the job file on the CPU build (engine) ---------------------------------------------------------


def cpu_jobs(path: str, moe_dir: str) -> str:
    """bench/moe_queue.json with its commands turned to the tiny model on the CPU build: this
    interpreter, mnbt 2048 / 1024, one rep of one mix, a short breakdown, the tuned folder in tmp."""
    q = json.load(open(JOBS))
    for job in q["jobs"]:
        cmd = job["cmd"].replace("python3 ", f"{sys.executable} ").replace("/tmp/moe-configs", moe_dir)
        cmd = cmd.replace("--model qwen36-35b-a3b-geometry", "--model tiny --mem 0.3 --reps 1")
        cmd = cmd.replace("--mnbt 8192", "--mnbt 2048").replace("--mnbt 4096", "--mnbt 1024")
        cmd = re.sub(r"--workloads \S+", "--workloads mixed-long", cmd)
        cmd = cmd.replace("--breakdown 1,16", "--breakdown 1,4 --breakdown-steps 5")
        job["cmd"] = cmd
        job["keep"] = [moe_dir if k == "/tmp/moe-configs" else k for k in job.get("keep", [])]
    with open(path, "w") as f:
        json.dump(q, f)
    return path


@pytest.mark.engine
def test_the_job_file_on_the_cpu_build(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The plan's queue, its commands turned to the tiny model: a first call returns during the first
    boot (NOT DONE), the next one runs every job to its end; tune-moe exits 2 (no CUDA) and the queue
    goes on; unpack, merge and the page's trade table work on what came back."""
    from vllm_overlay.output import Out
    from vllm_overlay.tune import run as tunerun
    from vllm_overlay.tune.space import Shape

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_tune_moe import FakeGPU  # the stand-in for the CUDA kernel timing

    moe = str(tmp_path / "moe-configs")
    # what tune-moe would have written on the GPU (the CPU cannot time the kernel)
    tunerun.execute(tunerun.Options(shapes=[Shape(256, 512, 2048, 8, "bf16")], batch_sizes=[1, 16], out_dir=moe),
                    FakeGPU().backend(), Out(force_plain=True))
    jobs = cpu_jobs(str(tmp_path / "jobs.json"), moe)
    state = str(tmp_path / "state")
    env = clean_env(QUEUE_STATE_DIR=state, PYTHONPATH=os.path.join(ROOT, "src"))
    cmd = [sys.executable, os.path.join(BENCH, "devqueue.py"), "run", jobs, "--poll", "2"]
    first = subprocess.run([*cmd, "--deadline", "25"], env={**env, "OUT": str(tmp_path / "o1")},
                           capture_output=True, text=True, timeout=200)
    assert first.returncode == 10, first.stdout[-3000:] + first.stderr[-2000:]
    second = subprocess.run([*cmd, "--deadline", "900"], env={**env, "OUT": str(tmp_path / "o2")},
                            capture_output=True, text=True, timeout=1000)
    log = second.stdout[-6000:] + second.stderr[-2000:]
    assert second.returncode == 0 and "moe: all ended" in second.stdout, log
    st = json.load(open(tmp_path / "o2" / "queue-moe.json"))["status"]
    assert st["tune-decode"]["rc"] == 2 and st["tune-all"]["rc"] == 2  # no CUDA here: one clear line, exit 2
    assert all(st[j]["rc"] == 0 for j in ("overlay-tuned", "stock-8192", "stock-4096", "overlay-default")), st
    dest = tmp_path / "runs"
    subprocess.run([sys.executable, os.path.join(BENCH, "devqueue.py"), "unpack", str(tmp_path / "o1"),
                    str(tmp_path / "o2"), "--into", str(dest)], check=True, capture_output=True, timeout=60)
    assert "tune-moe needs a CUDA GPU" in (dest / "tune-decode" / "out" / "job.log").read_text()
    results = tmp_path / "results"
    assert moe_merge.main([str(dest), "--results", str(results)]) == 0
    benches = []
    for f in sorted(os.listdir(results)):
        if f.startswith("bench-"):
            r = json.load(open(results / f))
            assert r["ok"], (f, r.get("failure"), r.get("log_tail", "")[-2000:])
            benches.append(r | {"_file": f"bench/results/{f}", "_path": str(results / f)})
    assert len(benches) == 4
    tuned = next(r for r in benches if r.get("moe_config_dir"))
    assert tuned["moe_config_dir"]["files"] == ["E=256,N=512,device_name=NVIDIA_H200.json"]
    assert set(tuned["breakdown"]["by_streams"]) == {"1", "4"}  # no CUDA: "no GPU kernel events", said
    assert "no GPU kernel events" in tuned["breakdown"]["by_streams"]["1"]["problem"]
    text = "\n".join(make_table.overlay_vs_stock(benches))
    assert "| mixed-long: 8 prompts of 2000-3400 tokens with 16 of 64, 64 out each |" in text, text
    assert len(re.findall(r"^#### `tiny`, mnbt 2048", text, re.M)) == 2  # the tuned and the default overlay
    assert t_result(results)["shapes"]["E=256,N=512,dtype=bf16"]["tuned"] == [1, 16]


def t_result(results) -> dict:  # type: ignore[no-untyped-def,type-arg]
    (tune,) = [f for f in os.listdir(results) if f.startswith("tune-moe-")]
    return json.load(open(results / tune))
