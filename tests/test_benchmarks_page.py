"""docs/BENCHMARKS.md is generated from bench/results and bench/notes.md, never edited by hand:
the committed page must be exactly what bench/make_table.py renders now."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_benchmarks_page_is_generated_from_the_results() -> None:
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "make_table.py"), "--check"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr + r.stdout


def _make_table():  # type: ignore[no-untyped-def]
    from bench import make_table  # the project root is on the tests' path (pyproject.toml)

    return make_table


def _run(name: str, config: str, tp: int, ms: float, procs: list[dict]) -> dict:  # type: ignore[type-arg]
    stat = {"median": ms, "min": ms, "max": ms, "n": 3}
    return {"_file": f"bench/results/{name}.json", "config": config, "model": "m", "mnbt": 8192,
            "settings": {"tensor_parallel_size": tp}, "workloads": {"decode-1": {"ms_per_token_per_stream": stat}},
            "reports": {"processes": procs}}


def test_overlay_is_compared_with_the_stock_run_of_the_same_settings() -> None:
    """A tensor-parallel overlay run is set against the stock run whose file name differs only in the
    configuration, never against a one-GPU stock run; plugin time counts the hooks applied on imports."""
    mt = _make_table()
    procs = [{"pid": 1, "role": "driver", "counts": {}, "load_apply_s": 0.045, "hook_apply_s": 0.036},
             {"pid": 2, "role": "worker rank 0", "counts": {}, "load_apply_s": None, "hook_apply_s": 0.008}]
    runs = [_run("bench-m-overlay-mnbt8192-tp2", "overlay", 2, 4.0, procs),
            _run("bench-m-stock-mnbt8192", "stock", 1, 9.0, []),
            _run("bench-m-stock-mnbt8192-tp2", "stock", 2, 4.1, [])]
    text = "\n".join(mt.overlay_vs_stock(runs))
    assert "tensor parallel 2: overlay (bench/results/bench-m-overlay-mnbt8192-tp2.json) vs stock " \
           "(bench/results/bench-m-stock-mnbt8192-tp2.json)" in text
    assert "| decode-1 (ms/token) | 4.000 (4.000-4.000) | 4.100 (4.100-4.100) | 0.976 |" in text
    assert "at most 81 ms (register() and the patches applied on later imports)" in text
    old = [{**p, "hook_apply_s": None} for p in procs]
    assert mt.apply_ms(old) == (45.0, False)


def test_a_tune_moe_folder_is_rendered(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A copy of `vllm-overlay tune-moe --out-dir` (config file, tune-state/) in bench/results becomes a table."""
    cfg = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4, "num_stages": 3}
    os.makedirs(tmp_path / "tune-state")
    (tmp_path / "E=256,N=512,device_name=NVIDIA_H200.json").write_text(json.dumps({"1": cfg, "16": cfg}))
    (tmp_path / "tune-state" / "E=256,N=512,device_name=NVIDIA_H200.state.json").write_text(json.dumps(
        {"meta": {"device": "NVIDIA_H200", "shape": "E=256,N=512,dtype=bf16", "vllm": "0.20.2", "search": "quick"},
         "batches": {"1": {"config": cfg, "us": 20.0, "default_us": 25.0, "tried": 41, "seconds": 30.1,
                           "utc": "2026-12-01T10:00:00Z"}}}))
    text = "\n".join(_make_table().tune_section([str(tmp_path)]))
    assert "| E=256,N=512,dtype=bf16 | 1 | 25.0 | 20.0 | 1.250 x | 41 | 30.1 | 16, 64, 128, 1, 4, 3 |" in text
    assert "| E=256,N=512,dtype=bf16 | 16 | not tuned: the file holds vLLM's own config" in text
