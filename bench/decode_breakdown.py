"""Where one decode step's time goes, through `vllm serve` and vLLM's own torch profiler: per kernel
family, time per step, share of the step, and the family's memory-traffic floor.

  python3 bench/decode_breakdown.py --model qwen36-35b-a3b-slice8 [--streams 1,16] [--steps 64]
      [--context 2048] [--bandwidth-tbs 4.8] [--graphs on|off] [--config overlay|stock] [--out DIR]
  python3 bench/decode_breakdown.py --url http://127.0.0.1:8011 --trace-dir DIR --model NAME ...

Boots a server with `bench/stack.py boot` (bf16 KV, no MTP, graphs captured up to 128 tokens,
`--profiler-config` with the torch profiler writing to the trace folder), or attaches to one
(`--url`; it must run with `--profiler-config '{"profiler":"torch","torch_profiler_dir":DIR}'` and
DIR is `--trace-dir`). Per stream count: one unprofiled round of streamed completions (the step time
without the profiler, `serve_measure.step_stats`), then POST /start_profile (with a profile_prefix),
the same streams again, POST /stop_profile, and the worker's trace
(`PREFIX_dp0_..._rank0.*.pt.trace.json.gz`) is read. A trace with fewer than half the asked steps where
every stream decodes (a later request reached the scheduler after the first stream had finished) is
profiled again with twice the tokens, up to PROFILE_ATTEMPTS rounds, each retry said on stderr.

Steps are the worker's `execute_context_C(..)_generation_G(..)` annotations (vLLM's
`annotate_profile`); a decode step is one with C = 0 and G = streams, its wall time the interval to
the next annotation (the sampler and the host work between forwards fall inside it). Each kernel is
placed in the step whose annotation holds the CUDA runtime/driver call that launched it (by the
trace's `correlation`); a kernel replayed from a CUDA graph is launched by `cudaGraphLaunch` and is
counted `in_graph`. CUPTI records the kernels of a graph replay one by one on NVIDIA GPUs; where a
trace has graph launches in decode steps but no kernels for them, the result says so
(`graphs_hide_kernels`) and `--graphs off` (a server without CUDA graphs, `cudagraph_mode` NONE)
gives the kernels while the unprofiled step time of a `--graphs on` run stays the step time.

Families are name patterns (FAMILIES, data; the first match wins) plus context rules for dense
GEMMs, whose names (nvjet, cutlass, Machete, ...) do not say which layer they serve: the last dense
GEMM of a step is the lm_head; one followed on its stream by a router kernel is the MoE router's gate;
one on a stream other than the step's main stream is the shared expert (vLLM runs it on a side stream
where it overlaps the routed experts); the others are the layers' projections. On the CPU build the
"kernels" are the profiler's CPU operators that match a family, outermost first.

Floors: the bytes a family must move per step at the model's geometry (config.json), batch B and
context C, over --bandwidth-tbs: routed experts E * (1 - (1 - k/E)^B) distinct experts per MoE layer
(uniform routing) x 3 x hidden x moe_intermediate; shared expert, router gate, projections and lm_head
their weights once; full attention B x C x 2 x kv_heads x head_dim x --kv-bytes per layer; GDN the
recurrent state (value heads x k_dim x v_dim x --state-bytes) and conv state, read and written per
sequence; glue and the sampler their activations (B x vocab x 4 bytes of logits, twice). AWQ weights
(quantization_config) count bits/8 bytes a weight plus an fp16 scale and a packed zero per group,
except modules_to_not_convert. The host gap is the step's wall time minus its summed kernel time.
"""

from __future__ import annotations

import argparse
import bisect
import concurrent.futures
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from typing import Any

if __package__:  # imported as bench.decode_breakdown (the tests)
    from . import common
    from . import serve_measure as sm
