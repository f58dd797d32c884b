"""rank-reports: every worker rank's report reaches the engine core through vLLM's executor, so the
/metrics collector and `vllm-overlay report` see each rank even where no directory is shared.

vLLM's Ray executors cannot run on its CPU build: vLLM 0.32.0's CpuPlatform has no
``ray_device_key``, and both ``RayExecutorV2`` and ``RayDistributedExecutor`` stop in
``initialize_ray_cluster`` with "current platform cpu does not support ray." (seen 2026-12-02, TP 1
and 2). So the engine tests here run the nearest configuration the CPU build supports: tensor
parallel 2 on the multiprocessing executor, whose ``collective_rpc`` is the same executor interface
the Ray executors implement, with each worker writing into a folder of its own
(tests/rank_dirs/sitecustomize.py: as on hosts of their own). What is Ray's own is run on a real
local Ray cluster without vLLM's executor (TestRay): the probe shipped by Ray's serialiser to an
actor, the server id a Ray worker inherits, and a worker without the overlay (hidden from the
actor's imports: the one thing simulated, as a host where it is not installed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import clean_env
from test_tensor_parallel import BIND, BUG_STEP, tp2_model  # noqa: F401 - the shared TP-2 model fixture
from vllm_overlay import metrics
from vllm_overlay.reports import dedupe, expand, missing_ranks, problem, scan
from vllm_overlay.telemetry import merge_sizes

HERE = os.path.dirname(os.path.abspath(__file__))
APART = os.path.join(HERE, "rank_dirs")


def apart_env(**extra: str) -> dict[str, str]:
    """The shim on PYTHONPATH: each worker's report goes into REPORT_DIR/rank-N."""
    path = os.pathsep.join(p for p in (APART, os.environ.get("PYTHONPATH", "")) if p)
    return {**BIND, "PYTHONPATH": path, **extra}


def workers(reports: list[dict]) -> list[dict]:
    return sorted((r for r in reports if "worker" in r["role"]), key=lambda r: r["tp_rank"])


@pytest.fixture(scope="module")
def apart(scenarios, tp2_model):  # type: ignore[no-untyped-def]
    return scenarios.run("eager-overlay-tp2-apart", ["--shape", "bug", "--tp", "2", "--model", tp2_model],
                         apart_env())


@pytest.fixture(scope="module")
def rank1_bare(scenarios, tp2_model):  # type: ignore[no-untyped-def]
    """Rank 1 without the plugin. memory-headroom is off: with it on, rank 0 runs its measuring
    forwards (tensor-parallel collectives) that the bare rank 1 never joins, and the engine hangs at
    start-up (seen 2026-12-02, this TP-2 engine: no step for 10 minutes). A rank without the overlay
    is a deployment error (docs/multi-host.md); what this proves is that it is named."""
    return scenarios.run("eager-overlay-tp2-rank1-bare", ["--shape", "short", "--tp", "2", "--model", tp2_model],
                         apart_env(OVERLAY_TEST_NO_PLUGIN_RANK="1", VLLM_OVERLAY_MEMORY_HEADROOM="0"),
                         timeout=300)


def families(directory: str, server: str | None) -> dict[str, list]:
    out: dict[str, list] = {}
    for fam in metrics.OverlayCollector(directory, server).collect():
        out[fam.name] = [(s.name, s.labels, s.value) for s in fam.samples]
    return out


@pytest.mark.engine
def test_each_rank_reaches_the_reports_through_the_engine_core(apart) -> None:  # type: ignore[no-untyped-def]
    assert apart["ok"], apart.get("traceback") or apart["log"][-3000:]
    base = apart["report_dir"]
    # nothing of a worker in the engine core's folder: each wrote into its own
    for rank in (0, 1):
        own = os.listdir(os.path.join(base, f"rank-{rank}"))
        assert len([f for f in own if f.endswith(".json")]) == 1, own
    tops = [json.load(open(os.path.join(base, f))) for f in os.listdir(base) if f.endswith(".json")]
    assert [t["role"] for t in tops if "worker" in t["role"]] == []
    ws = workers(apart["reports"])  # read from the engine core's folder only
    assert [(w["role"], w["tp_rank"]) for w in ws] == [("worker rank 0", 0), ("worker rank 1", 1)]
    for w in ws:
        assert all(w["patches"][p]["status"] == "applied" for p in ("forward-telemetry", "gdn-output-prealloc"))
        assert [b["rows"] for b in w["buffers"]] == [8192]
        assert w["counters"]["guard_checks"] > 0 and w["counters"]["guard_trips"] == 0
        assert w["telemetry"]["forwards"]["sizes"].get(str(BUG_STEP)) == 1, w["telemetry"]["forwards"]
        assert w["patches"]["rank-reports"]["rpc_ranks"] == [w["tp_rank"]]
    assert merge_sizes(apart["reports"]).get(BUG_STEP) == 1  # counted once across ranks
    assert scan(base).missing == []


