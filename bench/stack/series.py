"""The series (what each label boots and runs, and the verdict on them) and `series`: the queues per
GPU, the resume across runs and the status, comparisons and verdicts said at the end."""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shlex
import sys
import threading
import time
from typing import Any

from .. import serve_measure as sm  # bench/serve_measure.py (stdlib only)
from . import server
from .server import alive, check_gpu, say, sdir, series_state
from .collect import result_files, summarize
from .verdicts import (
    CONT_PATCH, CONTINUATION_BOOT, memory_verdict, release_verdict, TQSPEC_PATCH, tqspec_verdict)
from . import schedule  # REFUSED, ABORTED, WINDOWS: this process's series state, kept there
from .schedule import (
    run_series_queue, series_items, SERIES_MEMORY_LEAST_S, stress_verdict, warm_plan, warm_up)


# tq-mtp-steps: verify-step times and logprobs, TurboQuant k8v4 and bf16 KV, MTP on and off.
# --max-capture 128 captures the CUDA graphs of up to 128 tokens only (vLLM's default mode, fewer sizes:
# a shorter boot); every measured step (16 streams x 4 tokens at most) is one of them.
#
# v2-bf16: the overlay on Model Runner V2, the same geometry without MTP, bf16 KV, with
# VLLM_USE_V2_MODEL_RUNNER=1 set for every server; the overlay's band stress and logprobs, the forced
# 4096-row buffer (expected to stop with the overlay's CapacityError, at boot or under band traffic:
# that is its result, not a failure to retry) and stock vLLM's logprobs on the same runner.
#
# A series names, per label, its boot arguments and what runs once it serves ("do"): steps, stress,
# logprobs, guard (the label is expected to stop with CapacityError), or memory (bench/memory_serve.py's
# traffic phases, with the series' "memory" arguments). "fallbacks": what a failed boot
# may leave out in one second boot ("headroom": memory-headroom, when it stopped the boot; "max-capture":
# --max-capture, after any other failure). "expect_runner": the model runner every worker must build
# (read from the overlay's reports, or vLLM's own log line for a stock server); another one stops the
# series (exit 2). "compare": logprob runs printed side by side at the end; "verdict": a function of
# (runs, comparisons) whose lines the series prints at the end and merge prints and records. Steps run
# first, then memory; stress and logprobs in the order the item names them.
#
# TurboQuant + MTP on vLLM 0.26.0: the logprobs of the verify steps with the
# overlay's turboquant-spec-decode off (stock vLLM's path) and on, each against the same model without
# MTP. The 35B geometry's first 8 layers (two full-attention layers with the 35B's heads): the tiny
# hybrid's dummy-weight logprobs move too little for the fault to show (bench/tq_spec_effect_cpu.py).
SERIES: dict[str, dict[str, Any]] = {
    "tq-mtp-steps": {
        "boot": "--config overlay --max-capture 128",
        "steps": "--streams 1,16 --contexts 2048,32768 --tokens 64 --reps 3",
        "logprobs": "--prompts 8 --top 20 --out lp",
        "do": ("steps", "logprobs"),
        "fallbacks": ("headroom", "max-capture"),
        "items": [("tq-mtp", "--kv turboquant_k8v4 --mtp 3"), ("bf16-mtp", "--kv auto --mtp 3"),
                  ("tq-nomtp", "--kv turboquant_k8v4 --mtp 0"), ("bf16-nomtp", "--kv auto --mtp 0")],
    },
    "v2-bf16": {
        "boot": "--kv auto --mtp 0 --max-capture 128 --env VLLM_USE_V2_MODEL_RUNNER=1",
        # --min-band 500 plans 751 waves (one band forward each when all three prefills of a wave share a step);
        # --duration is the ceiling: 500 band forwards need 2.1 a second (2.9 were measured with MTP on 0.20.2)
        "stress": "--min-band 500 --duration 240",
        "guard_stress": "--min-band 20 --duration 90",  # only when the forced buffer's server serves
        "logprobs": "--prompts 8 --top 20 --out lp",
        "expect_runner": "V2",
        "fallbacks": ("headroom",),
        "compare": (("v2-overlay", "v2-stock", "lp"),),
        "items": [("v2-overlay", "--config overlay", ("stress", "logprobs")),
                  ("v2-forced-guard", "--config forced-guard", ("guard",)),
                  ("v2-stock", "--config stock", ("logprobs",))],
    },
    "tqspec": {
        "boot": "--config overlay --model qwen36-35b-a3b-slice8 --kv turboquant_k8v4 --max-capture 128",
        # 16 greedy tokens: the first from the prefill, 15 from verify steps over a cached context of 16-8,000 tokens
        "logprobs": "--prompts 6 --lengths 16,512,1024,2000,4000,8000 --max-tokens 16 --top 20 --out lp",
        # the patch's kernel among band prefills, after its logprobs: at least 200 forwards in (4096, 8192]
        "stress": "--min-band 200 --duration 240",
        "fallbacks": ("headroom",),  # a failed boot of the stock path is a finding, not retried
        "compare": (("tq-mtp-off", "tq-nomtp", "lp"), ("tq-mtp-on", "tq-nomtp", "lp"),
                    ("tq-mtp-off-v2", "tq-nomtp-v2", "lp"), ("tq-mtp-on-v2", "tq-nomtp-v2", "lp")),
        "verdict": tqspec_verdict,
        # the patch's V1 run first: side by side on one GPU (--gpus 0,0,...) it is the server that sizes its KV
        # cache by vLLM's own profiling, alone; stock vLLM on V1 last (on 0.25.0-0.26.0 it dies at boot)
        "items": [("tq-mtp-on", "--mtp 3 --env VLLM_USE_V2_MODEL_RUNNER=0", ("logprobs", "stress")),
                  ("tq-nomtp", "--mtp 0 --env VLLM_USE_V2_MODEL_RUNNER=0", ("logprobs",)),
                  ("tq-mtp-off", f"--mtp 3 --env VLLM_USE_V2_MODEL_RUNNER=0 --overlay-env "
                                 f"VLLM_OVERLAY_DISABLE={TQSPEC_PATCH}", ("logprobs",)),
                  ("tq-mtp-on-v2", "--mtp 3 --env VLLM_USE_V2_MODEL_RUNNER=1", ("logprobs", "stress")),
                  ("tq-nomtp-v2", "--mtp 0 --env VLLM_USE_V2_MODEL_RUNNER=1", ("logprobs",)),
                  ("tq-mtp-off-v2", f"--mtp 3 --env VLLM_USE_V2_MODEL_RUNNER=1 --overlay-env "
                                    f"VLLM_OVERLAY_DISABLE={TQSPEC_PATCH}", ("logprobs",)),
                  ("tq-stock", "--config stock --mtp 0 --env VLLM_USE_V2_MODEL_RUNNER=0", ("logprobs",))],
    },
}
# memory: memory under traffic on the 35B geometry's first 8 layers (13.8 GiB of weights: several servers
# fit one GPU; the whole geometry's 64 GB do not), graphs up to 128 tokens, vLLM's default runner (V2 on
# 0.29.0 and later; the verdict names the runner the workers built) except the MTP label, which asks for V1:
# memory-headroom measures the verify step's rejection sampler at the real draft count there only. Per
# configuration memory-headroom on (it moves what vLLM's profiling misses from the KV cache) and in dry-run
# (VLLM_OVERLAY_MEMORY_HEADROOM_DRY_RUN=1: vLLM's own sizing, with the patch's line and runtime watch). The
# pairs compile the same graphs, so the second of a pair boots warm. "mem_total": the utilization that servers
# side by side on one GPU share (each gets mem_total / their number: vLLM's budget is utilization x the
# device's total, so the budgets together leave what one server at mem_total leaves outside). "profile_alone":
# on a shared GPU one server at a time is in its profiling window (boot until its KV cache size is logged):
# vLLM reads the device's free memory there, so no other server of the series starts, stops or sends traffic
# meanwhile, and traffic waits while a boot is due (the windows run back to back, the traffic after them).
# "memory_by_label": `memory` options added to the series' own for one label (fewer phases where the phase
# left out shows nothing more there: "mixed" carries the longest prompt too).
SERIES["memory"] = {
    "boot": "--config overlay --model qwen36-35b-a3b-slice8 --mtp 0 --max-capture 128",
    "memory": "--phases longest,band,burst,mixed --band-seconds 15 --mixed-tokens 128",
    "least_budget_s": 100,  # the longest phase's prompt and its two windows fit
    "mem_total": 0.97,
    "profile_alone": True,
    "do": ("memory",),
    "fallbacks": ("headroom",),
    "verdict": memory_verdict,
    # labels that share compiled graphs (memory-headroom's dry run is outside vLLM's compile-cache key)
    "warm_groups": (("tq16k-headroom", "tq16k-vllm"), ("bf16-8k-headroom", "bf16-8k-vllm"), ("tq16k-mtp-v1",)),
    "memory_by_label": {"tq16k-mtp-v1": "--phases burst,mixed", "tq16k-vllm": "--phases band,burst,mixed",
                        "bf16-8k-vllm": "--phases burst,mixed"},
    # the three cold compiles first, the warm second boots of a pair after them
    "items": [("tq16k-headroom", "--kv turboquant_k8v4 --mnbt 16384"),
              ("bf16-8k-headroom", "--kv auto --mnbt 8192 --overlay-env GENESIS_PROFILE_RUN_CAP_M=0"),
              ("tq16k-mtp-v1", "--kv turboquant_k8v4 --mnbt 16384 --mtp 3 --env VLLM_USE_V2_MODEL_RUNNER=0"),
              ("tq16k-vllm", "--kv turboquant_k8v4 --mnbt 16384 --overlay-env VLLM_OVERLAY_MEMORY_HEADROOM_DRY_RUN=1"),
              ("bf16-8k-vllm", "--kv auto --mnbt 8192 "
                               "--overlay-env 'GENESIS_PROFILE_RUN_CAP_M=0 VLLM_OVERLAY_MEMORY_HEADROOM_DRY_RUN=1'")],
}
# memory-034: the memory question on vLLM 0.34.0, where Model Runner V1 is gone (the memory series' tq16k-mtp-v1
# cannot boot) and the extensible KV cache is vLLM's default on CUDA: sized after warm-up steps of real
# execute_model at max_num_batched_tokens, keeping their measured peak plus max(1 GiB, 0.75 x peak) free, not by
# profiling (memory-headroom then stands aside and says so). TurboQuant k8v4 at mnbt 16384 as the 0.33.0 run:
# xkv-default is vLLM's default (extensible KV cache on, gpu_memory_utilization 1.0, its default there: a value
# below 1.0 only caps the measured sizing); the two others turn the extensible KV cache off
# (--no-enable-extensible-kv-cache: profiling sizes the KV cache as on 0.33.0) at 0.97 as the 0.33.0 run,
# memory-headroom on and in dry run (vLLM's sizing, with the patch's line and runtime watch). Sized for one H100
# 80GB, one server at a time (`--gpus 0`): one cold compile (xkv-default) and two warm boots (the extensible KV
# cache, gpu_memory_utilization and memory-headroom's dry run are outside vLLM's compile-cache key), about 13
# minutes in all (bench/README.md says how that was estimated). The dry run leaves out `longest` ("mixed" carries
# the longest prompt too).
SERIES["memory-034"] = {
    "boot": "--config overlay --model qwen36-35b-a3b-slice8 --mtp 0 --max-capture 128 --kv turboquant_k8v4 "
            "--mnbt 16384",
    "memory": SERIES["memory"]["memory"],
    "least_budget_s": SERIES["memory"]["least_budget_s"],
    "mem_total": 0.97,
    "profile_alone": True,  # only where servers share a GPU (`--gpus 0,0`)
    "do": ("memory",),
    "fallbacks": ("headroom",),
    "verdict": memory_verdict,
    "warm_groups": (("xkv-default", "noxkv-headroom", "noxkv-vllm"),),
    "memory_by_label": {"noxkv-vllm": "--phases band,burst,mixed"},
    "items": [("xkv-default", "--mem 1.0"),
              ("noxkv-headroom", "--extra=--no-enable-extensible-kv-cache"),
              ("noxkv-vllm", "--extra=--no-enable-extensible-kv-cache "
                             "--overlay-env VLLM_OVERLAY_MEMORY_HEADROOM_DRY_RUN=1")],
}
# release: the bug report's stack on one release, Model Runner as the release chooses it (no
# VLLM_USE_V2_MODEL_RUNNER: V2 for every model from 0.29.0), on the 35B geometry's first 8 layers.
# TurboQuant k8v4 + MTP 3 with the overlay (logprobs, then the band stress), the same without MTP and with
# the overlay's verify path off (the tqspec verdict); the same geometry as AWQ 4-bit weights (dummy weights,
# vLLM's AWQ / Marlin MoE path) with TurboQuant + MTP (band stress); bf16 KV without MTP, overlay and stock
# vLLM, decode steps of 1 and 16 streams (each run alone on its GPU: no other server of the series boots or
# serves traffic meanwhile); the forced 4096-row buffer (expected: the overlay's CapacityError).
# q35-tq-mtp and q35-forced-guard: the same two questions (band stress; the forced buffer) on the Qwen3.5-MoE class
# (models/qwen35moe-35b-a3b-slice8.json), whose GDN layers vLLM 0.34.0 puts on the fused spec-decode path with MTP
# (the slice's Qwen3-Next layout falls back to Triton there, so gdn-output-prealloc buffered nothing on it).
# max_num_seqs 512: a KV cache of 2.5 GiB then holds enough Mamba blocks (vLLM wants one per sequence), so
# seven servers fit one H200 side by side (--fixed-kv 2684354560).
QWEN35 = "qwen35moe-35b-a3b-slice8"  # the slice's sizes as Qwen3_5MoeForCausalLM
SERIES["release"] = {
    "boot": "--config overlay --model qwen36-35b-a3b-slice8 --kv turboquant_k8v4 --max-capture 128 "
            "--max-num-seqs 512",
    "logprobs": SERIES["tqspec"]["logprobs"],
    "stress": "--min-band 200 --duration 240",
    "guard_stress": "--min-band 20 --duration 90",
    "steps": "--streams 1,16 --contexts 2048 --tokens 64 --reps 3",
    "steps_alone": True,
    "fallbacks": ("headroom",),
    "compare": (("tq-mtp-off", "tq-nomtp", "lp"), ("tq-mtp-on", "tq-nomtp", "lp")),
    "verdict": release_verdict,
    "continuation": "--trials 3 --prefix 1024 --cont 512 --fresh 2048 --max-tokens 4 --top 20",
    "items": [("tq-nomtp", f"--mtp 0 {CONTINUATION_BOOT}", ("logprobs", "continuation")),
              ("tq-mtp-on", "--mtp 3", ("logprobs", "stress")),
              ("tq-mtp-off", f"--mtp 3 --overlay-env VLLM_OVERLAY_DISABLE={TQSPEC_PATCH}", ("logprobs",)),
              ("awq-tq-mtp", "--model qwen36-35b-a3b-slice8-awq --mtp 3", ("stress",)),
              ("bf16-overlay", "--kv auto --mtp 0", ("steps",)),
              ("bf16-stock", "--config stock --kv auto --mtp 0", ("steps",)),
              # a fixed KV cache: side by side it boots beside busy servers, and it stops before its KV cache matters;
              # MTP 3: from vLLM 0.34.0 only the GDN layers on the fused spec-decode path (MTP) get the buffer
              ("forced-guard", "--config forced-guard --kv auto --mtp 3 --kv-bytes 2684354560", ("guard",)),
              ("tq-cont-off", f"--mtp 0 {CONTINUATION_BOOT} --overlay-env VLLM_OVERLAY_DISABLE={CONT_PATCH}",
               ("continuation",)),
              # the same sizes in the Qwen3.5-MoE class (Qwen3_5MoeForCausalLM, qwen3_5_mtp drafting): from vLLM
              # 0.34.0 its GDN layers (non-interleaved) take the fused spec-decode path with MTP, the one that still
              # zeros per forward, and on CUDA it runs eagerly with breakable CUDA graphs (no torch.compile)
              ("q35-tq-mtp", f"--model {QWEN35} --mtp 3 --spec-method mtp", ("stress",)),
              ("q35-forced-guard", f"--config forced-guard --model {QWEN35} --kv auto --mtp 3 --spec-method mtp "
                                   "--kv-bytes 2684354560", ("guard",))],
}


