"""A series' queue of labels on one GPU: each label's boot, the steps its item asks for within the
deadline, a second boot without what failed the first, the warm-up boots; the state that resumes it."""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

from .. import serve_measure as sm  # bench/serve_measure.py (stdlib only)
from .server import alive, compact, load_state, out_base, save_state, say, sdir, series_state, serve_log, wait
from .collect import overlay_reports, runner_evidence
from .measure import _complete, served_model
from .windows import GpuQuiet, GpuWindows, stagger_gate


PHASES = ("steps", "stress", "logprobs", "continuation", "guard", "memory")
REFUSED: dict[str, str] = {}  # labels whose boot never started, this process
ABORTED: dict[str, str] = {}  # labels that built another model runner than the series expects
SERIES_RESERVE_S = 45  # kept back from a label's steps for its logprobs and stop before the deadline
SERIES_ROUND_S = 40  # least budget to start steps with: one round of 16 x 32K (prefill + decode) fits
SERIES_WARMUP_S = 150  # ... before the boot's warm-up, which compiles the first verify steps' kernels
SERIES_STEPS_ATTEMPTS = 2
SERIES_STRESS_EXTRA_S = 90  # a stress takes up to --duration + its warm-up wave and report reads (stress's limit)
SERIES_MEMORY_LEAST_S = 100  # least budget to start the memory step with, unless the series says


def series_items(spec: dict[str, Any]) -> list[tuple[str, str, tuple[str, ...]]]:
    """(label, boot arguments, what runs once it serves) of each item; "do" is the series' default."""
    out = []
    for item in spec["items"]:
        label, boot = item[0], item[1]
        out.append((label, boot, tuple(item[2]) if len(item) > 2 else tuple(spec.get("do", ("steps", "logprobs")))))
    return out


def dispatch(argv: list[str]) -> int:
    """One step in this process; a usage error ends the step, not the series."""
    from .cli import main  # cli imports this module

    try:
        return main(argv)
    except SystemExit as exc:
        say(f"series: `{' '.join(argv[:2])}` stopped: {exc.code}")
        return exc.code if isinstance(exc.code, int) else 1


def series_mark(label: str, **kv: Any) -> None:
    st = load_state(label)
    st.setdefault("series", {}).update(kv)
    save_state(label, st)


def stress_verdict(label: str) -> dict[str, Any]:
    path = os.path.join(sdir(label), "stress", "stress.json")
    try:
        r = json.load(open(path))
    except (OSError, ValueError):
        return {}
    return {k: r.get(k) for k in ("verdict", "band_forwards", "requests_ok", "requests_failed", "guard_trips")}


WINDOWS = GpuWindows()
QUIET = GpuQuiet()


def traffic(label: str, gpu: str | None, t_end: float, argv: list[str]) -> int | None:
    """``dispatch(argv)`` as traffic of ``label`` on ``gpu`` (QUIET: not while a speed measurement runs
    alone there); None when the series' deadline came first."""
    if not QUIET.start(label, gpu, t_end):
        return None
    try:
        return dispatch(argv)
    finally:
        QUIET.end(label)


WARM_KV_BYTES = 4294967296  # a warm-up boot's fixed KV cache (4 GiB): no profiling, several fit side by side;
# 2.5 GiB held 774 Mamba blocks for the slice with MTP 3 on 0.33.0 (2026-12-04), fewer than vLLM's 1024 sequences
WARM_MEM = 0.05  # its --mem: with a fixed KV cache vLLM only checks that this much of the GPU is free at start
WARM_PORT_OFFSET = 100  # a warm-up boot serves on its label's port + this
WARM_BOOT_S = 900.0  # the longest a warm-up boot may take to serve