@pytest.mark.engine
def test_metrics_and_cli_show_every_rank(apart, capsys) -> None:  # type: ignore[no-untyped-def]
    assert apart["ok"], apart.get("traceback")
    base = apart["report_dir"]
    sid = workers(apart["reports"])[0]["server_id"]
    fam = families(base, sid)
    roles = lambda name: sorted({s[1]["role"] for s in fam[name] if "worker" in s[1].get("role", "")})  # noqa: E731
    for name in ("vllm_overlay_guard_checks", "vllm_overlay_guard_trips", "vllm_overlay_gdn_buffer_rows",
                 "vllm_overlay_patch"):
        assert roles(name) == ["worker rank 0", "worker rank 1"], (name, fam[name])
    applied = {(s[1]["role"], s[1]["patch"]) for s in fam["vllm_overlay_patch"] if s[1]["status"] == "applied"}
    assert {("worker rank 1", "gdn-output-prealloc"), ("worker rank 0", "forward-telemetry")} <= applied
    count = [s[2] for s in fam["vllm_overlay_forward_scheduled_tokens"] if s[0].endswith("_count")]
    assert count == [sum(merge_sizes(apart["reports"]).values())]
    assert fam["vllm_overlay_rank_missing"] == []
    from vllm_overlay.tools.cli.main import main

    assert main(["report", base]) == 0
    text = capsys.readouterr().out
    assert "role=worker rank 0" in text and "role=worker rank 1" in text and "MISSING" not in text


@pytest.mark.engine
def test_a_rank_without_the_overlay_is_named_missing(rank1_bare, capsys) -> None:  # type: ignore[no-untyped-def]
    assert rank1_bare["ok"], rank1_bare.get("traceback") or rank1_bare["log"][-3000:]
    base = rank1_bare["report_dir"]
    bare = os.path.join(base, "rank-1")
    assert not os.path.isdir(bare) or not any(f.endswith(".json") for f in os.listdir(bare))
    assert [w["role"] for w in workers(rank1_bare["reports"])] == ["worker rank 0"]
    (m,) = scan(base).missing
    assert m["rank"] == 1 and "did not register in this process" in m["why"], m
    assert "rank-reports: 1 rank(s) of this engine sent no overlay report: rank 1" in rank1_bare["log"]
    sid = workers(rank1_bare["reports"])[0]["server_id"]
    (sample,) = families(base, sid)["vllm_overlay_rank_missing"]
    assert sample[1]["rank"] == "1" and "did not register" in sample[1]["why"]
    from vllm_overlay.tools.cli.main import main

    assert main(["report", base]) == 1
    assert "rank 1 of the engine core pid" in capsys.readouterr().out


