"""The overlay's series on vLLM's own /metrics: the collector and the text parser on report files
(no engine), the hook on vLLM's registry in this process, and one real API server (CPU build,
tiny model) scraped around two band stress runs: one judged from the report files, one from
/metrics alone."""

from __future__ import annotations

import importlib
import json
import os

import pytest

from vllm_overlay import core, metrics, report_files, server_id
from vllm_overlay.report import STATE
from vllm_overlay.tools.stress import metrics_text
from vllm_overlay.telemetry import in_band, merge_sizes


def report(pid: int, server: str, sizes: dict[int, int], tp_rank: int | None = 0, **extra):  # type: ignore[no-untyped-def]
    rep = {"pid": pid, "server_id": server, "role": f"engine core + worker rank {tp_rank}", "tp_rank": tp_rank,
           "counters": {"guard_checks": sum(sizes.values()), "guard_trips": 0},
           "buffers": [{"key": ["config-7fdda29fb7d0", "cpu", "torch.bfloat16", 4, 64], "rows": 3000, "source": "live", "bytes": 1536000,
                        "layers": 3}],
           "patches": {"forward-telemetry": {"status": "applied"}, "hybrid-turboquant": {"status": "failed"}},
           "engine_config": {"max_num_batched_tokens": 3000, "max_model_len": 8192, "max_num_seqs": 32, "model": "m"},
           "telemetry": {"forwards": {"sizes": {str(k): v for k, v in sizes.items()}}}}
    rep.update(extra)
    return rep


def exposition(directory: str, server: str) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    reg = CollectorRegistry()
    reg.register(metrics.OverlayCollector(str(directory), server))
    return generate_latest(reg).decode()


def write(directory, rep) -> None:  # type: ignore[no-untyped-def]
    os.makedirs(directory, exist_ok=True)
    name = report_files.name(server_id.file_key(rep["server_id"]), rep["pid"], f"{rep['pid']:08x}")
    with open(os.path.join(directory, name), "w") as f:
        json.dump(rep, f)