def series_status(labels: list[str]) -> tuple[list[str], bool]:
    lines, more = [], False
    for label in labels:
        st = series_state(label)
        mark = (st or {}).get("series", {})
        if st is None:
            refused = schedule.REFUSED
            lines.append(f"{label}: " + (f"FAILED: {refused[label]}" if label in refused else "not started"))
            more |= label not in refused
            continue
        phase = ("FAILED: " + mark["failed"] if mark.get("failed") else "done" if mark.get("done")
                 else "running" if alive(st["pid"]) else "not running")
        more |= not (mark.get("failed") or mark.get("done"))
        parts = [phase + (f", {mark['expected']}" if mark.get("expected") else ""),
                 f"healthy after {st.get('healthy_after_s')} s"]
        if "runner" in mark:
            parts.append(f"runner {'/'.join(mark['runner']) or 'unknown'}")
        steps = result_files(label).get("steps.json")
        if steps:
            points = ", ".join(f"{k} {v['step_ms']['median'] if v.get('step_ms') else None} ms"
                               + ("" if v.get("complete") else " (incomplete)")
                               for k, v in steps.get("points", {}).items())
            parts.append(f"steps: {points or '-'}; skipped {steps.get('skipped') or '-'}")
        elif "steps_rc" in mark:
            parts.append("steps: -")
        mem = result_files(label).get("memory.json")
        if mem:
            parts.append(f"memory phases done: {', '.join(mem.get('phases', {})) or '-'}"
                         + (f"; server died in {mem['server_died_in']}" if mem.get("server_died_in") else ""))
        elif "memory_rc" in mark:
            parts.append("memory: -")
        if "stress_rc" in mark or "guard_stress_rc" in mark:
            sv = stress_verdict(label)
            parts.append(f"stress {sv.get('verdict')}: {sv.get('band_forwards')} band forwards, requests ok / failed "
                         f"{sv.get('requests_ok')} / {sv.get('requests_failed')}, guard trips {sv.get('guard_trips')}")
        parts.append(f"logprobs rc {mark.get('logprobs_rc', '-')}")
        lines.append(f"{label}: " + "; ".join(parts))
    return lines, more


