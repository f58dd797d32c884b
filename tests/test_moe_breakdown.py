"""bench/moe_breakdown_h200.py's aggregation, on a synthetic trace (the real trace needs a CUDA GPU):
kernel names to families, per-step times, GPU busy as the union of overlapping kernels, the gaps,
and the loud result when a trace holds no kernels."""

from __future__ import annotations

from bench import moe_breakdown_h200 as mb  # stdlib only at import time; the project root is on the tests' path


def test_families() -> None:
    names = {"fused_moe_kernel": "fused MoE", "topkGatingSoftmax": "fused MoE",
             "_causal_conv1d_update_kernel": "GDN (linear attention)", "flash_fwd_splitkv_kernel": "full attention",
             "nvjet_tst_128x64_64x4": "dense GEMMs (projections, shared expert, lm_head)",
             "triton_poi_fused_add_0": "norms and small ops", "something_new": "other"}
    assert {n: mb.family(n) for n in names} == names


def kernel(name: str, ts: float, dur: float) -> dict:  # type: ignore[type-arg]
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_summarize_per_step() -> None:
    # 2 steps; in each: MoE 300 us, GDN 100 us overlapping it by 50 us, attention 50 us
    events = []
    for step, t0 in enumerate((0.0, 1000.0)):
        events += [kernel("fused_moe_kernel", t0, 300.0), kernel("chunk_gated_delta_rule_fwd", t0 + 250, 100.0),
                   kernel("flash_fwd_kernel", t0 + 400, 50.0)]
    events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 2})
    r = mb.summarize({"traceEvents": events}, steps=2, wall_s=0.002)  # 1 ms per step
    assert r["wall_ms_per_step"] == 1.0 and r["kernel_events"] == 6 and r["cuda_graph_launches"] == 1
    fam = r["families"]
    assert fam["fused MoE"]["ms_per_step"] == 0.3 and fam["fused MoE"]["share_of_wall"] == 0.3
    assert fam["GDN (linear attention)"]["ms_per_step"] == 0.1
    assert r["gpu_busy_ms_per_step"] == 0.4  # 0-350 and 400-450 us
    assert fam["gaps (wall minus GPU busy)"]["ms_per_step"] == 0.6
    assert [lv["family"] for lv in r["levers"]][:2] == ["gaps (wall minus GPU busy)", "fused MoE"]


def test_no_kernels_is_said() -> None:
    r = mb.summarize({"traceEvents": [{"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0}]},
                     steps=3, wall_s=0.003)
    assert "families" not in r and "no GPU kernel events" in r["problem"] and "1 cudaGraphLaunch" in r["problem"]