def compile_source(log_text: str) -> str:
    """Where a boot's compiled graphs came from, by vLLM's own log lines: "loaded from the cache",
    "compiled" (N graphs, M of them loaded), or "no compile line" (eager, or a log cut short)."""
    # 0.27.1: "Directly load the compiled graph(s) for compile range ..."; 0.33.0: "[backbone] Directly load
    # AOT compilation from path ..." (one line for the whole backbone)
    loaded = log_text.count("Directly load the compiled graph") + log_text.count("Directly load AOT compilation")
    compiled = log_text.count("Compiling a graph for")
    if compiled:
        return f"compiled ({compiled} graph(s) compiled, {loaded} loaded from the cache)"
    return "loaded from the cache" if loaded else "no compile line"


def warm_plan(spec: dict[str, Any], labels: list[str]) -> list[str]:
    """The labels whose configuration a warm-up boot compiles first: of each of the series' "warm_groups"
    (labels whose boots differ only in what vLLM's compile-cache key leaves out, so they share compiled
    graphs and Triton kernels), the first one asked for, while none of the group has booted. Empty when
    fewer than two groups need it: one cold compile is cheaper inside its own window than a warm-up boot
    and a warm window after it."""
    out = []
    for group in spec.get("warm_groups", ()):
        asked = [x for x in group if x in labels]
        if asked and all(series_state(x) is None for x in asked):
            out.append(asked[0])
    return out if len(out) >= 2 else []


def warm_up(name: str, plan: list[tuple[str, list[str], str | None]], t_end: float) -> None:
    """Boot each (label, boot arguments, GPU) of ``plan`` at once, side by side, with a fixed small KV cache
    (no memory profiling, so none of them moves another's KV size), send each one prompt of its
    max_num_batched_tokens (the prefill kernels' shapes), then stop them all. This fills vLLM's
    compile cache and Triton's kernel cache on this machine, so that the series' own boots of those
    configurations compile nothing in their profiling windows, which then run back to back faster.
    Said, with the wall time; a warm-up boot that fails is said and the series goes on (its label then
    compiles in its own window)."""
    from .cli import build_parser  # cli imports this module

    t0 = time.time()
    say(f"series {name}: warm-up: {', '.join(x for x, _, _ in plan)} boot side by side (fixed KV cache "
        f"{WARM_KV_BYTES} bytes, --mem {WARM_MEM}) to fill the compile caches before the profiling windows")
    booted = []
    for label, args, gpu in plan:
        port = str(build_parser().parse_args(["boot", label, *args]).port + WARM_PORT_OFFSET)
        w = f"warm-{label}"
        rc = dispatch(["boot", w, *args, "--port", port, "--kv-bytes", str(WARM_KV_BYTES), "--mem", str(WARM_MEM),
                       *(["--gpu", gpu] if gpu is not None else []), "--wait", "0"])
        if rc == 0 and series_state(w) is not None:
            booted.append(w)
        else:
            say(f"series {name}: warm-up of {label}: the boot did not start ({rc}); {label} compiles in its window")
    for w in booted:
        rc = wait(w, max(5.0, min(WARM_BOOT_S - (time.time() - t0), t_end - time.time() - 5)))
        st = load_state(w)
        if rc == 0:
            args = st.get("vllm_args") or {}
            n = max(16, min(int(args.get("mnbt") or 2048), int(args.get("max_model_len") or 1 << 30) - 4) - 16)
            try:
                _complete(st["port"], sm.prompt_ids(n, "warm-up"), 4, served_model(st))
                say(f"series {name}: {w}: served after {st.get('healthy_after_s')} s, one prompt of {n} tokens done")
            except Exception as exc:  # noqa: BLE001 - said; the compile cache is filled by the boot itself
                say(f"series {name}: {w}: served after {st.get('healthy_after_s')} s; its prompt of {n} tokens "
                    f"failed: {exc}")
        else:
            say(f"series {name}: {w}: did not serve ({'died' if rc == 1 else 'still booting'}); its label "
                "compiles in its window")
    for w in booted:
        dispatch(["stop", w])
    say(f"series {name}: warm-up done in {time.time() - t0:.0f} s")


