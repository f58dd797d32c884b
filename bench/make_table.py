"""Generate docs/BENCHMARKS.md from bench/results/*.json (never by hand).

  python bench/make_table.py          # write docs/BENCHMARKS.md
  python bench/make_table.py --check  # fail if the committed page differs (a test runs this)
"""

from __future__ import annotations

import glob
import json
import os
import sys

if __package__:  # imported as bench.make_table (the tests)
    from . import common, serve_measure
else:  # run as python3 bench/make_table.py: Python puts bench/ first on sys.path
    import common  # type: ignore[no-redef]  # bench/common.py (stdlib only at import)
    import serve_measure  # type: ignore[no-redef]  # bench/serve_measure.py (stdlib only)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def fmt_stat(s: dict | None, scale: float = 1.0, digits: int = 1) -> str:  # type: ignore[type-arg]
    if not s:
        return "-"
    return f"{s['median'] * scale:.{digits}f} ({s['min'] * scale:.{digits}f}-{s['max'] * scale:.{digits}f})"


def redgreen_section(path: str) -> list[str]:
    d = json.load(open(path))
    env = d["environment"]
    out = [f"### Red-to-green, model `{d['model']}` ({os.path.relpath(path, ROOT)})", "",
           f"{env['gpu']}, vLLM {env['vllm']}, torch {env['torch']}, {env['date']}. "
           f"Settings: {json.dumps(d['settings'])}", "",
           "| configuration | outcome | failure | boot s | band forwards | guard trips | GDN buffer rows | profile forward |",
           "|---|---|---|---|---|---|---|---|"]
    for name, r in d["configs"].items():
        rep = r.get("reports", {})
        if r.get("returncode") == "timeout":
            r = {**r, "failure": f"not measured: the script's per-config time limit ({r.get('wall_s')} s) ended a "
                                 "cold boot (first Triton autotune); rerun in redgreen-tiny-green/-runtime-red"}
        rows = ", ".join(str(b["rows"]) for b in rep.get("buffers", [])) or "-"
        outcome = ("served" if r.get("ok") else "not measured" if r.get("returncode") == "timeout"
                   else "FAILED under traffic" if r.get("boot_s") is not None else "FAILED at boot")
        out.append(f"| {name} | {outcome} | {r.get('failure') or '-'} | "
                   f"{r.get('boot_s', '-')} | {rep.get('band_forwards', '-')} | {rep.get('guard_trips', '-')} | "
                   f"{rows} | {rep.get('profile_forward_tokens') or '-'} |")
    if "overlay_vs_stock" in d:
        o = d["overlay_vs_stock"]
        out += ["", f"Overlay vs stock on the same requests: token ids equal: {o['token_ids_equal']}, "
                    f"max |logprob difference| {o['max_abs_logprob_diff']}."]
    return out + [""]


def load_benches(res: str) -> list[dict]:  # type: ignore[type-arg]
    """Every bench-*.json once, each with its path (`_path`) and its name in the page (`_file`). Where the
    run's overlay reports were kept (logs/reports-<name>/), a process's hook_apply_s missing from the
    result's summary is taken from its own report."""
    out = []
    for p in sorted(glob.glob(os.path.join(res, "bench-*.json"))):
        r = json.load(open(p)) | {"_path": p, "_file": os.path.relpath(p, ROOT)}
        kept = os.path.join(res, "logs", "reports-" + os.path.basename(p).removesuffix(".json"))
        if os.path.isdir(kept):
            own = {(x := json.load(open(f)))["pid"]: x for f in glob.glob(os.path.join(kept, "overlay-*.json"))}
            for proc in r.get("reports", {}).get("processes", []):
                if proc.get("hook_apply_s") is None and proc["pid"] in own:
                    proc["hook_apply_s"] = own[proc["pid"]]["hook_apply_s"]
        out.append(r)
    return out


def config_label(r: dict) -> str:  # type: ignore[type-arg]
    kv = r.get("kv_cache_dtype", "auto")
    moe = r.get("moe_config_dir")
    return (f"{r.get('config')}" + ("" if kv == "auto" else f", KV {kv}")
            + (f", tuned MoE configs ({len(moe.get('files') or [])} files)" if moe else "")
            + (f", cap {r['profile_run_cap']}" if r.get("profile_run_cap") else "")
            + (f", TP {tp}" if (tp := r.get("settings", {}).get("tensor_parallel_size", 1)) > 1 else ""))