def series_compare(spec: dict[str, Any], labels: list[str]) -> None:
    """The series' logprob comparisons whose two runs are on this machine (merge records them), then its
    verdict over the labels on this machine."""
    pairs: dict[str, Any] = {}
    for x, y, lp in spec.get("compare", ()):
        paths = [os.path.join(sdir(v), f"{lp}.json") for v in (x, y)]
        if x not in labels or y not in labels or not all(os.path.exists(p) for p in paths):
            continue
        try:
            c = sm.compare_logprobs(json.load(open(paths[0])), json.load(open(paths[1])))
            say(f"series: logprobs {x} vs {y} ({lp}): {sm.describe_comparison(c)}")
        except (ValueError, KeyError) as exc:
            c = {"error": str(exc)}
            say(f"series: logprobs {x} vs {y} ({lp}): not comparable: {exc}")
        pairs[f"{x} vs {y} ({lp})"] = c
    if spec.get("verdict"):
        runs = {label: summarize(label) for label in labels if series_state(label) is not None}
        for line in spec["verdict"](runs, pairs):
            say(f"series: verdict: {line}")


def series_lock() -> Any:
    """One series at a time per state folder: two would both drive the labels they share (boots, traffic,
    stops). The open lock file, held until this process ends; exit 2 naming the holder when taken."""
    os.makedirs(server.STATE, exist_ok=True)
    path = os.path.join(server.STATE, "series.lock")
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        sys.exit(f"stack: series: another series is running on the state folder {server.STATE} ({holder}); "
                 "wait for it to end (its labels' servers are its own) or stop it first")
    f.truncate(0)
    f.write(f"pid {os.getpid()}, started {time.strftime('%H:%M:%S')}")
    f.flush()
    return f