# what one look at a label tells its queue: look again, leave the queue (the next run of the same command
# resumes it), or go on to the next label
AGAIN, LEAVE, NEXT_LABEL = "again", "leave", "next label"


def run_series_queue(name: str, items: list[tuple[str, list[str], tuple[str, ...]]], gpu: str | None,
                     t_end: float, opts: dict[str, Any], after: str | None = None) -> None:
    """Each label in turn on one GPU: boot, wait, what its item asks for (steps resumed by the next run
    when the deadline comes), stop; the next label's boot starts at once, so it goes on between runs.
    opts: steps/stress/guard_stress/logprobs/memory (argument lists, or None), memory_least_s, fallbacks,
    expect_runner, stagger. ``after``: the first label of the queue before this one on the same GPU,
    which this queue's first boot waits for (stagger_gate)."""
    for index, (label, boot_args, phases) in enumerate(items):
        while True:
            if ABORTED:
                return
            st = series_state(label)
            mark = (st or {}).get("series", {})
            if mark.get("done") or mark.get("failed"):
                break
            left = t_end - time.time()
            if left < 5:
                return
            if st is None:
                step = boot_label(name, label, boot_args, gpu, t_end, opts, after if index == 0 else None)
            else:
                step = look_at_label(name, label, boot_args, phases, gpu, t_end, opts, st, mark, left)
            if step == LEAVE:
                return
            if step == NEXT_LABEL:
                break


def boot_label(name: str, label: str, boot_args: list[str], gpu: str | None, t_end: float,
               opts: dict[str, Any], after: str | None) -> str:
    """The label's first boot, once the queue before it (``after``), its profiling window and a quiet GPU
    let it start; a boot that refused its arguments leaves nothing to resume."""
    if after is not None and not stagger_gate(after, opts["stagger"], t_end):
        return LEAVE
    if opts.get("profile_alone") and not WINDOWS.boot(label, gpu, t_end):
        return LEAVE
    if not QUIET.start(label, gpu, t_end):
        return LEAVE
    dispatch(["boot", label, *boot_args, *(["--gpu", gpu] if gpu is not None else []), "--wait", "0"])
    if series_state(label) is None:
        WINDOWS.unbooked(label, gpu)
        QUIET.end(label)
        REFUSED[label] = "boot refused its arguments (see above)"
        return NEXT_LABEL  # nothing to resume: the next label
    series_mark(label, series=name)
    return AGAIN


def look_at_label(name: str, label: str, boot_args: list[str], phases: tuple[str, ...], gpu: str | None,
                  t_end: float, opts: dict[str, Any], st: dict[str, Any], mark: dict[str, Any],
                  left: float) -> str:
    """A booted label: wait until it serves or dies, then the next thing its item asks for."""
    rc = wait(label, left - 5)
    if rc == 2:
        return LEAVE  # still booting: the next run waits on
    QUIET.end(label)  # booted or died
    booted = load_state(label).get("healthy_after_s") is not None
    if "runner" not in mark:  # the first time it serves or has died: which model runner it built
        return check_runner(label, opts)
    if "guard" in phases and (rc == 1 or "guard_stress_rc" in mark):
        return guard_outcome(label, rc, booted)
    if rc == 1:
        return boot_failed(name, label, boot_args, gpu, t_end, opts, mark, booted)
    if "guard" in phases:  # it serves: band traffic must meet the guard
        if t_end - time.time() < opts["guard_stress_s"] + SERIES_STRESS_EXTRA_S:
            return LEAVE
        say(f"series: {label}: it serves; band traffic next, which the forced buffer cannot hold")
        rc = traffic(label, gpu, t_end, ["stress", label, *opts["guard_stress"]])
        if rc is None:
            return LEAVE
        series_mark(label, guard_stress_rc=rc)
        return AGAIN
    return run_phases(label, phases, gpu, t_end, opts, st, mark)