def test_a_patch_armed_for_worker_modules_outside_a_worker_is_shown_worker_only(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The API server and the engine core hold the worker patches armed for good (they never import the
    runner): /metrics and `report` say worker-only and name the modules; a worker, or a patch waiting
    for a module any process may import, stays armed with what it waits for."""
    from vllm_overlay.reports import shown_status

    runner = ["vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu_worker"]
    patches = {"forward-telemetry": {"status": "armed", "pending_modules": runner},
               "turboquant-spec-decode": {"status": "armed",
                                          "pending_modules": ["vllm.v1.attention.backends.turboquant_attn"]},
               "rank-reports": {"status": "applied", "pending_modules": []}}
    write(tmp_path, report(21, "srv-w", {}, tp_rank=None, role="api server", patches=patches))
    write(tmp_path, report(22, "srv-w", {}, role="worker rank 0", patches=patches))
    text = exposition(tmp_path, "srv-w")
    mods = ",".join(runner)
    assert (f'vllm_overlay_patch_info{{patch="forward-telemetry",pid="21",role="api server",status="worker-only",'
            f'waiting_for="{mods}"}} 1.0') in text
    assert (f'vllm_overlay_patch_info{{patch="forward-telemetry",pid="22",role="worker rank 0",status="armed",'
            f'waiting_for="{mods}"}} 1.0') in text
    assert ('vllm_overlay_patch_info{patch="turboquant-spec-decode",pid="21",role="api server",status="armed",'
            'waiting_for="vllm.v1.attention.backends.turboquant_attn"} 1.0') in text
    assert 'patch="rank-reports",pid="21",role="api server",status="applied",waiting_for=""' in text
    assert shown_status({"role": "engine core + worker rank 0"}, patches["forward-telemetry"]) == "armed"


def test_collector_reads_only_this_servers_reports(tmp_path) -> None:  # type: ignore[no-untyped-def]
    sizes = {1: 3, 1500: 2, 2000: 1, 3000: 4}
    write(tmp_path, report(11, "srv-a", sizes))
    write(tmp_path, report(12, "srv-a", sizes, tp_rank=1))  # the same forwards again: not counted
    write(tmp_path, report(13, "srv-b", {2000: 50}))  # another server sharing the directory
    text = exposition(tmp_path, "srv-a")
    s = metrics_text.parse(text)
    assert s.found and s.count == 10 and s.max_forward == 3000
    # the server's own edges (mnbt 3000, half of it 1500, the buffer rows) are bucket edges
    assert {1500, 3000, 1024, 2048} <= set(s.buckets)
    assert s.band(1500, 3000) == in_band(sizes, 1500, 3000) == 5 and s.band(1024, 2048) == 3
    assert 'vllm_overlay_forward_scheduled_tokens_sum 17003.0' in text
    assert 'vllm_overlay_guard_trips_total{pid="11",role="engine core + worker rank 0"} 0.0' in text
    assert 'vllm_overlay_patch_info{patch="hybrid-turboquant",pid="12",role="engine core + worker rank 1",' \
           'status="failed",waiting_for=""} 1.0' in text
    assert 'vllm_overlay_gdn_buffer_bytes{' in text and s.buffer_rows == [3000, 3000]
    assert 'vllm_overlay_gdn_buffer_rows{device="cpu",dtype="torch.bfloat16",engine="config-7fdda29fb7d0",pid="11",' \
           'role="engine core + worker rank 0",shape="4x64",source="live"} 3000.0' in text
    assert s.engine_config["max_num_batched_tokens"] == 3000 and s.engine_config["server_id"] == "srv-a"
    assert set(s.processes) == {"11", "12"}
    # a file of no server's (an older release's name) is never opened; a changed file is re-read
    (tmp_path / "overlay-14.json").write_text("{")
    write(tmp_path, report(11, "srv-a", {**sizes, 2048: 7}))
    later = metrics_text.parse(exposition(tmp_path, "srv-a"))
    assert later.band(1024, 2048) == 10 and later.sizes_since(s) == {2048: 7}


def test_band_edges_come_from_the_workers_reports_not_this_process_s_environment(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The profile cap and the token budgets a setting requested are bucket edges as the workers
    recorded them (engine_config.profile_run_cap, budgets): the API server's own environment, here
    set to other values, is never read for them."""
    budgets = [{"purpose": "gdn_output", "value": 3000, "requested": 1800, "raised": True, "floor": 3000,
                "source": "floor: the model runner's max_num_tokens",
                "requested_source": "env VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET"},
               {"purpose": "other", "value": 3000, "requested": 3000, "raised": False, "floor": 3000,
                "source": "live scheduler_config.max_num_batched_tokens",
                "requested_source": "live scheduler_config.max_num_batched_tokens"}]
    rep = report(11, "srv-a", {5: 1}, budgets=budgets)
    rep["engine_config"]["profile_run_cap"] = 1000
    write(tmp_path, rep)
    monkeypatch.setenv("VLLM_OVERLAY_PROFILE_RUN_CAP", "777")
    monkeypatch.setenv("VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET", "2345")
    monkeypatch.setenv("VLLM_OVERLAY_GDN_MAX_BATCHED_TOKENS", "901")
    edges = set(metrics_text.parse(exposition(tmp_path, "srv-a")).buckets)
    # the workers' cap and requested budget, and the quarter edges of (1000, 3000] and (1800, 3000]
    assert {1000, 1800, 1500, 2000, 2500, 2100, 2400, 2700} <= edges, sorted(edges)
    assert not {777, 2345, 901} & edges, sorted(edges)
    assert metrics.recorded_edges(rep) == {1000, 1800}


# the settings /metrics may read in the API server: where the reports are, and which are this server's
LOCATING = {"VLLM_OVERLAY_REPORT_DIR", "VLLM_OVERLAY_SERVER_ID"}
SERIES_CODE = ("metrics.py", "reports.py", "telemetry.py", "patches/_gdn_metrics.py", "patches/prometheus_metrics.py")


def environment_reads(path: str) -> list[str]:
    """Every read of a setting or of the environment the file makes: ``settings.value/resolve(NAME)``
    (NAME as written), ``os.environ``, ``os.getenv``."""
    import ast

    out = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value)
            if (owner == "settings" and node.func.attr in ("value", "resolve")) or (owner, node.func.attr) == ("os", "getenv"):
                arg = node.args[0] if node.args else None
                out.append(arg.value if isinstance(arg, ast.Constant) else f"{ast.unparse(node)} (line {node.lineno})")
        elif isinstance(node, ast.Attribute) and ast.unparse(node) == "os.environ":
            out.append(f"os.environ (line {node.lineno})")
    return out