def bench_rows(benches: list[dict]) -> list[str]:  # type: ignore[type-arg]
    out = ["### Throughput (median of repeated runs in one boot, min-max in brackets)", "",
           "| model | config | mnbt | boot s | init engine s (profiling / compile) | KV tokens | decode-1 tok/s | "
           "decode-16 tok/s | prefill-8k s | band-mix tok/s | band-mix TTFT p50/p99 s | load+apply ms (max/process) "
           "| file |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    conditions = []
    for r in benches:
        if not r.get("workloads"):
            what = r.get("failure") if r.get("returncode") == "timeout" else f"FAILED: {r.get('failure')}"
            out.append(f"| {r.get('model')} | {config_label(r)} | "
                       f"{r.get('mnbt')} | {r.get('boot_s', '-')} | {r.get('init_engine_s', '-')} | "
                       f"{r.get('kv_cache_tokens', '-')} | {what} | | | | | | {r['_file']} |")
            continue
        w = r["workloads"]

        def get(name: str, key: str) -> dict | None:  # type: ignore[type-arg]
            return w.get(name, {}).get(key)

        ttft = w.get("band-mix", {}).get("ttft_long_prompts_s")
        ttft_text = f"{ttft['p50']:.3f}/{ttft['p99']:.3f}" if ttft else "-"
        procs = r.get("reports", {}).get("processes", [])
        if procs:
            ms, complete = apply_ms(procs)
            load = f"{ms:.0f}{'' if complete else '*'}"
        else:
            load = "-"
        prof, comp = boot_parts(r)
        out.append(
            f"| {r['model']} | {config_label(r)} | {r['mnbt']} | {r.get('boot_s')} | {r.get('init_engine_s', '-')} "
            f"({prof} / {comp}) | "
            f"{r.get('kv_cache_tokens', '-')} | {fmt_stat(get('decode-1', 'tokens_per_s'))} | "
            f"{fmt_stat(get('decode-16', 'tokens_per_s'))} | {fmt_stat(get('prefill-8k', 'seconds'), digits=3)} | "
            f"{fmt_stat(get('band-mix', 'tokens_per_s'))} | "
            f"{ttft_text} | "
            f"{load} | {r['_file']} |")
        env = r.get("environment", {})
        if env.get("note") or env.get("triton_cache_autotuning"):
            conditions.append(f"- {r['_file']}: GPU {env.get('cuda_visible_devices')}, "
                              f"{env.get('note') or 'alone'}, TRITON_CACHE_AUTOTUNING="
                              f"{env.get('triton_cache_autotuning')}, {env.get('date')}")
        tp = r.get("settings", {}).get("tensor_parallel_size", 1)
        if tp > 1 and r.get("config") == "overlay":
            ranks = [f"{x['role']} ({x['counts'].get('applied', 0)} applied, {x['counts'].get('failed', 0)} failed)"
                     for x in r.get("reports", {}).get("processes", []) if x["role"].startswith("worker")]
            conditions.append(f"- {r['_file']}: tensor parallel {tp}, overlay reports from "
                              f"{', '.join(ranks) or 'no worker'} (telemetry counts rank 0 only)")
    out += ["", "load+apply: the worst process of the run, register() plus the patches applied when vLLM later "
            "imported their modules; * marks results that predate recording the later part (register() alone)."]
    if conditions:
        out += ["", "Boot times depend on what the machine had cached: the first boot on a fresh machine compiles and "
                "autotunes; a later boot of the same configuration reuses vLLM's compile cache and (with "
                "TRITON_CACHE_AUTOTUNING=1) Triton's autotune results for the shapes already tuned. Compare "
                "boot times only between runs with the same conditions:", "", *conditions]
    soaks = []
    for r in benches:
        if r.get("soak"):
            rep = r.get("reports", {})
            soaks.append(f"- {r['_file']}: {r['soak']['plan']}; {rep.get('band_forwards')} forwards "
                         f"in (4096, 8192] out of {rep.get('forwards')}, max forward {rep.get('max_forward')}, "
                         f"{r['soak']['requests_ok']} requests ok, {r['soak']['requests_failed']} failed, "
                         f"wall {r['soak']['wall_s']} s, guard trips {rep.get('guard_trips')}")
    if soaks:
        out += ["", "### Band soaks", "", *soaks]
    return out + [""]


def boot_parts(r: dict) -> tuple[str, str]:  # type: ignore[type-arg]
    """Profiling-forward and torch.compile seconds: from the result, else from its kept log."""
    parts = {k: r[k] for k in common.BOOT_PARTS if k in r}
    path = r["_path"]
    log = os.path.join(os.path.dirname(path), "logs", os.path.basename(path).replace(".json", ".log"))
    if len(parts) < len(common.BOOT_PARTS) and os.path.exists(log):
        parts = {**common.boot_parts(open(log, errors="replace").read()), **parts}
    return tuple("-" if parts.get(k) is None else f"{parts[k]:.1f}" for k in ("profiling_s", "compile_s"))  # type: ignore[return-value]


def overlay_vs_stock(benches: list[dict]) -> list[str]:  # type: ignore[type-arg]
    """Overlay against stock vLLM: same script, same kind of machine, one boot per configuration."""
    runs = [r for r in benches if r.get("workloads") and r.get("kv_cache_dtype", "auto") == "auto"
            and not r.get("profile_run_cap")]
    out = []
    for ov in [r for r in runs if r["config"] == "overlay"]:
        # the stock run with the same settings: its file name differs only in the configuration (and
        # -moetuned, the overlay's tuned fused-MoE configs, which stock vLLM does not read)
        twin = os.path.basename(ov["_file"]).replace("-overlay-", "-stock-").replace("-moetuned", "")
        st = next((r for r in runs if r["config"] == "stock" and os.path.basename(r["_file"]) == twin), None)
        if not st:
            continue
        tp = ov.get("settings", {}).get("tensor_parallel_size", 1)
        out += [f"#### `{ov['model']}`, mnbt {ov['mnbt']}{f', tensor parallel {tp}' if tp > 1 else ''}: "
                f"overlay ({ov['_file']}) vs stock ({st['_file']})", "",
                "| workload | overlay | stock | overlay / stock | verdict |", "|---|---|---|---|---|"]
        for name, key, unit, lower_is_better in (("decode-1", "ms_per_token_per_stream", "ms/token", True),
                                                 ("decode-16", "ms_per_token_per_stream", "ms/token", True),
                                                 ("prefill-8k", "seconds", "s", True),
                                                 ("band-mix", "tokens_per_s", "tok/s", False),
                                                 ("prefill-heavy", "tokens_per_s", "tok/s", False),
                                                 ("mixed-long", "tokens_per_s", "tok/s", False)):
            a, b = ov["workloads"].get(name, {}).get(key), st["workloads"].get(name, {}).get(key)
            if not (a and b):
                continue
            ok = a["median"] <= b["max"] if lower_is_better else a["median"] >= b["min"]
            verdict = ("no worse than stock beyond the spread" if ok else "WORSE than stock beyond the spread "
                       f"(overlay median {'above' if lower_is_better else 'below'} stock's "
                       f"{'max' if lower_is_better else 'min'})")
            out.append(f"| {name} ({unit}) | {fmt_stat(a, digits=3)} | {fmt_stat(b, digits=3)} | "
                       f"{a['median'] / b['median']:.3f} | {verdict} |")
        if ov.get("logprobs") and st.get("logprobs"):
            out += ["", f"First generated token, top-20 logprobs on the same 8 prompts: "
                        f"{_logprob_agreement(ov['logprobs'], st['logprobs'], 'stock')}."]
        moe = (ov.get("reports") or {}).get("moe_configs")
        if moe:
            out += ["", "Fused-MoE config per expert shape (the overlay's report): " + "; ".join(
                f"{k}: {v}" for k, v in sorted(moe.items())) + "."]
        out += lever_lines(ov, runs)
        out += trade_lines(ov, st, runs)
        procs = ov.get("reports", {}).get("processes", [])
        if any(x.get("load_apply_s") for x in procs):
            out += ["", f"Plugin load + apply, measured in each process: at most {max_apply_ms(procs)} (target < 1 s)."]
        out.append("")
    return (["### Overlay vs stock vLLM", "", *out] if out else [])


# The trade the bug report raised max_num_batched_tokens for: workload -> (what it is, target for the
# overlay at the higher mnbt over stock at the lower). Stock alone measured 1.46 x and 1.16 x for 8192
# over 4096 on the two mixes (vLLM 0.20.2, one H200, 2026-11-30).
TRADE = {"band-mix": ("three prompts of 2400-2600 tokens with 8 of 64, 128 tokens out each", 1.10),
         "prefill-heavy": ("12 prompts of 3000 tokens with 8 of 64, 16 out each", 1.40),
         "mixed-long": ("8 prompts of 2000-3400 tokens with 16 of 64, 64 out each", 1.12)}


def name_suffix(r: dict) -> str:  # type: ignore[type-arg]
    """What a result's file name adds after its mnbt (KV dtype, cap, TP, tag), without -moetuned: runs
    of one set (same day, same settings) share it."""
    base = os.path.basename(r["_file"]).removesuffix(".json")
    return base.split(f"-mnbt{r.get('mnbt')}", 1)[-1].replace("-moetuned", "")


def lever_lines(ov: dict, runs: list[dict]) -> list[str]:  # type: ignore[type-arg]
    """The tuned fused-MoE configs alone: an overlay run with them against the overlay run of the same
    set without them (file names differing only in -moetuned)."""
    if "-moetuned" not in ov["_file"]:
        return []
    plain = os.path.basename(ov["_file"]).replace("-moetuned", "")
    base = next((r for r in runs if r["config"] == "overlay" and os.path.basename(r["_file"]) == plain), None)
    if not base:
        return []
    rows = []
    for name in ("decode-1", "decode-16", "prefill-8k", "band-mix", "prefill-heavy", "mixed-long"):
        key = "ms_per_token_per_stream" if name.startswith("decode") else "tokens_per_s"
        a, b = ov["workloads"].get(name, {}).get(key), base["workloads"].get(name, {}).get(key)
        if a and b:
            unit = "ms/token" if key.startswith("ms") else "tok/s"
            rows.append(f"| {name} ({unit}) | {fmt_stat(a, digits=3)} | {fmt_stat(b, digits=3)} | "
                        f"{a['median'] / b['median']:.3f} |")
    if not rows:
        return []
    return ["", f"The tuned fused-MoE configs alone: the overlay with them against the overlay without them "
                f"({base['_file']}), same set:", "", "| workload | with tuned configs | vLLM's default configs | "
                "with / without |", "|---|---|---|---|", *rows]


def trade_lines(ov: dict, st: dict, runs: list[dict]) -> list[str]:  # type: ignore[type-arg]
    """The overlay at its mnbt against stock at a lower mnbt of the same set, on the mixes both ran."""
    low = next((r for r in runs if r["config"] == "stock" and r["model"] == ov["model"] and r["mnbt"] < ov["mnbt"]
                and name_suffix(r) == name_suffix(ov) and any(w in r["workloads"] for w in TRADE)), None)
    if not low:
        return []
    rows = []
    for name, (what, target) in TRADE.items():
        a, b = ov["workloads"].get(name), low["workloads"].get(name)
        if not (a and b):
            continue
        ratio = a["tokens_per_s"]["median"] / b["tokens_per_s"]["median"]
        c = st["workloads"].get(name)
        alone = f"{c['tokens_per_s']['median'] / b['tokens_per_s']['median']:.3f} x" if c else "-"

        def ttft(w: dict) -> str:  # type: ignore[type-arg]
            t = w.get("ttft_long_prompts_s")
            return f"{t['p50']:.3f}/{t['p99']:.3f}" if t else "-"

        rows.append(f"| {name}: {what} | {fmt_stat(a['tokens_per_s'])} | {ttft(a)} | {fmt_stat(b['tokens_per_s'])} | "
                    f"{ttft(b)} | **{ratio:.3f} x** | {alone} | >= {target:.2f} x: {'met' if ratio >= target else 'MISSED'} |")
    if not rows:
        return []
    return ["", f"The trade the bug report raised max_num_batched_tokens for: the overlay at mnbt {ov['mnbt']} against "
                f"stock at mnbt {low['mnbt']} ({low['_file']}); tokens/s median (min-max), TTFT p50/p99 of the long "
                "prompts in s; the last but one column is stock alone at the higher mnbt over the lower, same set:", "",
            f"| workload | overlay {ov['mnbt']} tok/s | TTFT | stock {low['mnbt']} tok/s | TTFT | overlay {ov['mnbt']} / "
            f"stock {low['mnbt']} | stock {st['mnbt']} / stock {low['mnbt']} | target |",
            "|---|---|---|---|---|---|---|---|", *rows]


def breakdown_section(benches: list[dict]) -> list[str]:  # type: ignore[type-arg]
    """bench.py --breakdown: per run, the decode step's GPU time by kernel family at each stream count."""
    out = []
    for r in benches:
        bd = r.get("breakdown")
        if not bd:
            continue
        by = bd.get("by_streams", {})
        streams = sorted(by, key=int)
        fams: list[str] = []
        for n in streams:
            for f in by[n].get("families", {}):
                if f not in fams:
                    fams.append(f)
        out += [f"#### {r['model']}, {config_label(r)}, mnbt {r['mnbt']} ({r['_file']})", ""]
        if fams:
            first = by[streams[0]].get("families", {})
            fams.sort(key=lambda f: (f.startswith("gaps"), -(first.get(f, {}).get("ms_per_step") or 0)))
            out += ["| kernel family | " + " | ".join(f"{n} stream{'s' if n != '1' else ''}: ms per step (share)"
                                                       for n in streams) + " |",
                    "|---|" + "---|" * len(streams)]
            for f in fams:
                cells = []
                for n in streams:
                    v = by[n].get("families", {}).get(f)
                    cells.append(f"{v['ms_per_step']:.3f} ({100 * (v.get('share_of_wall') or 0):.0f} %)" if v else "-")
                out.append(f"| {f} | " + " | ".join(cells) + " |")
        for n in streams:
            v = by[n]
            if v.get("families"):
                out.append(f"- {n} stream(s): wall {v['wall_ms_per_step']:.3f} ms per step (median of "
                           f"{v['steps']} steps without the profiler; {v.get('wall_ms_per_step_under_profiler')} ms "
                           f"under it), GPU busy {v['gpu_busy_ms_per_step']:.3f} ms, {v['kernel_events'] / v['steps']:.0f} "
                           f"kernels and {v['cuda_graph_launches'] / v['steps']:.1f} CUDA graph launches per step")
            else:
                out.append(f"- {n} stream(s): {v.get('problem') or v.get('error') or v.get('skipped')}")
        moe = (r.get("reports") or {}).get("moe_configs")
        lines = [ln for ln in r.get("moe_config_log", []) if "Using default MoE config" in ln or "moe-configs:" in ln]
        if moe or lines:
            out.append("- fused-MoE config: " + ("; ".join(f"{k}: {v}" for k, v in sorted(moe.items())) if moe
                                                 else lines[0][-200:]))
        out.append("")
    if not out:
        return []
    return ["### Where a decode step's time goes (`bench/bench.py --breakdown`, torch.profiler)", "",
            "GPU kernel time per decode step by family (the family rules are in the result), share of the step's wall "
            "time in brackets; gaps = wall minus GPU busy (scheduling, sampling, launches between CUDA graphs).", "",
            *out]


def tune_summary(folder: str) -> dict:  # type: ignore[type-arg]
    """A `vllm-overlay tune-moe --out-dir FOLDER` folder (its config files and tune-state/) in one record."""
    shapes, meta, stamps = {}, {}, []
    for path in sorted(glob.glob(os.path.join(folder, "tune-state", "*.state.json"))):
        st = json.load(open(path))
        meta = meta or st.get("meta", {})
        name = os.path.basename(path).replace(".state.json", ".json")
        written = json.load(open(os.path.join(folder, name))) if os.path.exists(os.path.join(folder, name)) else {}
        batches = st.get("batches", {})
        stamps += [b["utc"] for b in batches.values() if b.get("utc")]
        shapes[st.get("meta", {}).get("shape", name)] = {
            "batches": batches, "tuned": sorted(int(k) for k in batches),
            "file_batch_sizes": sorted(int(k) for k in written if k.isdigit())}
    return {**{k: meta.get(k) for k in ("device", "vllm", "triton", "search")}, "shapes": shapes,
            "first_utc": min(stamps) if stamps else None, "last_utc": max(stamps) if stamps else None}


def tune_section(folders: list[str]) -> list[str]:
    """bench/results/tune-moe-*/: copies of `vllm-overlay tune-moe --out-dir` folders."""
    out = []
    for path in folders:
        t = tune_summary(path)
        out += [f"### Fused-MoE configs tuned with `vllm-overlay tune-moe` ({os.path.relpath(path, ROOT)})", "",
                f"{t.get('device')}, vLLM {t.get('vllm')}, Triton {t.get('triton')}, {t.get('search')} search, "
                f"{t.get('first_utc')} to {t.get('last_utc')}. vLLM's fused_experts under override_config, random "
                "bf16 weights, uniform random top-k routing; 'vLLM's config' is the one vLLM picks without a tuned "
                "file, 'tuned' the fastest candidate.", "",
                "| shape | batch | vLLM's config us | tuned us | speedup | configs timed | s | tuned config (M, N, K, "
                "group, warps, stages) |", "|---|---|---|---|---|---|---|---|"]
        for shape, rec in t.get("shapes", {}).items():
            for b in sorted(rec.get("batches", {}), key=int):
                x = rec["batches"][b]
                c = x["config"]
                before = x.get("default_us")
                speedup = f"{before / x['us']:.3f} x" if before else "-"
                out.append(f"| {shape} | {b} | {before if before is not None else '-'} | {x['us']} | "
                           f"{speedup} | {x.get('tried')} | "
                           f"{x.get('seconds', '-')} | {c.get('BLOCK_SIZE_M')}, {c.get('BLOCK_SIZE_N')}, "
                           f"{c.get('BLOCK_SIZE_K')}, {c.get('GROUP_SIZE_M')}, {c.get('num_warps')}, "
                           f"{c.get('num_stages')} |")
            rest = [b for b in rec.get("file_batch_sizes", []) if b not in rec.get("tuned", [])]
            if rest:
                out.append(f"| {shape} | {', '.join(map(str, rest))} | not tuned: the file holds vLLM's own config "
                           "| | | | | |")
        out.append("")
    return out


def cross_compare(paths: list[str]) -> list[str]:
    """Overlay vs stock outputs when the two configurations ran in separate runs of redgreen.py."""
    by_model: dict[str, dict[str, tuple[str, dict]]] = {}  # type: ignore[type-arg]
    for p in paths:
        d = json.load(open(p))
        for name, r in d["configs"].items():
            if name in ("overlay", "stock") and r.get("ok"):
                by_model.setdefault(d["model"], {})[name] = (os.path.relpath(p, ROOT), r)
    out = []
    for model, got in sorted(by_model.items()):
        if len(got) == 2:
            (fo, ov), (fs, st) = got["overlay"], got["stock"]
            diffs = [abs(a - b) for la, lb in zip(ov["logprobs"], st["logprobs"]) for a, b in zip(la, lb)]
            out.append(f"- `{model}`: overlay ({fo}) vs stock ({fs}), same requests: token ids equal: "
                       f"{ov['token_ids'] == st['token_ids']}; max |logprob difference| over {len(diffs)} "
                       f"generated tokens: {max(diffs) if diffs else '-'}")
    return (["### Overlay vs stock outputs", "", *out, ""] if out else [])


def stress_section(paths: list[str]) -> list[str]:
    out = ["### Band stress runs (`vllm-overlay stress`)", "",
           "| file | mode | band | verdict | band forwards | forwards | max forward | guard trips | requests ok/failed "
           "| tokens/s | TTFT p50/p99 s | wall s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in paths:
        r = json.load(open(p))
        out.append(f"| {os.path.relpath(p, ROOT)} | {r['mode']} | ({r['band'][0]}, {r['band'][1]}] | {r['verdict']} | "
                   f"{r['band_forwards']} | {r['forwards']} | {r['max_forward']} | {r['guard_trips']} | "
                   f"{r['requests_ok']}/{r['requests_failed']} | {r['tokens_per_s']} | "
                   f"{r['ttft_p50_s']:.3f}/{r['ttft_p99_s']:.3f} | {r['wall_s']} |")
    return out + [""]


def apply_ms(procs: list[dict]) -> tuple[float, bool]:  # type: ignore[type-arg]
    """The worst process's plugin time in ms: register() plus the patches applied later, when vLLM imported
    their modules (hook_apply_s; a worker forked from a process that registered has only these). False:
    the result predates recording hook_apply_s, so the figure is register() alone."""
    complete = all(x.get("hook_apply_s") is not None for x in procs)
    worst = max((x["load_apply_s"] or 0) + (x.get("hook_apply_s") or 0) for x in procs)
    return worst * 1000, complete


def max_apply_ms(procs: list[dict]) -> str:  # type: ignore[type-arg]
    ms, complete = apply_ms(procs)
    return (f"{ms:.0f} ms (register() and the patches applied on later imports)" if complete
            else f"{ms:.0f} ms (register() only: this result predates recording the later hooks)")


def _logprob_agreement(a: list[dict], b: list[dict], ref: str = "bf16") -> str:  # type: ignore[type-arg]
    diffs, top1, spread = [], 0, []
    for x, y in zip(a, b):
        shared = set(x["top"]) & set(y["top"])
        diffs += [abs(x["top"][t] - y["top"][t]) for t in shared]
        top1 += max(x["top"], key=x["top"].get) == max(y["top"], key=y["top"].get)
        spread.append(max(y["top"].values()) - min(y["top"].values()))
    return (f"{len(a)} prompts: max abs diff {max(diffs):.2g} over {len(diffs)} shared top-20 entries, "
            f"top-1 equal {top1}/{len(a)}; spread of the {ref} top-20 {min(spread):.3f}-{max(spread):.3f} nats")


def turboquant_section(res: str, benches: list[dict]) -> list[str]:  # type: ignore[type-arg]
    out = ["### TurboQuant KV cache on the hybrid (patch `hybrid-turboquant`, vLLM 0.20.2)", ""]
    kern = os.path.join(res, "tq-kernel-h200.json")
    if os.path.exists(kern):
        k = json.load(open(kern))
        st = k["settings"]
        out += [f"Kernel level (`bench/tq_kernel.py`, bounded in `tests/gpu/test_turboquant_kernel.py`): vLLM's "
                f"TurboQuant store + decode kernels vs {st['reference']}; {st['num_q_heads']} query heads over "
                f"{st['num_kv_heads']} KV heads, batch {st['batch']} (ragged lengths), block size {st['block_size']}. "
                f"{k['gpu']}, vLLM {k['vllm']}, torch {k['torch']}, {k['date']}.", "",
                "| preset | head_dim | tokens | relative error | cosine | min row cosine | bf16 floor (rel. error) |",
                "|---|---|---|---|---|---|---|"]
        for r in k["results"]:
            if r["status"] != "ok":
                out.append(f"| {r['preset']} | {r['head_dim']} | {r['seq_len']} | {r['status']} | | | |")
                continue
            t, f = r["tq"], r["bf16"]
            out.append(f"| {r['preset']} | {r['head_dim']} | {r['seq_len']} | {t['rel_err']:.4f} | {t['cosine']:.5f} | "
                       f"{t['min_row_cosine']:.5f} | {f['rel_err']:.4f} |")
        out.append("")
    rows = []
    for tq in benches:
        if not str(tq.get("kv_cache_dtype", "auto")).startswith("turboquant_"):
            continue
        same = [b for b in benches if b.get("kv_cache_dtype") == "auto" and all(
            b.get(key) == tq.get(key) for key in ("model", "config", "mnbt", "profile_run_cap"))]
        bf = same[0] if same else {}
        ratio = (f"{tq['kv_cache_tokens'] / bf['kv_cache_tokens']:.2f} x" if bf.get("kv_cache_tokens")
                 and tq.get("kv_cache_tokens") else "no bf16 run with the same script and settings yet")
        lp = (_logprob_agreement(tq["logprobs"], bf["logprobs"]) if tq.get("logprobs") and bf.get("logprobs")
              else "not measured")
        soak = tq.get("soak") or {}
        rep = tq.get("reports", {})
        rows.append(f"| {tq['model']} | {tq['kv_cache_dtype']} | {tq.get('kv_cache_tokens', '-')} | "
                    f"{bf.get('kv_cache_tokens', '-')} | {ratio} | {tq.get('attention_block_size', '-')} / "
                    f"{bf.get('attention_block_size', '-')} | {rep.get('band_forwards', '-')} band forwards, "
                    f"{soak.get('requests_ok', '-')} ok / {soak.get('requests_failed', '-')} failed in "
                    f"{soak.get('wall_s', '-')} s, guard trips {rep.get('guard_trips', '-')} | {lp} | "
                    f"{tq['_file']} |")
    if rows:
        out += ["Engine level (`bench/bench.py`, same gpu_memory_utilization, mnbt and profile cap on both sides):", "",
                "| model | KV dtype | KV tokens | bf16 KV tokens | ratio | attention block size TQ / bf16 | band soak "
                "(TQ) | first-token logprobs TQ vs bf16 | file |", "|---|---|---|---|---|---|---|---|---|", *rows, ""]
    red = os.path.join(res, "tq-tiny-cap4096-before-workspace-fix.json")
    if os.path.exists(red):
        r = json.load(open(red))
        out += [f"Before the profile-run-cap workspace fix ({os.path.relpath(red, ROOT)}): the tiny model with "
                f"{r['kv_cache_dtype']} and cap {r['profile_run_cap']} booted (KV {r.get('kv_cache_tokens')} tokens) "
                f"and died on its first forward above the cap: "
                f"`{next((ln.split(']: ', 1)[-1] for ln in r.get('log_tail', '').splitlines() if 'AssertionError: Workspace' in ln), '?')}`",
                ""]
    return out if len(out) > 2 else []


def stack_section(paths: list[str]) -> list[str]:
    """bench/stack.py results: one serving stack through `vllm serve`, several overlay configurations."""
    out = []
    for path in paths:
        d = json.load(open(path))
        out += [f"### Serving stack through `vllm serve` ({os.path.relpath(path, ROOT)})", "", d.get("note", ""), "",
                "| run | outcome | failure | seconds to healthy / to exit | KV cache tokens | worker ranks: patches | "
                "GDN buffer rows (source) | band forwards | requests ok / failed | guard checks / trips |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        decode = []
        for name, r in d["runs"].items():
            workers = [p for p in r.get("processes", []) if p.get("tp_rank") is not None]
            ranks = "; ".join(
                f"rank {p['tp_rank']}: " + ", ".join(f"{n} {k}" for k, n in p["counts"].items() if n)
                for p in sorted(workers, key=lambda p: p["tp_rank"]))
            bufs = sorted({f"{b['rows']} ({b['source']})" for p in workers for b in p.get("buffers", [])})
            checks = sum(p["counters"].get("guard_checks", 0) for p in workers)
            trips = sum(p["counters"].get("guard_trips", 0) for p in workers)
            st = r.get("stress") or {}
            outcome = ("served, stress " + st["verdict"] if st and r.get("healthy_after_s") is not None
                       else "served" if r.get("healthy_after_s") is not None else "FAILED at boot")
            expected = (r.get("series") or {}).get("expected")
            if expected:  # a run meant to stop (the forced buffer): what it did, as the series judged it
                outcome = expected + (f"; stress {st['verdict']}" if st else "")
            secs = r.get("healthy_after_s") if r.get("healthy_after_s") is not None else r.get("died_after_s")
            band = (f"{st['band_forwards']} in ({st['band'][0]}, {st['band'][1]}], max forward {st['max_forward']}"
                    if st else "-")
            ok = f"{st['requests_ok']} / {st['requests_failed']}" if st else "-"
            out.append(f"| {name} | {outcome} | {r.get('failure_class') or '-'} | {secs} | "
                       f"{int(r['kv_cache_tokens']) if r.get('kv_cache_tokens') else '-'} | {ranks} | "
                       f"{', '.join(bufs) or '-'} | {band} | {ok} | {checks} / {trips} (all ranks) |")
            for wl, v in (r.get("decode") or {}).items():
                decode.append(f"| {name} | {wl} | {fmt_stat(v['ms_per_token_per_stream'], digits=2)} | "
                              f"{fmt_stat(v['tokens_per_s'], digits=1)} |")
        runners = runner_lines(d)
        if runners:
            out += ["", "Model runner and the overlay's runner hooks (from each worker's overlay report; a stock "
                        "server has none, so there vLLM's own log line names the runner):", "", *runners]
        if decode:
            out += ["", "Decode through the server (32-token prompts, 256 tokens out, greedy; median of 3 after one "
                        "warm-up, (min-max)). Dummy weights: the MTP drafter's drafts are all rejected, so every step "
                        "pays for the drafts and the verify and yields one token.", "",
                    "| run | workload | ms per token per stream | tokens/s |", "|---|---|---|---|", *decode]
        out += steps_lines(d)
        out += verdict_lines(d)
        out += memory_lines(d)
        out.append("")
    return out


def verdict_lines(d: dict) -> list[str]:  # type: ignore[type-arg]
    """A series' verdict as merge recorded it (bench/stack.py SERIES[...]["verdict"], e.g. tqspec's)."""
    out = []
    for series, lines in (d.get("verdicts") or {}).items():
        out += ["", f"Verdict of `bench/stack.py series {series}` (from the merged runs):", "", *(f"- {ln}" for ln in lines)]
    return out


def runner_lines(d: dict) -> list[str]:  # type: ignore[type-arg]
    """Per run with runner evidence (bench/stack.py's summary records it): the runner each
    worker built and what the overlay's runner hooks did on it."""
    out = []
    for name, r in d["runs"].items():
        ev = r.get("runner_evidence")
        if not ev or not (ev.get("workers") or ev.get("built")):
            continue
        env = (r.get("vllm_env") or {}).get("VLLM_USE_V2_MODEL_RUNNER")
        text = (f"`{name}`: {'/'.join(ev.get('built') or []) or 'unknown'} ({ev.get('built_from') or '-'}"
                + (f", VLLM_USE_V2_MODEL_RUNNER={env}" if env is not None else "") + ")")
        for w in ev.get("workers", []):
            fired = "; ".join(f"{p} fired {', '.join(h.get('fired') or []) or 'nothing'}"
                              + (f", MISSING {', '.join(h['missing'])}" if h.get("missing") else "")
                              for p, h in sorted((w.get("hooks") or {}).items()))
            c = w.get("counters") or {}
            text += (f"; worker pid {w.get('pid')} ({(w.get('runner') or {}).get('class', '?')}): "
                     f"{fired or 'no runner hook checked (no forward served)'}; telemetry forwards "
                     f"{w.get('forwards')}, dummy forwards {w.get('dummy_forwards')}; guard checks / trips "
                     f"{c.get('guard_checks', 0)} / {c.get('guard_trips', 0)}")
        flags = [f"{k.replace('_', ' ')} {'yes' if ev.get(k) else 'no'}"
                 for k in ("cap_fired", "precapture_forward", "capacity_error")]
        out.append(f"- {text}; {', '.join(flags)}.")
    return out


def gib(v: float | int | None, signed: bool = False) -> str:
    if v is None:
        return "-"
    return f"{v / 2**30:+.3f}" if signed else f"{v / 2**30:.3f}"


def memory_lines(d: dict) -> list[str]:  # type: ignore[type-arg]
    """`stack.py memory` (bench/memory_serve.py): per run, memory-headroom's boot-time numbers and each
    traffic phase's worker peak against the reservation, the device's used memory and the outcome."""
    runs = {n: r for n, r in d["runs"].items() if r.get("memory")}
    if not runs:
        return []
    out = ["", "Memory under traffic (`bench/stack.py memory`, `bench/memory_serve.py`). Boot: memory-headroom's "
               "line (profiled = vLLM's profiling forward; predicted = the patch's forwards of "
               "max_num_batched_tokens; both above the allocator level before profiling). Per phase: the worker's "
               "allocator peak in that window above the same level with the KV cache left out, against what was "
               "reserved (vLLM's profiled peak plus what memory-headroom moved; a dry run moves nothing), and the "
               "device's used memory (`nvidia-smi` every 200 ms) against gpu_memory_utilization x total.", "",
           "| run | mnbt / cap | correction | profiled GiB | predicted GiB | moved GiB | KV tokens | largest runtime "
           "peak GiB (phase) | predicted - runtime GiB | reserved - runtime GiB | outcome |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for name, r in runs.items():
        m = r["memory"]
        recs = [x for w in (m.get("headroom") or {}).values() for x in w.get("records", [])]
        h = recs[0] if recs else {}
        dry = bool(h.get("dry_run"))
        best = None
        for ph_name, ph in m.get("phases", {}).items():
            workers = ph.get("workers") or {"-": {}}
            for w in workers.values():
                win = w.get("window") or {}
                if "runtime_peak" in win and (best is None or win["runtime_peak"] > best[0]):
                    best = (win["runtime_peak"], ph_name)
                rows.append(memory_phase_row(name, ph_name, ph, w))
        if h:
            corr = "dry run (vLLM's sizing)" if dry else "memory-headroom"
            reserved = h["reserved"] - h["baseline"] + (0 if dry else h["moved"])
            kv = (f"{h['kv_tokens_before']} (corrected: {h['kv_tokens_after']})" if dry
                  else f"{h['kv_tokens_before']} -> {h['kv_tokens_after']}")
            nums = [gib(h["profiled_peak"]), gib(h["measured_peak"]), gib(h["moved"]) + (" (would)" if dry else ""), kv]
        else:
            corr, reserved, nums = "off" if not m.get("headroom") else "not measured", None, ["-", "-", "-", "-"]
        cap = int((r.get("overlay_env") or {}).get("GENESIS_PROFILE_RUN_CAP_M")
                  or (r.get("overlay_env") or {}).get("VLLM_OVERLAY_PROFILE_RUN_CAP") or 0)
        died = m.get("server_died_in")
        outcome = f"server died in {died}" if died else "served every phase" if m.get("done") else "not finished"
        gap = gib(h["measured_peak"] - best[0], True) if best and h else "-"
        spare = gib(reserved - best[0], True) if best and reserved is not None else "-"
        out.append(f"| {name} | {m['config']['mnbt']} / {cap or 'off'} | {corr} | {' | '.join(nums)} | "
                   f"{gib(best[0]) + ' (' + best[1] + ')' if best else '-'} | {gap} | {spare} | {outcome} |")
    return out + ["", "| run | phase | requests ok / failed | server | runtime peak GiB | reserved GiB | "
                      "spare (+) / over (-) GiB | device peak / requested MiB | out-of-memory line or errors |",
                  "|---|---|---|---|---|---|---|---|---|", *rows]


def memory_phase_row(run: str, name: str, ph: dict, w: dict) -> str:  # type: ignore[type-arg]
    win = w.get("window") or {}
    reserved = w["budget"] - w["baseline"] if w.get("budget") is not None else None
    spare = gib(-win["over_budget"], True) if "over_budget" in win else "-"
    dev, req = ph.get("device_peak_mib") or {}, ph.get("device_requested_mib") or {}
    device = ", ".join(f"{v} / {req.get(k, '-')}" for k, v in dev.items()) or "-"
    server = ("alive" if ph.get("server_alive") else "DEAD") + (", OOM" if ph.get("oom") else "")
    why = (ph.get("oom_lines") or [""])[0][-160:] or "; ".join(ph.get("errors") or [])[:160] or "-"
    return (f"| {run} | {name} | {ph.get('requests_ok')} / {ph.get('requests_failed')} | {server} | "
            f"{gib(win.get('runtime_peak'))} | {gib(reserved)} | {spare} | {device} | {why.replace('|', '/')} |")


def steps_lines(d: dict) -> list[str]:  # type: ignore[type-arg]
    """`stack.py steps` (decode step times at given contexts) and the logprob comparisons of a merge."""
    out = []
    table = serve_measure.steps_table(d["runs"])
    if table:
        tokens = sorted({r["steps"].get("tokens") for r in d["runs"].values() if r.get("steps")})
        out += ["", "Decode step time through the server (`bench/stack.py steps`): each stream sends a prompt of the "
                    "given length (random token ids, distinct per stream and round), greedy; a step is timed while "
                    "every stream decodes and none has ended (per stream its time over the tokens it received then, "
                    f"median over streams), {', '.join(map(str, tokens))} steps a round, median of the rounds in one "
                    "boot. Dummy weights: every draft is rejected, so a speculative step yields one token and its "
                    "time is drafting plus verifying.", "", *table]
        drafts = []
        for name, r in d["runs"].items():
            for key, p in (r.get("steps") or {}).get("points", {}).items():
                sd = p.get("spec_decode") or {}
                if sd.get("drafts"):
                    drafts.append(f"{name} {key}: {sd['drafts']:.0f} drafts, {sd.get('draft_tokens', 0):.0f} draft "
                                  f"tokens, {sd.get('accepted_tokens', 0):.0f} accepted")
            for key, why in (r.get("steps") or {}).get("skipped", {}).items():
                drafts.append(f"{name} {key}: not measured: {why}")
        if drafts:
            out += ["", "Speculative decoding during the measured rounds (vLLM's /metrics): " + "; ".join(drafts) + "."]
    for key, c in (d.get("logprobs_compare") or {}).items():
        text = c.get("error") or serve_measure.describe_comparison(c)
        out += ["", f"Logprobs, {c.get('what', '')} `{key}`: {text}."]
    return out


def render() -> str:
    res = os.path.join(HERE, "results")
    lines = ["# Benchmarks", "", "Generated by `python bench/make_table.py` from `bench/results/*.json`; every "
             "figure below was measured by the script named in its file, on the machine it names.", ""]
    redgreens = sorted(glob.glob(os.path.join(res, "redgreen-*.json")))
    for p in redgreens:
        lines += redgreen_section(p)
    lines += cross_compare(redgreens)
    stresses = sorted(glob.glob(os.path.join(res, "stress-*.json")))
    if stresses:
        lines += stress_section(stresses)
    benches = load_benches(res)
    if benches:
        lines += bench_rows(benches)
        lines += overlay_vs_stock(benches)
        lines += breakdown_section(benches)
    lines += tune_section(sorted(p for p in glob.glob(os.path.join(res, "tune-moe-*")) if os.path.isdir(p)))
    lines += turboquant_section(res, benches)
    lines += stack_section(sorted(glob.glob(os.path.join(res, "stack-*.json"))))
    notes = os.path.join(HERE, "notes.md")
    if os.path.exists(notes):
        lines += [open(notes).read()]
    return "\n".join(lines) + "\n"


def main() -> None:
    target = os.path.join(ROOT, "docs", "BENCHMARKS.md")
    text = render()
    if "--check" in sys.argv[1:]:
        current = open(target).read() if os.path.exists(target) else ""
        if current != text:
            sys.exit("docs/BENCHMARKS.md is not what bench/make_table.py generates from bench/results and "
                     "bench/notes.md: run `python bench/make_table.py` and commit the result")
        print("docs/BENCHMARKS.md is up to date")
        return
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target, "w") as f:
        f.write(text)
    print("wrote docs/BENCHMARKS.md")


if __name__ == "__main__":
    main()