def check_runner(label: str, opts: dict[str, Any]) -> str:
    """Which model runner the label's workers built (and how torch.compile went), marked; another one than
    the series expects stops the label and the series."""
    log_text = serve_log(label)
    ev, compiled = runner_evidence(sdir(label), log_text), compile_source(log_text)
    series_mark(label, runner=ev["built"], runner_from=ev["built_from"], compile=compiled)
    want = opts.get("expect_runner")
    say(f"series: {label}: model runner {'/'.join(ev['built']) or 'unknown'} "
        f"({ev['built_from'] or 'no overlay report names it, no V2 line in the log'})"
        + (f", {want} expected" if want else "") + f"; torch.compile: {compiled}")
    if want and ev["built"] and ev["built"] != [want]:
        why = f"its workers built the {'/'.join(ev['built'])} model runner, {want} expected"
        series_mark(label, failed=why)
        ABORTED[label] = why
        dispatch(["stop", label])
        return LEAVE
    return AGAIN


def guard_outcome(label: str, rc: int, booted: bool) -> str:
    """The forced buffer is expected to stop the server with the overlay's CapacityError: at boot, or
    under the band traffic sent once it served (its log says which, whether or not the API server process
    outlived the engine)."""
    when = "under band traffic" if booted else "at boot"
    reports = overlay_reports(sdir(label))
    no_buffer = any(r.get("runner") for r in reports) and not any(r.get("buffers") for r in reports)
    if runner_evidence(sdir(label), serve_log(label))["capacity_error"]:
        series_mark(label, expected=f"stopped {when} with the overlay's CapacityError (as expected)")
        dispatch(["stop", label])
        series_mark(label, done=True)
    elif booted and rc != 1 and no_buffer:
        # vLLM 0.34.0 allocates the GDN output itself on every path but the fused spec-decode kernel's, which
        # a model may not take (Qwen3-Next's layout falls back to Triton): then no layer holds the buffer
        series_mark(label, expected="served band traffic with no GDN layer on the overlay's buffer (its workers "
                                    "report no buffer: vLLM's path allocates the output itself): nothing to guard")
        dispatch(["stop", label])
        series_mark(label, done=True)
    else:
        series_mark(label, failed=(f"died {when} WITHOUT the overlay's CapacityError (see its log)"
                                   if rc == 1 else "served band traffic without the overlay's "
                                   "CapacityError: the guard did not stop it"))
        dispatch(["stop", label])
    return AGAIN


def boot_failed(name: str, label: str, boot_args: list[str], gpu: str | None, t_end: float,
                opts: dict[str, Any], mark: dict[str, Any], booted: bool) -> str:
    """A server that died or never served: marked failed, stopped, and booted once more without what
    stopped the boot where the series allows (boot_fallback)."""
    series_mark(label, failed="the server died" if booted else "boot failed")
    dispatch(["stop", label])  # whatever is left of it frees the GPU
    fallback = (None if booted or mark.get("retry")
                else boot_fallback(boot_args, serve_log(label), opts["fallbacks"]))
    if fallback is not None:
        # boot once more with the one thing that stopped it left out; the failed boot's state
        # and bundle are kept aside
        args, why = fallback
        put_aside(label, "failed-boot")
        say(f"series: {label}: boot failed {why}; booting again {why.replace('with ', 'without ', 1)}")
        if opts.get("profile_alone") and not WINDOWS.boot(label, gpu, t_end):
            return LEAVE
        if not QUIET.start(label, gpu, t_end):
            return LEAVE
        dispatch(["boot", label, *args, *(["--gpu", gpu] if gpu is not None else []), "--wait", "0"])
        if series_state(label) is not None:
            series_mark(label, series=name, retry=why.replace("with ", "without ", 1))
        else:
            WINDOWS.unbooked(label, gpu)
    return AGAIN