else:  # run as python3 bench/decode_breakdown.py: Python puts bench/ first on sys.path
    import common  # type: ignore[no-redef]  # bench/common.py (stdlib only)
    import serve_measure as sm  # type: ignore[no-redef]  # stdlib only

HERE = os.path.dirname(os.path.abspath(__file__))

LABELS = {
    "gdn_recurrent": "GDN recurrent update", "gdn_conv": "GDN conv", "glue": "gating / norm glue",
    "moe_router": "MoE router", "expert_gemm": "expert GEMMs", "shared_expert": "shared expert",
    "attention": "full attention", "dense_proj": "dense projections (GDN / attention in+out)",
    "lm_head_sampler": "lm_head / logits / sampler", "other": "everything else (kernels)",
}
# (family, regex on the kernel or CPU-operator name), first match wins. Names from vLLM 0.33.0's
# sources (Triton function names, CUDA kernels of vllm._C) and the CPU build's operators.
FAMILIES: tuple[tuple[str, str], ...] = (
    ("gdn_recurrent", r"fused_recurrent_gated_delta_rule|fused_sigmoid_gating_delta_rule_update|_gdn_mtp_update|"
                      r"chunk_gated_delta_rule|chunk_scaled_dot_kkt|solve_tril|recompute_w_u|merge_16x16_to|"
                      r"chunk_fwd_kernel_o|chunk_local_cumsum|gdn_attention_core|gated_delta"),
    ("gdn_conv", r"causal_conv1d"),
    ("expert_gemm", r"fused_moe_kernel|marlin_moe|moe_wna16|moe_sum|moe_fused_mul_sum|cpu_fused_moe|expert_triton|"
                    r"batched_triton_kernel|cutlass_moe|grouped_gemm"),
    ("moe_router", r"topkgating|topk_softmax|grouped_topk|moe_align_block_size|count_and_sort_expert|"
                   r"_store_topk|router_gemm|aten::topk"),
    ("attention", r"kernel_unified_attention|flash_fwd|flash::|flashattn|fmha|paged_attention|reshape_and_cache|"
                  r"merge_attn_states|_fwd_kernel_stage|flashinfer|batchdecode|batchprefill|cpu_attention|"
                  r"cpu_attn|_tq_decode|_tq_fused_store|attention_2d"),
    ("lm_head_sampler", r"_topk_topp|_gumbel|_temperature_kernel|_penalties|_min_p|logprob|argmax|_sample|sampler|"
                        r"_topp_sb|log_softmax|logsumexp"),
    ("glue", r"rms_norm|rmsnorm|layer_norm|layernorm|l2norm|_fused_post_conv|gdn_gating|act_and_mul|silu|sigmoid|"
             r"rotary|rope|triton_poi|triton_red|triton_per|fused_add"),
    ("dense_gemm", r"nvjet|gemm|cutlass|xmma|cublas|machete|marlin|splitk|sm90_|sm100_|onednn_mm|aten::mm$|"
                   r"aten::addmm|aten::linear"),
)
MAIN_FAMILIES = tuple(LABELS)


def family(name: str) -> str:
    return common.kernel_family(name, FAMILIES)


ANNOTATION = re.compile(r"^execute_(?:\d+_)?context_(\d+)\((?:sq)?(\d+).*?_generation_(\d+)\((?:sq)?(\d+)")
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


class BadTrace(ValueError):
    pass


class NoFullStep(BadTrace):
    """The trace holds steps, but too few with every stream decoding (the requests reached the scheduler apart)."""

    def __init__(self, message: str, found: int = 0) -> None:
        super().__init__(message)
        self.found = found  # decode steps with every stream decoding


load_trace = common.load_trace
PROFILE_ATTEMPTS = 3  # profiled rounds per stream count before a trace without a full decode step is an error