def cmd_series(a: argparse.Namespace) -> int:
    from .cli import build_parser  # cli imports this module

    spec = SERIES[a.name]
    lock = series_lock()  # noqa: F841 - held while the series runs
    t_end = time.time() + a.deadline if a.deadline is not None else float("inf")
    items = series_items(spec)
    known = [label for label, _, _ in items]
    labels = [x.strip() for x in a.labels.split(",") if x.strip()] if a.labels else known
    unknown = [x for x in labels if x not in known]
    if unknown or not labels:
        sys.exit(f"stack: series {a.name} --labels {a.labels!r}: expected labels from {known}")
    gpus = [g.strip() for g in a.gpus.split(",")] if a.gpus else [None]
    for g in gpus:
        check_gpu(g)
    expect = spec.get("expect_runner") if a.expect_runner is None else (a.expect_runner or None)
    if expect not in (None, "V1", "V2"):
        sys.exit(f"stack: series {a.name} --expect-runner {a.expect_runner!r}: expected V1, V2 or '' (no check)")
    queues: list[list[tuple[str, list[str], tuple[str, ...]]]] = [[] for _ in gpus]
    by_label = {label: (boot, phases) for label, boot, phases in items}
    if a.stagger < 0 or a.fixed_kv is not None and a.fixed_kv < 1:
        sys.exit(f"stack: series {a.name}: --stagger {a.stagger} / --fixed-kv {a.fixed_kv}: expected seconds >= 0 "
                 "and a number of bytes >= 1")
    if a.fixed_kv and spec.get("profile_alone"):
        sys.exit(f"stack: series {a.name} --fixed-kv {a.fixed_kv}: not with this series (every server sizes its KV "
                 "cache by vLLM's profiling, which memory-headroom corrects); leave --fixed-kv out")
    if a.fixed_kv_mem is not None and not (0 < a.fixed_kv_mem <= 1 and a.fixed_kv):
        sys.exit(f"stack: series {a.name}: --fixed-kv-mem {a.fixed_kv_mem}: expected a fraction in (0, 1], "
                 "with --fixed-kv")
    first_on_gpu = {g: gpus.index(g) for g in gpus}  # the queue whose server profiles its KV cache alone
    device_fraction: dict[str, float] = {}  # label -> what the servers side by side on its GPU request together
    for i, label in enumerate(labels):
        boot, phases = by_label[label]
        port = str(a.base_port + known.index(label))
        q = i % len(gpus)
        share = gpus.count(gpus[q])  # servers side by side on this label's GPU
        # "mem_total": shared by the servers side by side on a GPU (--boot-extra's --mem still wins)
        mem = ["--mem", f"{spec['mem_total'] / share:.4g}"] if spec.get("mem_total") else []
        args = [*shlex.split(spec["boot"]), *mem, *shlex.split(boot), "--port", port, *shlex.split(a.boot_extra)]
        if spec.get("mem_total") and share > 1:
            device_fraction[label] = round(share * build_parser().parse_args(["boot", label, *args]).mem, 4)
        if a.fixed_kv and q != first_on_gpu[gpus[q]]:
            args += ["--kv-bytes", str(a.fixed_kv)]
            if a.fixed_kv_mem is not None:  # vLLM then checks only that this much is free at its start
                args += ["--mem", str(a.fixed_kv_mem)]
        queues[q].append((label, args, phases))
    # queues on one GPU start one after another (stagger_gate); each waits for the previous one's first label
    after: list[str | None] = [None] * len(gpus)
    for q, g in enumerate(gpus):
        before = [p for p in range(q) if gpus[p] == g and queues[p]]
        after[q] = queues[before[-1]][0][0] if before and queues[q] else None

    def args_of(key: str, given: str | None) -> list[str] | None:
        text = given if given is not None else spec.get(key)
        return None if text is None else shlex.split(text)

    opts: dict[str, Any] = {
        "steps": args_of("steps", a.steps), "stress": args_of("stress", a.stress),
        "memory": args_of("memory", a.memory),
        "memory_least_s": spec.get("least_budget_s", SERIES_MEMORY_LEAST_S),
        "guard_stress": args_of("guard_stress", a.guard_stress),
        "logprobs": None if a.no_logprobs else args_of("logprobs", a.logprobs),
        "continuation": args_of("continuation", None),
        "fallbacks": tuple(spec.get("fallbacks", ("headroom", "max-capture"))), "expect_runner": expect,
        "stagger": a.stagger, "steps_alone": bool(spec.get("steps_alone")),
        "profile_alone": bool(spec.get("profile_alone")) and len(set(gpus)) < len(gpus),
        "memory_by_label": {label: ([] if a.memory is not None else shlex.split(extra))
                            + (["--device-fraction", str(device_fraction[label])] if label in device_fraction else [])
                            for label, extra in {**{x: "" for x in labels}, **spec.get("memory_by_label", {})}.items()}}
    if opts["profile_alone"]:
        schedule.WINDOWS.stagger = a.stagger
        for q, g in zip(queues, gpus):  # the first boots are due from the start: no traffic before them
            if q and series_state(q[0][0]) is None:
                schedule.WINDOWS.expect(q[0][0], g)
    for key in ("stress", "guard_stress"):  # how long a stress may take: whether it starts before the deadline
        opts[f"{key}_s"] = build_parser().parse_args(["stress", "x", *(opts[key] or [])]).duration
    wanted = {p for label in labels for p in by_label[label][1]}
    lacking = sorted(p for p in wanted if p in ("steps", "stress", "memory") and opts[p] is None)
    if "guard" in wanted and opts["guard_stress"] is None:
        lacking.append("guard_stress")
    if lacking:
        sys.exit(f"stack: series {a.name}: its labels run {lacking} but the series gives no arguments for them")
    say(f"series {a.name}: {len(labels)} labels on GPU(s) {a.gpus or 'as visible'}"
        + (f" until {a.deadline:.0f} s from now" if a.deadline is not None else "")
        + (f", {expect} model runner expected" if expect else "") + ": "
        + "; ".join(f"GPU {g}: {', '.join(x for x, _, _ in q)}" for g, q in zip(gpus, queues))
        + (f"; servers side by side on one GPU start {a.stagger:.0f} s apart, each once the one before has sized "
           "its KV cache" if len(set(gpus)) < len(gpus) else "")
        + (f"; every server but the first on a GPU gets a fixed KV cache of {a.fixed_kv} bytes"
           + (f" and --mem {a.fixed_kv_mem}" if a.fixed_kv_mem is not None else "")
           if a.fixed_kv and len(set(gpus)) < len(gpus) else "")
        + (f"; utilization {spec['mem_total']} shared by the servers side by side on a GPU; one profiling window "
           "at a time there, no traffic or stop during one" if opts["profile_alone"] else ""))
    warm = warm_plan(spec, labels) if opts["profile_alone"] and not a.no_warm_up else []
    if warm:
        warm_up(a.name, [(x, args, g) for q, g in zip(queues, gpus) for x, args, _ in q if x in warm], t_end)
    threads = [threading.Thread(target=run_series_queue, args=(a.name, q, g, t_end, opts, after[i]),
                                name=f"series-q{i}-gpu{g}")
               for i, (g, q) in enumerate(zip(gpus, queues))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines, more = series_status(labels)
    for line in lines:
        say(f"series {a.name}: {line}")
    series_compare(spec, labels)
    refused, aborted = schedule.REFUSED, schedule.ABORTED
    if refused:
        say(f"series {a.name}: FAILED: {sorted(refused)}: a boot refused its arguments; fix them before running "
            "it again")
        return 2
    if aborted:
        say(f"series {a.name}: FAILED: {'; '.join(f'{k}: {v}' for k, v in aborted.items())}: the series stops "
            "here (every later label would build the same runner)")
        return 2
    say(f"series {a.name}: " + ("NOT DONE: run the same command again to go on" if more else "all done"))
    return 10 if more else 0