def run_phases(label: str, phases: tuple[str, ...], gpu: str | None, t_end: float, opts: dict[str, Any],
               st: dict[str, Any], mark: dict[str, Any]) -> str:
    """A serving label's phases in the series' order (steps, memory, then stress, logprobs and
    continuation), then its stop; ``mark`` is the label's series state as this look began."""
    steps_left = mark.get("steps_rc") != 0 and mark.get("steps_attempts", 0) < SERIES_STEPS_ATTEMPTS
    if "steps" in phases and steps_left:
        step = steps_phase(label, gpu, t_end, opts, st, mark)
        if step is not None:
            return step
    if "memory" in phases and mark.get("memory_rc") != 0:
        step = memory_phase(label, gpu, t_end, opts)
        if step is not None:
            return step
    step = traffic_phase(label, phases, gpu, t_end, opts, mark)
    if step is not None:
        return step
    return stop_phase(label, gpu, t_end, opts)


def steps_phase(label: str, gpu: str | None, t_end: float, opts: dict[str, Any], st: dict[str, Any],
                mark: dict[str, Any]) -> str | None:
    """`steps` within the deadline (alone on the GPU where the series asks); None: done, go on."""
    budget = t_end - time.time() - SERIES_RESERVE_S
    # a warm-up round is not cut by the budget and may compile kernels for minutes
    if budget < (SERIES_ROUND_S if st.get("warm_streams") else SERIES_WARMUP_S):
        return LEAVE
    if opts.get("steps_alone"):
        if not QUIET.alone(label, gpu, t_end):
            return LEAVE
        budget = t_end - time.time() - SERIES_RESERVE_S
        if budget < (SERIES_ROUND_S if st.get("warm_streams") else SERIES_WARMUP_S):
            QUIET.end_alone(label, gpu)
            return LEAVE
    try:
        rc = dispatch(["steps", label, *opts["steps"], *budget_args(budget)])
    finally:
        QUIET.end_alone(label, gpu)
    # steps cut short by the budget (3) is no attempt; done (0) or with failed points (4) is
    series_mark(label, steps_rc=rc, steps_attempts=mark.get("steps_attempts", 0) + (rc != 3))
    if rc not in (0, 3, 4):
        series_mark(label, failed=f"steps ended with {rc} (the server died?)")
        dispatch(["stop", label])
        return AGAIN
    if rc == 3:
        if t_end - time.time() < SERIES_RESERVE_S:
            return LEAVE
        return AGAIN
    return None


def memory_phase(label: str, gpu: str | None, t_end: float, opts: dict[str, Any]) -> str | None:
    """`memory` within the deadline (outside other servers' profiling windows); None: done, go on."""
    budget = t_end - time.time() - SERIES_RESERVE_S
    if budget < opts["memory_least_s"]:
        return LEAVE
    if opts.get("profile_alone") and not WINDOWS.traffic_start(label, gpu, t_end):
        return LEAVE
    if not QUIET.start(label, gpu, t_end):
        if opts.get("profile_alone"):
            WINDOWS.traffic_end(gpu)
        return LEAVE
    try:
        rc = dispatch(["memory", label, *opts["memory"], *opts["memory_by_label"].get(label, []),
                       *budget_args(t_end - time.time() - SERIES_RESERVE_S)])
    finally:
        QUIET.end(label)
        if opts.get("profile_alone"):
            WINDOWS.traffic_end(gpu)
    # cut short by the budget (3): the phases measured are kept and the next run goes on
    series_mark(label, memory_rc=rc)
    if rc not in (0, 3):
        series_mark(label, failed=f"memory ended with {rc} (the server died?)")
        dispatch(["stop", label])
        return AGAIN
    if rc == 3:
        if t_end - time.time() < SERIES_RESERVE_S:
            return LEAVE
        return AGAIN
    return None