@pytest.mark.engine
def test_band_stress_passes_with_rank_dirs_apart(tp2_model, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`vllm-overlay stress --tensor-parallel-size 2`, each worker writing into its own folder: the
    verdict reads every rank from the engine core's report alone."""
    out = tmp_path / "stress"
    r = subprocess.run([os.path.join(os.path.dirname(sys.executable), "vllm-overlay"), "stress", "--model", tp2_model,
                        "--tensor-parallel-size", "2", "--max-model-len", "8192", "--max-num-seqs", "32",
                        "--enforce-eager", "--gpu-memory-utilization", "0.3", "--min-band-forwards", "3",
                        "--out", str(out)], capture_output=True, text=True, timeout=900, env=clean_env(**apart_env()))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.load(open(out / "stress.json"))
    assert res["verdict"] == "PASSED" and res["requests_failed"] == 0 and res["guard_trips"] == 0
    assert sorted(res["worker_roles"]) == ["worker rank 0", "worker rank 1"]
    assert sorted(d for d in os.listdir(out / "reports") if d.startswith("rank-")) == ["rank-0", "rank-1"]
    assert not any("worker" in json.load(open(out / "reports" / f))["role"]
                   for f in os.listdir(out / "reports") if f.endswith(".json"))


# ---- the readers, on reports made by hand -------------------------------------------------------


def _rep(pid: int, role: str, written: float, **kw) -> dict:  # type: ignore[no-untyped-def]
    return {"pid": pid, "instance": f"i{pid}", "host": "h", "role": role, "written": written, **kw}


def test_a_process_read_twice_counts_once_and_the_newer_wins() -> None:
    worker_file = _rep(2, "worker rank 0", 100.0, tp_rank=0, telemetry={"forwards": {"sizes": {"8": 1}}})
    gathered = _rep(2, "worker rank 0", 90.0, tp_rank=0, telemetry={"forwards": {"sizes": {"8": 0}}})
    core = _rep(1, "engine core", 95.0, ranks={"world_size": 2, "stepped_since": True, "reports": [gathered],
                                                "missing": [{"rank": 1, "why": "no answer"}]})
    reps = dedupe([worker_file, *expand(core)])
    assert sorted((r["pid"], r["written"]) for r in reps) == [(1, 95.0), (2, 100.0)]
    assert merge_sizes(reps) == {8: 1}
    assert missing_ranks(reps) == [{"engine_pid": 1, "host": "h", "rank": 1, "why": "no answer"}]


def test_gathered_reports_are_current_while_no_step_ran() -> None:
    core = _rep(1, "engine core", 500.0, ranks={"stepped_since": False, "reports": [_rep(2, "worker rank 0", 10.0)],
                                                 "missing": []})
    assert expand(core)[1]["written"] == 500.0
    core["ranks"]["stepped_since"] = True
    assert expand(core)[1]["written"] == 10.0


def test_a_malformed_gathered_report_is_named() -> None:
    assert problem(_rep(1, "engine core", 1.0, ranks={"reports": [{"pid": "x"}]})) == \
        "a gathered rank report: no integer pid"
    assert problem(_rep(1, "engine core", 1.0, ranks={"reports": {}})) is not None


def test_the_probe_answers_without_the_overlay_registered() -> None:
    from vllm_overlay.patches import rank_reports

    fn = rank_reports.probe()
    assert fn.__module__ == "__main__"  # cloudpickle ships its code, not a reference to our module
    import cloudpickle

    again = cloudpickle.loads(cloudpickle.dumps(fn))
    ans = again(type("Wrapper", (), {"rpc_rank": 3})())
    assert ans["rank"] == 3 and "did not register" in ans["why"]


# ---- Ray's part, on a real local Ray cluster ----------------------------------------------------

try:
    import ray
except ImportError:  # pragma: no cover - scripts/setup.sh installs it
    ray = None


@pytest.fixture(scope="module")
def ray_cluster():  # type: ignore[no-untyped-def]
    if ray is None:
        pytest.skip("RAY IS NOT INSTALLED: the Ray checks of rank-reports did not run "
                    "(pip install -r requirements/test-ray.txt, as scripts/setup.sh does)")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    yield ray
    ray.shutdown()


def _actor_env(tmp_path, **extra: str) -> dict:  # type: ignore[no-untyped-def]
    return {"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", ""),
                         "VLLM_OVERLAY_REPORT_DIR": str(tmp_path / "actor"), **extra}}


def test_ray_worker_keeps_the_server_id_and_answers_the_probe(ray_cluster, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A Ray worker process has no multiprocessing parent, as a program's main process; it must
    keep the id vLLM's Ray executor passes it in the driver's environment, not make its own."""
    from vllm_overlay import server_id
    from vllm_overlay.patches import rank_reports

    sid = server_id.make()  # as the driver's overlay makes it: HOST:PID:TIME:RANDOM of the driver

    @ray.remote
    class Rank:
        def run(self, fn):  # type: ignore[no-untyped-def]
            import vllm_overlay

            vllm_overlay.register()
            return fn(type("RayWorkerWrapper", (), {"rpc_rank": 1})())

    actor = Rank.options(runtime_env=_actor_env(tmp_path, VLLM_OVERLAY_SERVER_ID=sid)).remote()
    ans = ray.get(actor.run.remote(rank_reports.probe()), timeout=120)
    assert ans["rank"] == 1 and ans["report"]["server_id"] == sid, ans.get("why")
    assert ans["report"]["pid"] != os.getpid()
    assert os.listdir(tmp_path / "actor")  # its own file, in its own folder


def test_ray_worker_without_the_overlay_is_named(ray_cluster, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from vllm_overlay.patches import rank_reports

    @ray.remote
    class Bare:
        def run(self, fn):  # type: ignore[no-untyped-def]
            import sys

            sys.modules["vllm_overlay"] = None  # simulated: a host where vllm-overlay is not installed
            return fn(type("RayWorkerWrapper", (), {"rpc_rank": 1})())

    ans = ray.get(Bare.options(runtime_env=_actor_env(tmp_path)).remote().run.remote(rank_reports.probe()),
                  timeout=120)
    assert ans["rank"] == 1 and "vllm_overlay cannot be imported there" in ans["why"], ans