def _cpu_kernels(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """CPU operators that match a family and are not inside another matching one (per thread)."""
    ops = sorted((e for e in events if e.get("cat") == "cpu_op" and family(str(e.get("name"))) != "other"),
                 key=lambda e: (e.get("tid"), float(e["ts"]), -float(e.get("dur", 0))))
    out, end, tid = [], -1.0, None
    for e in ops:
        if e.get("tid") != tid:
            tid, end = e.get("tid"), -1.0
        if float(e["ts"]) >= end:
            out.append({"name": e["name"], "ts": float(e["ts"]), "dur": float(e.get("dur", 0)), "stream": e.get("tid"),
                        "launch_ts": float(e["ts"]), "in_graph": False})
            end = float(e["ts"]) + float(e.get("dur", 0))
    return out


def analyse(trace: dict[str, Any], streams: int, min_steps: int = 1) -> dict[str, Any]:
    """Per decode step of `streams` sequences: kernel time by family, wall time, host gap.

    Fewer than `min_steps` such steps is NoFullStep (a mean over one or two steps says little)."""
    events = [e for e in trace.get("traceEvents", []) if isinstance(e, dict) and e.get("ph") == "X"]
    anns = sorted((e for e in events if str(e.get("cat")) == "user_annotation" and ANNOTATION.match(str(e.get("name")))),
                  key=lambda e: float(e["ts"]))
    if len(anns) < 2:
        raise BadTrace(f"{len(anns)} execute_* step annotations in the trace: vLLM's worker annotates each step "
                       "while its torch profiler records CPU activity; expected at least 2")
    launches = {}
    graph_launch_ts = []
    for e in events:
        if str(e.get("cat")) in LAUNCH_CATS and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = (float(e["ts"]), "GraphLaunch" in str(e.get("name")))
            if "GraphLaunch" in str(e.get("name")):
                graph_launch_ts.append(float(e["ts"]))
    device = [e for e in events if str(e.get("cat")) in DEVICE_CATS]
    if device:
        kernels = []
        for e in device:
            launch = launches.get(e.get("args", {}).get("correlation"))
            kernels.append({"name": str(e.get("name")), "ts": float(e["ts"]), "dur": float(e.get("dur", 0)),
                            "stream": e.get("args", {}).get("stream", e.get("tid")),
                            "launch_ts": launch[0] if launch else float(e["ts"]),
                            "in_graph": bool(launch and launch[1]) or "graph node id" in e.get("args", {})})
        source = "device kernels (CUPTI)"
    else:
        kernels, source = _cpu_kernels(events), "CPU operators (no device activity in the trace)"
    starts = [float(a["ts"]) for a in anns]
    per_step: list[list[dict[str, Any]]] = [[] for _ in anns]
    for k in kernels:
        i = bisect.bisect_right(starts, k["launch_ts"]) - 1
        if 0 <= i < len(anns) - 1:  # the last annotation has no end: left out
            per_step[i].append(k)
    chosen = []
    for i, a in enumerate(anns[:-1]):
        m = ANNOTATION.match(str(a["name"]))
        if int(m.group(1)) == 0 and int(m.group(3)) == streams:
            chosen.append(i)
    if not chosen:
        seen = sorted({str(a["name"]) for a in anns})[:8]
        raise NoFullStep(f"no decode step of {streams} streams in the trace (annotations seen: {seen}); expected "
                       f"steps annotated execute_context_0(0)_generation_{streams}({streams})")
    if len(chosen) < min_steps:
        raise NoFullStep(f"{len(chosen)} decode step(s) of {streams} streams in the trace; expected at least {min_steps}", len(chosen))
    fam_us = {f: 0.0 for f in MAIN_FAMILIES}
    names: dict[str, list[float]] = {}
    walls, sums, busies, graph_steps_without_kernels, in_graph = [], [], [], 0, 0
    for i in chosen:
        ks = sorted(per_step[i], key=lambda k: k["ts"])
        wall = starts[i + 1] - starts[i]
        if not ks and any(starts[i] <= t < starts[i + 1] for t in graph_launch_ts):
            graph_steps_without_kernels += 1
        main = max({k["stream"] for k in ks}, key=lambda s: sum(k["dur"] for k in ks if k["stream"] == s), default=None)
        fams = [family(k["name"]) for k in ks]
        gemms = [j for j, f in enumerate(fams) if f == "dense_gemm"]
        for j in gemms:
            nxt = next((fams[n] for n in range(j + 1, len(ks)) if ks[n]["stream"] == ks[j]["stream"]), None)
            if j == gemms[-1]:
                fams[j] = "lm_head_sampler"
            elif nxt == "moe_router":
                fams[j] = "moe_router"
            elif ks[j]["stream"] != main:
                fams[j] = "shared_expert"
            else:
                fams[j] = "dense_proj"
        for k, f in zip(ks, fams):
            fam_us[f] += k["dur"]
            names.setdefault(f + "\t" + k["name"], [0.0, 0])
            names[f + "\t" + k["name"]][0] += k["dur"]
            names[f + "\t" + k["name"]][1] += 1
            in_graph += k["in_graph"]
        spans = sorted((k["ts"], k["ts"] + k["dur"]) for k in ks)
        busy, cur = 0.0, None
        for s, e in spans:
            if cur is None or s > cur[1]:
                busy += (cur[1] - cur[0]) if cur else 0.0
                cur = [s, e]
            else:
                cur[1] = max(cur[1], e)
        busies.append(busy + ((cur[1] - cur[0]) if cur else 0.0))
        walls.append(wall)
        sums.append(sum(k["dur"] for k in ks))
    n = len(chosen)
    wall_ms, kern_ms = statistics.mean(walls) / 1000, statistics.mean(sums) / 1000
    top: dict[str, list[dict[str, Any]]] = {}
    for key, (us, calls) in sorted(names.items(), key=lambda kv: -kv[1][0]):
        f, name = key.split("\t", 1)
        if len(top.setdefault(f, [])) < 6:
            top[f].append({"name": name[:160], "ms_per_step": round(us / n / 1000, 4), "calls_per_step": round(calls / n, 2)})
    return {"streams": streams, "decode_steps": n, "steps_in_trace": len(anns) - 1, "kernel_source": source,
            "wall_ms_per_step": {"mean": round(wall_ms, 4), "median": round(statistics.median(walls) / 1000, 4),
                                 "min": round(min(walls) / 1000, 4), "max": round(max(walls) / 1000, 4)},
            "kernel_ms_per_step": round(kern_ms, 4), "busy_ms_per_step": round(statistics.mean(busies) / 1000, 4),
            "host_gap_ms_per_step": round(wall_ms - kern_ms, 4),
            "kernels_per_step": round(sum(len(per_step[i]) for i in chosen) / n, 1),
            "kernels_in_graphs_per_step": round(in_graph / n, 1),
            "graph_launches_in_decode_steps": sum(1 for t in graph_launch_ts for i in chosen if starts[i] <= t < starts[i + 1]),
            "graphs_hide_kernels": graph_steps_without_kernels > 0,
            "graph_steps_without_kernels": graph_steps_without_kernels,
            "families_ms_per_step": {f: round(us / n / 1000, 4) for f, us in fam_us.items()}, "top_kernels": top}


# ---- memory-traffic floors ----------------------------------------------------------------------


def weight_bytes(params: float, module: str, quant: dict[str, Any] | None) -> float:
    if not quant or any(m in module for m in quant.get("modules_to_not_convert") or []):
        return 2.0 * params
    bits, group = int(quant.get("bits", 4)), int(quant.get("group_size", 128))
    return params * (bits / 8 + (2 + bits / 8) / group)  # weights + fp16 scale + packed zero per group


def floors(cfg: dict[str, Any], batch: int, context: int, kv_bytes: float, state_bytes: float) -> dict[str, float]:
    """Bytes each family must move per decode step (module docstring)."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    types = cfg.get("layer_types") or ["linear_attention"] * cfg["num_hidden_layers"]
    n_lin, n_full = types.count("linear_attention"), types.count("full_attention")
    q = cfg.get("quantization_config") if (cfg.get("quantization_config") or {}).get("quant_method") in ("awq", "gptq") else None
    e, k, inter = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    s_inter = cfg.get("shared_expert_intermediate_size", 0)
    nk, nv, dk, dv = (cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"],
                      cfg["linear_value_head_dim"])
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg.get("head_dim", h // cfg["num_attention_heads"])
    conv_dim, layers = 2 * nk * dk + nv * dv, n_lin + n_full
    distinct = e * (1 - (1 - k / e) ** batch)
    gdn_proj = (weight_bytes(h * (2 * nk * dk + 2 * nv * dv), "in_proj_qkvz", q) + weight_bytes(h * 2 * nv, "in_proj_ba", q)
                + weight_bytes(nv * dv * h, "out_proj", q) + 2.0 * conv_dim * cfg.get("linear_conv_kernel_dim", 4))
    attn_proj = weight_bytes(h * (2 * nh * hd + 2 * nkv * hd), "qkv_proj", q) + weight_bytes(nh * hd * h, "o_proj", q)
    return {
        "gdn_recurrent": n_lin * batch * nv * dk * dv * state_bytes * 2,
        "gdn_conv": n_lin * batch * conv_dim * (cfg.get("linear_conv_kernel_dim", 4) - 1) * 2.0 * 2,
        "glue": layers * batch * h * 2.0 * 2 * 4,  # activations in and out of ~4 glue ops a layer
        "moe_router": layers * 2.0 * h * e,
        "expert_gemm": layers * distinct * weight_bytes(3 * h * inter, "experts", q),
        "shared_expert": layers * (weight_bytes(3 * h * s_inter, "shared_expert.", q) + 2.0 * h),
        "attention": n_full * batch * context * 2 * nkv * hd * kv_bytes,
        "dense_proj": n_lin * gdn_proj + n_full * attn_proj,
        "lm_head_sampler": 2.0 * v * h + batch * v * 4.0 * 2,
        "other": 0.0,
    }


# ---- the server ----------------------------------------------------------------------------------


def post(url: str, path: str, body: dict[str, Any] | None = None, timeout: float = 900) -> None:
    req = urllib.request.Request(url + path, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        r.read()


def served_model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        return json.load(r)["data"][0]["id"]


def run_round(port: int, model: str, streams: int, context: int, max_tokens: int, tag: str) -> list[dict[str, Any]]:
    prompts = [sm.prompt_ids(context, "decode-breakdown", tag, i) for i in range(streams)]
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        return list(pool.map(lambda p: sm.stream_completion(port, model, p, max_tokens), prompts))


def new_trace(trace_dir: str, prefix: str, wait_s: float) -> str:
    end = time.time() + wait_s
    while True:
        found = [p for p in glob.glob(os.path.join(trace_dir, f"{prefix}_*.pt.trace.json*")) if "async_llm" not in p]
        for p in sorted(found, key=os.path.getmtime, reverse=True):
            try:
                load_trace(p)
                return p
            except (OSError, EOFError, ValueError):
                pass  # still being written
        if time.time() > end:
            raise BadTrace(f"no worker trace {prefix}_*.pt.trace.json[.gz] in {trace_dir} {wait_s:.0f} s after "
                           "/stop_profile: is it the server's torch_profiler_dir (--trace-dir)?")
        time.sleep(1)


def measure(url: str, trace_dir: str, streams: int, steps: int, context: int, mnbt: int) -> dict[str, Any]:
    port, model = int(url.rsplit(":", 1)[1].split("/")[0]), served_model(url)
    max_tokens = sm.max_tokens_for(streams, context, steps, mnbt)
    min_steps = max(1, (steps + 1) // 2)  # of the `steps` asked for, at least half must have every stream decoding
    plain = sm.step_stats(run_round(port, model, streams, context, max_tokens, f"plain-{streams}"))
    for attempt in range(1, PROFILE_ATTEMPTS + 1):
        prefix = f"decbd-s{streams}-{int(time.time())}-a{attempt}"
        post(url, "/start_profile", {"profile_prefix": prefix})
        try:
            got = run_round(port, model, streams, context, max_tokens, f"prof-{streams}-{attempt}")
        finally:
            post(url, "/stop_profile")
        path = new_trace(trace_dir, prefix, 300)
        try:
            res = analyse(load_trace(path), streams, min_steps)
            break
        except NoFullStep as exc:
            if attempt == PROFILE_ATTEMPTS:
                raise NoFullStep(f"{exc}; {PROFILE_ATTEMPTS} profiled rounds, the last with max_tokens {max_tokens}",
                                 exc.found) from None
            max_tokens *= 2  # a later stream's request reached the scheduler after the first had finished
            had = f"{exc.found} step(s)" if exc.found else "no step"
            print(f"decode_breakdown: {streams} stream(s): profiled round {attempt} of {PROFILE_ATTEMPTS} had {had} with all "
                  f"{streams} decoding, fewer than {min_steps} (the requests reached the scheduler apart); profiling again "
                  f"with max_tokens {max_tokens}", file=sys.stderr)
    res.update({"step_ms_unprofiled": plain.get("step_ms"), "step_ms_profiled_stream": sm.step_stats(got).get("step_ms"),
                "trace": path, "profiled_rounds": attempt, "max_tokens_profiled": max_tokens,
                "errors": sorted({s["error"] for s in got if s.get("error")})})
    return res


def table(result: dict[str, Any]) -> str:
    rows = ["| family | " + " | ".join(f"{n} stream(s) ms (share, floor ms)" for n in result["by_streams"]) + " |",
            "|---|" + "---|" * len(result["by_streams"])]
    for f in (*MAIN_FAMILIES, "host_gap"):
        cells = []
        for r in result["by_streams"].values():
            wall = r["wall_ms_per_step"]["mean"]
            ms = r["host_gap_ms_per_step"] if f == "host_gap" else r["families_ms_per_step"][f]
            floor = "" if f == "host_gap" else f", {r['floor_ms'][f]:.4f}"
            cells.append(f"{ms:.4f} ({ms / wall:.0%}{floor})")
        rows.append(f"| {LABELS.get(f, 'host gap (wall - kernels)')} | " + " | ".join(cells) + " |")
    rows.append("| step wall (profiled / unprofiled) | " + " | ".join(
        f"{r['wall_ms_per_step']['mean']:.4f} / {r['step_ms_unprofiled']}" for r in result["by_streams"].values()) + " |")
    return "\n".join(rows) + "\n"


def fail(option: str, value: object, accepted: str) -> None:
    sys.exit(f"decode_breakdown: {option} {value!r}: expected {accepted}")


def model_config(model: str) -> dict[str, Any]:
    if model == "tiny":  # stack.py's name for the package's tiny hybrid
        model = os.path.join(os.path.dirname(HERE), "src", "vllm_overlay", "tools", "models", "tiny-hybrid")
    path = model if model.endswith(".json") else os.path.join(model, "config.json") if os.path.isdir(model) else \
        os.path.join(HERE, "models", f"{model}.json")
    if not os.path.isfile(path):
        names = sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(HERE, "models", "*.json")))
        fail("--model", model, f"a model directory with a config.json, a config .json file or one of {names}")
    cfg = json.load(open(path))
    cfg = cfg.get("text_config", cfg)
    missing = [key for key in ("hidden_size", "vocab_size", "num_experts", "linear_num_value_heads") if key not in cfg]
    if missing:
        fail("--model", model, f"a Qwen3-Next-style hybrid MoE config (missing {missing} in {path})")
    return cfg


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen36-35b-a3b-slice8", help="bench/models/NAME, a model dir or config .json")
    ap.add_argument("--url", default=None, help="attach to this server instead of booting one")
    ap.add_argument("--trace-dir", default=None, help="the server's torch_profiler_dir (with --url)")
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--steps", type=str, default="64", help="decode steps of every stream inside the window")
    ap.add_argument("--context", type=str, default="2048", help="prompt tokens per stream")
    ap.add_argument("--bandwidth-tbs", type=str, default="4.8", help="memory bandwidth for the floors (H200: 4.8)")
    ap.add_argument("--kv-bytes", type=str, default="2", help="bytes per KV element (bf16: 2)")
    ap.add_argument("--state-bytes", type=str, default="2", help="bytes per GDN state element (the cache dtype)")
    ap.add_argument("--graphs", default="on", help="on (vLLM's default) or off (cudagraph_mode NONE), booted servers")
    ap.add_argument("--config", default="overlay", help="stack.py configuration: overlay or stock")
    ap.add_argument("--mnbt", type=str, default="8192")
    ap.add_argument("--port", type=str, default="8031")
    ap.add_argument("--label", default="decode-breakdown")
    ap.add_argument("--boot-extra", default="", help="more `stack.py boot` options (one string, as --boot-extra=ARGS; not --extra)")
    ap.add_argument("--serve-extra", default="", help="more `vllm serve` arguments (one string; give it as --serve-extra=ARGS), e.g. --enforce-eager")
    ap.add_argument("--keep-server", action="store_true")
    ap.add_argument("--boot-only", action="store_true",
                    help="start the server (--label, --port, the profiler writing to --trace-dir) and return at once; "
                         "measure it later with --url and --trace-dir")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    ap.add_argument("--tag", default="")
    a = ap.parse_args(argv)
    raw = a.streams
    try:
        a.streams = [int(s) for s in raw.split(",")]
        assert a.streams and min(a.streams) >= 1
    except (ValueError, AssertionError):
        fail("--streams", raw, "comma-separated integers >= 1, e.g. 1,16")
    for opt, conv, lo in (("steps", int, 2), ("context", int, 1), ("mnbt", int, 1), ("port", int, 1),
                          ("bandwidth_tbs", float, 1e-6), ("kv_bytes", float, 1e-6), ("state_bytes", float, 1e-6)):
        raw = getattr(a, opt)
        try:
            val = conv(raw)
            assert val >= lo
        except (ValueError, AssertionError):
            fail("--" + opt.replace("_", "-"), raw, f"{'an integer' if conv is int else 'a number'} >= {lo:g}")
        setattr(a, opt, val)
    if a.graphs not in ("on", "off"):
        fail("--graphs", a.graphs, "on or off")
    if a.config not in ("overlay", "stock"):
        fail("--config", a.config, "overlay or stock")
    if a.url and not re.fullmatch(r"http://[^/:]+:\d+/?", a.url):
        fail("--url", a.url, "http://HOST:PORT of a running vllm serve")
    if a.url and not (a.trace_dir and os.path.isdir(a.trace_dir)):
        fail("--trace-dir", a.trace_dir, "with --url, an existing folder: the server's torch_profiler_dir")
    if a.boot_only and a.url:
        fail("--boot-only", a.url, "no --url (--boot-only starts a server; --url measures one already running)")
    if "--extra" in a.boot_extra.split():
        fail("--boot-extra", a.boot_extra, "stack.py boot options without --extra (vllm serve arguments go in --serve-extra)")
    a.cfg = model_config(a.model)
    return a


def boot_cmd(a: argparse.Namespace, trace_dir: str, wait_s: int) -> list[str]:
    """`stack.py boot` of a server with vLLM's torch profiler writing to trace_dir (made here)."""
    os.makedirs(trace_dir, exist_ok=True)
    prof = {"profiler": "torch", "torch_profiler_dir": trace_dir, "torch_profiler_with_stack": False,
            "ignore_frontend": True}
    extra = "--profiler-config " + json.dumps(json.dumps(prof))
    if a.graphs == "off":
        extra += " --compilation-config " + json.dumps(json.dumps({"cudagraph_mode": "NONE"}))
    extra += (" " + a.serve_extra) if a.serve_extra else ""
    return [sys.executable, os.path.join(HERE, "stack.py"), "boot", a.label, "--config", a.config, "--model", a.model,
            "--kv", "auto", "--mtp", "0", "--mnbt", str(a.mnbt), "--max-model-len", str(max(4096, 2 * (a.context + 4 * a.steps))),
            "--port", str(a.port), "--max-capture", "128", "--wait", str(wait_s), "--extra", extra,
            *__import__("shlex").split(a.boot_extra)]


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    stack = [sys.executable, os.path.join(HERE, "stack.py")]
    url, booted = (a.url or "").rstrip("/"), None
    if not url:
        trace_dir = os.path.abspath(a.trace_dir or os.path.join(a.out, f"traces-{a.label}"))
        cmd = boot_cmd(a, trace_dir, 0 if a.boot_only else 1200)
        if subprocess.run(cmd).returncode != 0:
            print(f"decode_breakdown: the boot failed: {' '.join(cmd)}", file=sys.stderr)
            subprocess.run([*stack, "stop", a.label])
            return 1
        if a.boot_only:
            print(f"decode_breakdown: {a.label} booting on port {a.port}, its traces in {trace_dir}; then: "
                  f"--url http://127.0.0.1:{a.port} --trace-dir {trace_dir}")
            return 0
        url, booted = f"http://127.0.0.1:{a.port}", a.label
    else:
        trace_dir = os.path.abspath(a.trace_dir)
    bw = a.bandwidth_tbs * 1e12
    result: dict[str, Any] = {"script": "bench/decode_breakdown.py", "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "settings": {k: v for k, v in vars(a).items() if k != "cfg"}, "families": dict(FAMILIES),
                              "labels": LABELS, "by_streams": {}}
    try:
        result["versions"] = json.load(urllib.request.urlopen(url + "/version", timeout=30))
    except Exception:  # noqa: BLE001 - older servers
        result["versions"] = None
    rc = 0
    try:
        for n in a.streams:
            r = measure(url, trace_dir, n, a.steps, a.context, a.mnbt)
            fl = floors(a.cfg, n, a.context, a.kv_bytes, a.state_bytes)
            r["floor_bytes"] = {f: round(b) for f, b in fl.items()}
            r["floor_ms"] = {f: round(1000 * b / bw, 5) for f, b in fl.items()}
            r["floor_ms_total"] = round(sum(r["floor_ms"].values()), 5)
            result["by_streams"][str(n)] = r
            print(f"decode_breakdown: {n} stream(s): {r['decode_steps']} decode steps, wall {r['wall_ms_per_step']['mean']} ms,"
                  f" kernels {r['kernel_ms_per_step']} ms, host gap {r['host_gap_ms_per_step']} ms"
                  + ("; CUDA graphs hide their kernels here: run --graphs off for the kernels" if r["graphs_hide_kernels"] else ""))
    except BadTrace as exc:
        result["error"], rc = str(exc), 1
        print(f"decode_breakdown: {exc}", file=sys.stderr)
    finally:
        if booted and not a.keep_server:
            subprocess.run([*stack, "stop", booted])
    name = f"decode-breakdown-{os.path.basename(a.model.rstrip('/')).removesuffix('.json')}-{a.config}-graphs{a.graphs}"
    name += f"-{a.tag}" if a.tag else ""
    with open(os.path.join(a.out, name + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    if result["by_streams"]:
        with open(os.path.join(a.out, name + ".md"), "w") as f:
            f.write(table(result))
        print(table(result))
    print(f"decode_breakdown: wrote {os.path.join(a.out, name + '.json')}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