def traffic_phase(label: str, phases: tuple[str, ...], gpu: str | None, t_end: float, opts: dict[str, Any],
                  mark: dict[str, Any]) -> str | None:
    """The next of stress, logprobs and continuation not run yet, in the item's order for stress and
    logprobs; None: all of them ran."""
    logprobs_first = ("logprobs" in phases and "stress" in phases
                      and phases.index("logprobs") < phases.index("stress")
                      and opts["logprobs"] is not None and "logprobs_rc" not in mark)
    if "stress" in phases and "stress_rc" not in mark and not logprobs_first:
        if t_end - time.time() < opts["stress_s"] + SERIES_STRESS_EXTRA_S:
            return LEAVE  # a stress is not resumable: it starts only with room for all of it
        rc = traffic(label, gpu, t_end, ["stress", label, *opts["stress"]])
        if rc is None:
            return LEAVE
        series_mark(label, stress_rc=rc, stress=stress_verdict(label))
        if not alive(load_state(label)["pid"]):
            series_mark(label, failed=f"the server died during the stress (exit {rc})")
            dispatch(["stop", label])
        return AGAIN
    for step in ("logprobs", "continuation"):  # one request phase each, resumable by its mark
        if step in phases and opts[step] is not None and f"{step}_rc" not in mark:
            if t_end - time.time() < 30:
                return LEAVE
            rc = traffic(label, gpu, t_end, [step, label, *opts[step]])
            if rc is None:
                return LEAVE
            series_mark(label, **{f"{step}_rc": rc})
            return AGAIN
    return None


def stop_phase(label: str, gpu: str | None, t_end: float, opts: dict[str, Any]) -> str:
    """The label's stop once all its phases ran, then it is done."""
    if t_end - time.time() < 20:
        return LEAVE
    if opts.get("profile_alone") and not WINDOWS.traffic_start(label, gpu, t_end):
        return LEAVE  # a stop frees memory: not during another server's profiling window
    try:  # nor during another's speed measurement alone on the GPU: the teardown loads the host
        rc = traffic(label, gpu, t_end, ["stop", label])
    finally:
        if opts.get("profile_alone"):
            WINDOWS.traffic_end(gpu)
    if rc is None:
        return LEAVE
    series_mark(label, done=True)
    return AGAIN


def budget_args(budget: float) -> list[str]:
    """A step's --budget-s for what is left before the series' deadline (none without a deadline)."""
    return ["--budget-s", f"{budget:.0f}"] if budget != float("inf") else []


HEADROOM_FAILED = "vllm-overlay memory-headroom: "


def boot_fallback(boot_args: list[str], log_text: str,
                  allowed: tuple[str, ...] = ("headroom", "max-capture")) -> tuple[list[str], str] | None:
    """The arguments of a second boot after a failed one, and what they leave out; None: no second boot.

    "headroom": a boot stopped by the overlay's memory-headroom patch (its measuring forward failed, or
    it left no KV block) boots again with VLLM_OVERLAY_MEMORY_HEADROOM=0, so that the other measurements
    still happen (that failure is a finding, kept in the failed boot's log). "max-capture": any other
    failed boot with --max-capture (the one setting tq-mtp-steps adds to the earlier TurboQuant + MTP
    boots) boots again with vLLM's own capture sizes. A series allows either or both."""
    if "headroom" in allowed and HEADROOM_FAILED in log_text and "HeadroomError" in log_text:
        return [*boot_args, "--overlay-env", "VLLM_OVERLAY_MEMORY_HEADROOM=0"], "with memory-headroom"
    if "max-capture" in allowed and "--max-capture" in boot_args:
        i = boot_args.index("--max-capture")
        return boot_args[:i] + boot_args[i + 2:], "with --max-capture"
    return None


def put_aside(label: str, tag: str) -> None:
    """A label's state folder (and, with --compact, its bundle in $OUT) renamed LABEL.TAG."""
    dst = f"{sdir(label)}.{tag}"
    shutil.rmtree(dst, ignore_errors=True)
    os.rename(sdir(label), dst)
    bundle = os.path.join(out_base(), f"{label}.json")
    if compact() and os.path.exists(bundle):
        os.replace(bundle, os.path.join(out_base(), f"{label}.{tag}.json"))