def test_the_series_read_no_setting_of_this_process_but_where_the_reports_are() -> None:
    """Every series is computed from what the workers reported: the code that builds them (the
    collector, the report readers, each patch's families) reads of its own process's environment only
    where the reports are and which server they belong to."""
    src = os.path.dirname(metrics.__file__)
    reads = {name: environment_reads(os.path.join(src, name)) for name in SERIES_CODE}
    assert set(reads["metrics.py"]) == LOCATING  # the check reads what it should
    bad = {name: [r for r in got if r not in LOCATING] for name, got in reads.items()}
    assert not any(bad.values()), bad


def test_each_patch_s_own_families_come_from_its_hook(tmp_path, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """The GDN buffer series are gdn-output-prealloc's, built by the hook its spec declares
    (metric_families); a hook that fails leaves out its patch's series alone, with one WARNING naming
    the patch for that error however often /metrics is scraped."""
    from vllm_overlay.patches import _gdn_metrics, gdn_output_prealloc

    assert [m.SPEC.id for m in metrics.hook_modules("metric_families")] == ["gdn-output-prealloc"]
    rep = report(11, "srv-a", {5: 1})
    assert [f.name for f in gdn_output_prealloc.metric_families([rep])] == [
        "vllm_overlay_gdn_buffer_rows", "vllm_overlay_gdn_buffer_bytes"]
    write(tmp_path, rep)

    def broken(reports):  # type: ignore[no-untyped-def]
        raise KeyError("rows")

    monkeypatch.setattr(_gdn_metrics, "families", broken)
    texts = [exposition(tmp_path, "srv-a") for _ in range(2)]
    assert all("vllm_overlay_gdn_buffer" not in t and "vllm_overlay_patch_info{" in t for t in texts)
    warned = [r.getMessage() for r in caplog.records if "metric_families failed" in r.getMessage()]
    assert warned == ["/metrics: the series of patch gdn-output-prealloc are left out: metric_families "
                      "failed: KeyError: 'rows'"], warned



def test_the_buffers_bucket_edges_come_from_the_patch_s_hook(tmp_path, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """The GDN buffers' rows are edges of the histogram because gdn-output-prealloc says so (its hook
    bucket_edges, declared in its spec): metrics.py reads no `buffers` row itself. A hook that fails
    leaves out its edges alone (the engine limits' and the settings' stay), with one WARNING naming
    the patch for that error however often /metrics is scraped."""
    import ast

    from vllm_overlay.patches import _gdn_metrics, gdn_output_prealloc

    assert [m.SPEC.id for m in metrics.hook_modules("bucket_edges")] == ["gdn-output-prealloc"]
    reports = exposition_reports()
    assert gdn_output_prealloc.bucket_edges(reports) == {3000, 5000, 2600}
    source = open(metrics.__file__).read()
    keys = {n.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert "buffers" not in keys and "rows" not in keys
    for rep in reports:
        write(tmp_path, rep)

    def broken(reports):  # type: ignore[no-untyped-def]
        raise TypeError("rows")

    monkeypatch.setattr(_gdn_metrics, "bucket_edges", broken)
    texts = [exposition(tmp_path, "srv-e") for _ in range(2)]
    for text in texts:
        edges = set(metrics_text.parse(text).buckets)
        assert not {2600, 5000} & edges and {1000, 1500, 1800, 3000} <= edges, sorted(edges)
        assert 'vllm_overlay_gdn_buffer_rows{' in text  # its series stay
    warned = [r.getMessage() for r in caplog.records if "bucket_edges failed" in r.getMessage()]
    assert warned == ["/metrics: the bucket edges of patch gdn-output-prealloc are left out: bucket_edges "
                      "failed: TypeError: rows"], warned

def test_a_malformed_report_is_skipped_and_named_and_the_others_stay(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    write(tmp_path, report(11, "srv-a", {5: 1}, buffers="not a list"))
    write(tmp_path, report(12, "srv-a", {1500: 2}))
    legacy = tmp_path / "overlay-5.json"  # `echo '[]' > D/overlay-5.json`: no server's file, never opened
    legacy.write_text("[]")
    text = exposition(tmp_path, "srv-a")
    s = metrics_text.parse(text)
    assert s.band(1024, 2048) == 2 and set(s.processes) == {"12"}  # the good report's series stay
    bad = report_files.name(server_id.file_key("srv-a"), 11, f"{11:08x}")
    assert f'vllm_overlay_report_skipped_info{{file="{bad}",why="field \'buffers\' is str"}} 1.0' in text
    warned = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(warned) == 1 and bad in warned[0] and "field 'buffers' is str" in warned[0]


def test_each_report_s_age_is_a_series(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """vllm_overlay_report_age_seconds: how long ago each process of this server wrote its report (a
    process that stopped writing shows an age that only grows); a report without `written` has none."""
    import time

    now = time.time()
    write(tmp_path, report(21, "srv-a", {5: 1}, written=now - 7200))  # a worker that stopped writing
    write(tmp_path, report(22, "srv-a", {5: 1}, tp_rank=1, written=now - 1))
    write(tmp_path, report(23, "srv-a", {5: 1}, tp_rank=2))  # no `written` field: no series
    text = exposition(tmp_path, "srv-a")
    ages = {line.split('pid="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("vllm_overlay_report_age_seconds{")}
    assert set(ages) == {"21", "22"}, text
    assert 7199 <= ages["21"] <= 7300 and 0 <= ages["22"] < 100


def test_no_reports_still_exports_zero_series(tmp_path) -> None:  # type: ignore[no-untyped-def]
    s = metrics_text.parse(exposition(tmp_path / "missing", "srv-a"))
    assert s.found and s.count == 0 and s.buckets[1024] == 0 and s.processes == {}


ROUTER = "vllm.entrypoints.serve.instrumentator.metrics"


@pytest.fixture
def overlay(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("VLLM_OVERLAY_REPORT_DIR", str(tmp_path / "reports"))
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    importlib.import_module(ROUTER)  # the module whose get_prometheus_registry() /metrics serves
    core.revert()
    STATE.reset()
    yield
    core.revert()
    STATE.reset()


def test_hook_adds_the_collector_to_the_registry_vllm_serves(overlay, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from prometheus_client import REGISTRY, generate_latest

    router = importlib.import_module(ROUTER)
    original = router.get_prometheus_registry
    core.register()
    assert STATE.patches["prometheus-metrics"]["status"] == "applied"
    assert os.environ["VLLM_OVERLAY_SERVER_ID"]
    # one API server: vLLM serves the default registry
    assert router.get_prometheus_registry() is REGISTRY
    text = generate_latest(REGISTRY).decode()
    assert 'vllm_overlay_patch_info{patch="prometheus-metrics"' in text  # this process's own report
    # api-server-count > 1: vLLM serves a fresh registry with the multiprocess collector
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "prom"))
    os.makedirs(tmp_path / "prom")
    multi = router.get_prometheus_registry()
    assert multi is not REGISTRY and "vllm_overlay_processes" in generate_latest(multi).decode()
    # ... and the handler that answers /metrics builds its own such registry for every request
    # (prometheus-fastapi-instrumentator's expose())
    assert "vllm_overlay_processes" in generate_latest(ephemeral()).decode()
    core.revert()
    assert router.get_prometheus_registry is original  # vLLM's function itself is never replaced
    assert "vllm_overlay_" not in generate_latest(REGISTRY).decode()
    assert "vllm_overlay_" not in generate_latest(ephemeral()).decode()


def ephemeral():  # type: ignore[no-untyped-def]
    from prometheus_client import CollectorRegistry, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return registry


def test_band_edges_must_be_bucket_edges() -> None:
    from vllm_overlay.tools.stress.plan import UsageError
    from vllm_overlay.tools.stress.run import _check_band_edges

    s = metrics_text.Scrape(buckets={e: 0 for e in (512, 1024, 1500, 2048)})
    _check_band_edges(1024, 2048, s)
    _check_band_edges(0, 512, s)
    with pytest.raises(UsageError, match="--band 1000,2048: 1000 is not a bucket edge .* nearest edges: 512, 1024"):
        _check_band_edges(1000, 2048, s)


def test_read_metrics_bounds_the_largest_forward(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from vllm_overlay.tools.stress import run

    before = metrics_text.Scrape(buckets={1024: 5, 2048: 5}, max_forward=2009)
    after = metrics_text.Scrape(buckets={1024: 8, 2048: 20}, max_forward=2009,
                           processes={"7": {"role": "worker rank 0", "patches": {}, "counters": {}}})
    monkeypatch.setattr(run.time, "sleep", lambda s: None)
    monkeypatch.setattr(run.metrics_text, "scrape", lambda base, timeout=30, api_key=None: after)
    procs, sizes, _, largest, exact, servers_n = run._read_metrics("http://x", before, None)
    assert sizes == {1024: 3, 2048: 12} and (largest, exact, servers_n) == (2009, False, 1)
    assert procs[0]["_path"] == "http://x/metrics (pid 7)"
    after.max_forward = 2040  # grew during the run: exact
    assert run._read_metrics("http://x", before, None)[3:5] == (2040, True)


# ---- one real API server ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):  # type: ignore[no-untyped-def]
    from test_stress import Server

    root = tmp_path_factory.mktemp("metrics-server")
    os.makedirs(root / "prometheus-multiproc")
    # PROMETHEUS_MULTIPROC_DIR set: vLLM serves the registry it builds for api-server-count > 1
    s = Server(root, env={"PROMETHEUS_MULTIPROC_DIR": str(root / "prometheus-multiproc")})
    try:
        s.wait_healthy()
        yield s, root
    finally:
        s.kill()


@pytest.mark.engine
def test_metrics_match_the_reports_in_both_directions(served) -> None:  # type: ignore[no-untyped-def]
    from conftest import load_reports
    from test_stress import stress

    server, root = served
    import time

    deadline = time.time() + 10  # the worker's buffer reaches its report within a flush period
    while not (before := metrics_text.scrape(server.url)).buffer_rows and time.time() < deadline:
        time.sleep(0.5)
    assert before.found, "no vllm_overlay_ series on /metrics"
    roles = {p["role"]: p["patches"] for p in before.processes.values()}
    assert roles["api server"]["prometheus-metrics"]["status"] == "applied", roles
    worker = next(p for r, p in roles.items() if "worker rank 0" in r)
    assert worker["forward-telemetry"]["status"] == "applied" and worker["gdn-output-prealloc"]["status"] == "applied"
    assert before.engine_config["max_num_batched_tokens"] == 2048 and before.buffer_rows == [2048]
    assert {1024, 2048} <= set(before.buckets)

    # 1: judged from the report files; /metrics must count the same band forwards
    p = stress(["--url", server.url, "--report-dir", server.reports, "--band", "1024,2048",
                "--min-band-forwards", "10", "--out", str(root / "out-reports")])
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:] + server.text()[-3000:]
    by_reports = json.load(open(root / "out-reports" / "stress.json"))
    time.sleep(2.5)  # one flush period and more
    middle = metrics_text.scrape(server.url)
    assert by_reports["telemetry"] == "reports"
    # the harness's warm-up wave runs before its clock and is not counted by it; /metrics saw it:
    # one band forward and the decode streams' forwards more than the verdict's
    assert by_reports["band_forwards"] >= 10
    assert middle.band(1024, 2048) - before.band(1024, 2048) - by_reports["band_forwards"] in (0, 1)
    assert middle.count - before.count >= by_reports["forwards"]
    assert middle.max_forward >= by_reports["max_forward"] > 1024

    # 2: no report directory (as from a container): the verdict comes from /metrics alone
    sizes_before = merge_sizes(load_reports(server.reports))
    p = stress(["--url", server.url, "--band", "1024,2048", "--min-band-forwards", "10",
                "--out", str(root / "out-metrics")])
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    by_metrics = json.load(open(root / "out-metrics" / "stress.json"))
    time.sleep(2.5)
    sizes_after = merge_sizes(load_reports(server.reports))
    delta = {s: c - sizes_before.get(s, 0) for s, c in sizes_after.items() if c > sizes_before.get(s, 0)}
    assert by_metrics["telemetry"] == "metrics" and by_metrics["verdict"] == by_reports["verdict"] == "PASSED"
    assert by_metrics["band_forwards"] >= 10
    assert in_band(delta, 1024, 2048) - by_metrics["band_forwards"] in (0, 1)  # the warm-up wave's
    assert sum(delta.values()) >= by_metrics["forwards"]
    assert by_metrics["limits"]["max_num_batched_tokens"] == 2048 and by_metrics["gdn_buffer_rows"] == 2048
    assert by_metrics["guard_trips"] == 0 and by_metrics["worker_roles"]
    assert 1024 < by_metrics["max_forward"] <= 2048

    # vLLM's own series are still served next to ours
    import urllib.request

    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    assert "vllm:" in text and "vllm_overlay_guard_trips_total" in text

    # every vllm_overlay_ series' labels read back against the reports of this server
    from prometheus_client.parser import text_string_to_metric_families

    from vllm_overlay.patches._gdn_metrics import buffer_labels

    reports = {str(r["pid"]): r for r in load_reports(server.reports)}
    checked, info = 0, {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if not smp.name.startswith("vllm_overlay_") or "pid" not in smp.labels or "role" not in smp.labels:
                continue
            rep = reports.get(smp.labels["pid"])
            assert rep is not None and rep["role"] == smp.labels["role"], (smp, sorted(reports))
            if smp.name.startswith("vllm_overlay_gdn_buffer_"):
                got = [smp.labels[k] for k in ("engine", "device", "dtype", "shape", "source")]
                assert got in [buffer_labels(b) for b in rep["buffers"]], (got, rep["buffers"])
                assert got[0].startswith("config-") and got[1] == "cpu" and got[2] == "torch.bfloat16", got
            if smp.name == "vllm_overlay_patch_info":
                rec = rep["patches"][smp.labels["patch"]]
                said = {"worker-only": "armed"}.get(smp.labels["status"], smp.labels["status"])
                assert rec["status"] == said, smp
                assert smp.labels["waiting_for"] == (",".join(rec["pending_modules"]) if said == "armed" else "")
                if smp.labels["role"] in ("api server", "engine core"):
                    info[(smp.labels["role"], smp.labels["patch"])] = smp.labels
            checked += 1
    assert checked > 10
    # the API server and the engine core never say 'armed' forever: the patches that act in the workers
    # say so, and name the modules they wait for
    for role in ("api server", "engine core"):
        for patch in ("forward-telemetry", "gdn-output-prealloc", "memory-headroom", "moe-configs"):
            labels = info[(role, patch)]
            assert labels["status"] == "worker-only" and labels["waiting_for"], labels
        assert info[(role, "rank-reports")]["status"] == "applied"
    assert not [k for k, v in info.items() if v["status"] == "armed"], info

    # a band /metrics cannot count exactly is refused before any traffic
    p = stress(["--url", server.url, "--band", "1000,2048", "--out", str(root / "out-bad")])
    assert p.returncode == 2 and "not a bucket edge" in p.stdout, p.stdout[-2000:]


@pytest.mark.engine
def test_nothing_planted_in_the_report_dir_hangs_or_blinds_metrics(served) -> None:  # type: ignore[no-untyped-def]
    """A FIFO, a link to /dev/zero and a 50 MB file named like this server's reports, and 2,000
    reports of dead engine cores written after the API server started: every scrape of the real
    server's /metrics still answers within a few seconds, vLLM's series and the overlay's with it,
    the three files are named and the dead reports left out."""
    import time
    import urllib.request

    from test_report_dir_safety import plant, plant_dead

    server, _root = served
    before = metrics_text.scrape(server.url)
    sid = before.engine_config["server_id"]
    planted = set(os.listdir(server.reports))
    try:
        names = plant(server.reports, sid)
        plant_dead(server.reports, sid, 2000)
        for _ in range(3):
            t0 = time.monotonic()
            with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as resp:
                text = resp.read().decode()
            assert time.monotonic() - t0 < 8.0
            assert "vllm:" in text and "vllm_overlay_guard_trips_total" in text
        after = metrics_text.parse(text)
        assert {p["role"] for p in after.processes.values()} == {p["role"] for p in before.processes.values()}
        assert "vllm_overlay_reports_gone 2000.0" in text and after.servers == 1
        for name in names:
            assert f'file="{name}"' in text
    finally:
        for name in set(os.listdir(server.reports)) - planted:
            os.unlink(os.path.join(server.reports, name))


def test_each_new_failure_of_a_report_is_logged_again(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    from prometheus_client import CollectorRegistry, generate_latest

    write(tmp_path, report(12, "srv-a", {1500: 2}))
    bad = tmp_path / report_files.name(server_id.file_key("srv-a"), 13, f"{13:08x}")
    reg = CollectorRegistry()
    reg.register(metrics.OverlayCollector(str(tmp_path), "srv-a"))
    bad.write_text("[]")
    generate_latest(reg)
    generate_latest(reg)  # the same failure: not logged again
    bad.write_text('{"pid": "x", "padding": 1}')  # a different one: logged
    text = generate_latest(reg).decode()
    warned = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(warned) == 2 and "found list" in warned[0] and "no integer pid" in warned[1]
    assert 'why="no integer pid"' in text and metrics_text.parse(text).band(1024, 2048) == 2
    os.unlink(bad)
    assert "report_skipped_info{" not in generate_latest(reg).decode()


# Reports whose /metrics text is kept in tests/data/metrics_exposition.txt: one server's processes (an
# engine core, two worker ranks), GDN buffers of several sizes (one larger than the
# batch, one without rows, one keyed the older way without its engine), a profile cap and a budget a
# setting requested. The text was written by the collector before the buffers' bucket edges moved to
# gdn-output-prealloc's hook: the same reports must keep giving the same bytes.
EXPOSITION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "metrics_exposition.txt")


def exposition_reports() -> list[dict]:  # type: ignore[type-arg]
    core_rep = report(31, "srv-e", {}, tp_rank=None, role="engine core", buffers=[],
                      patches={"forward-telemetry": {"status": "applied"},
                               "gdn-output-prealloc": {"status": "armed",
                                                       "pending_modules": ["vllm.v1.worker.gpu_model_runner"]}})
    core_rep["engine_config"]["profile_run_cap"] = 1000
    rank0 = report(32, "srv-e", {5: 3, 700: 2, 1200: 4, 2999: 1}, tp_rank=0,
                   budgets=[{"purpose": "gdn_output", "value": 3000, "requested": 1800, "raised": True, "floor": 3000,
                             "source": "floor: the model runner's max_num_tokens",
                             "requested_source": "env VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET"}])
    rank0["buffers"].append({"key": ["config-7fdda29fb7d0", "cpu", "torch.bfloat16", 8, 128], "rows": 5000,
                             "source": "env VLLM_OVERLAY_TEST_BUFFER_ROWS", "bytes": 10240000, "layers": 1})
    rank1 = report(33, "srv-e", {5: 3, 700: 2, 1200: 4, 2999: 1}, tp_rank=1,
                   buffers=[{"key": ["cpu", "torch.float16", 4, 64], "engine": "config-0123456789ab", "rows": 2600,
                             "source": "live", "bytes": 1331200, "layers": 3},
                            {"key": ["config-0123456789ab", "cpu", "torch.float16", 4, 64], "source": "live",
                             "bytes": 0, "layers": 0}])
    return [core_rep, rank0, rank1]


def test_the_exposition_of_fixed_reports_is_unchanged(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Byte for byte, the /metrics text of the reports above (this process's own report-writing sample
    aside: it comes from this process, not from the reports)."""
    for rep in exposition_reports():
        write(tmp_path, rep)
    own = "vllm_overlay_report_write_failing{"
    text = "".join(line for line in exposition(tmp_path, "srv-e").splitlines(keepends=True) if not line.startswith(own))
    assert 'le="2600.0"' in text and 'le="5000.0"' in text  # the buffers' rows are bucket edges
    with open(EXPOSITION) as f:
        assert text == f.read()
