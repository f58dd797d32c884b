"""The series' verdicts on merged runs: tqspec (the verify path off / on against no MTP), memory
(each server within its requested budget), release (TurboQuant + MTP, continuation, guard, decode)."""

from __future__ import annotations

import re
from typing import Any

from .server import NEXTN_METHODS
from .collect import runner_env


# tqspec: the verify steps' logprobs with turboquant-spec-decode off and on (the series in series.py)
TQSPEC_EQUAL = 0.004  # later tokens at most this far apart: equal (2 steps of the 35B's bf16 logit grid, 0.00195)
TQSPEC_DIFFERS = 0.01  # at least this far apart (or another top-1, or top-20 overlap below 15): differ
TQSPEC_PATCH = "turboquant-spec-decode"


def tqspec_role(run: dict[str, Any]) -> str | None:
    """'reference' (no MTP), 'off' (MTP, the patch disabled), 'on' (MTP, the patch on); with ' V2' when
    the server asked for Model Runner V2; None for stock vLLM. (Whether the run really is TurboQuant on
    the runner asked for, with drafts: tqspec_problems.)"""
    args = run.get("vllm_args") or {}
    if run.get("config") == "stock":
        return None
    disabled = TQSPEC_PATCH in (run.get("overlay_env") or {}).get("VLLM_OVERLAY_DISABLE", "").split(",")
    role = "off" if args.get("mtp") and disabled else "on" if args.get("mtp") else "reference"
    return role + (" V2" if run_runner(run) == "V2" else "")


def run_runner(run: dict[str, Any]) -> str:
    """The model runner a run asked for: VLLM_USE_V2_MODEL_RUNNER when the server had it, else the one its
    workers built (vLLM's default: V2 for every model from 0.29.0), else V1."""
    env = runner_env(run)
    if env is not None:
        return "V2" if env == "1" else "V1"
    built = (run.get("runner_evidence") or {}).get("built") or []
    return "V2" if built == ["V2"] else "V1"


def tqspec_problems(run: dict[str, Any], role: str) -> list[str]:
    """Why a run does not test what its role says (empty: it does)."""
    out = []
    kv = (run.get("vllm_args") or {}).get("kv_cache_dtype")
    if not str(kv).startswith("turboquant"):
        out.append(f"KV cache {kv}, not TurboQuant")
    want = "V2" if role.endswith("V2") else "V1"
    built = (run.get("runner_evidence") or {}).get("built") or []
    if built != [want]:
        out.append(f"its workers built the {'/'.join(built) or 'unknown'} model runner, {want} asked for")
    lp = (run.get("logprobs") or {}).get("lp")
    if run.get("healthy_after_s") is None:
        out.append("it never served (" + (run.get("failure_class") or "see its log") + ")")
    elif not lp:
        out.append("no logprobs")
    statuses = [(p.get("patches") or {}).get(TQSPEC_PATCH) for p in run.get("processes") or [] if p.get("runner")]
    counters = ((lp or {}).get("overlay") or {}).get("counters") or {}
    if role.startswith(("on", "off")):
        if lp and not (lp.get("spec_decode") or {}).get("drafts"):
            out.append("no drafts during its logprobs (no verify step ran)")
        if (run.get("vllm_args") or {}).get("spec_method") not in NEXTN_METHODS:
            out.append(f"drafter {(run.get('vllm_args') or {}).get('spec_method')}, not the model's MTP layer")
    if role.startswith("on"):
        if "applied" not in statuses:
            out.append(f"{TQSPEC_PATCH} applied in no worker ({statuses or 'no worker report'})")
        elif lp and not counters.get("tq_verify_as_decode_batches"):
            out.append("no verify batch went to the overlay's kernel during its logprobs")
    if role.startswith("off") and "applied" in statuses:
        out.append(f"{TQSPEC_PATCH} applied although disabled")
    return out


def tqspec_judge(c: dict[str, Any] | None) -> tuple[str, str]:
    """('equal' | 'differs' | 'unclear' | 'not comparable', why) for one run's logprobs against the reference."""
    if c is None:
        return "not comparable", "no comparison (a run without logprobs)"
    if c.get("error"):
        return "not comparable", c["error"]
    f, lt = c["first_token"], c["later_tokens"]
    errors = sum(1 for p in c["per_prompt"] if p.get("error"))
    if errors:
        return "not comparable", f"{errors} of {c['prompts']} prompts answered with an error"
    if f["top1_equal"] < f["positions"] or (f["max_abs_diff"] or 0) > TQSPEC_EQUAL:
        return "not comparable", (f"the first tokens (from the prefill, before any verify step) differ (top-1 equal "
                                  f"{f['top1_equal']}/{f['positions']}, max |diff| {f['max_abs_diff']}): the two "
                                  "servers differ in more than the verify path")
    if not lt["positions"]:
        return "not comparable", "no later tokens (ask for more than one)"
    why = (f"later tokens: {lt['positions']} positions, top-1 equal {lt['top1_equal']}, top-{c['k']} overlap >= "
           f"{lt['min_overlap']}, max |diff| {lt['max_abs_diff']:.3g}, same tokens on {c['same_tokens']}/{c['prompts']} "
           "prompts")
    if (lt["top1_equal"] < lt["positions"] or c["same_tokens"] < c["prompts"]
            or lt["max_abs_diff"] >= TQSPEC_DIFFERS or lt["min_overlap"] < 15):
        return "differs", why
    if lt["max_abs_diff"] <= TQSPEC_EQUAL and lt["min_overlap"] >= 18:
        return "equal", why
    return "unclear", why


def tqspec_verdict(runs: dict[str, dict[str, Any]], pairs: dict[str, Any]) -> list[str]:
    """Lines: each MTP run against the TurboQuant run without MTP (same runner's reference preferred, else
    V1's), what each run failed to test, and a conclusion per runner on vLLM's verify path and the patch's."""
    roles: dict[str, str] = {}
    for name, r in runs.items():
        role = tqspec_role(r)
        if role and role not in roles:
            roles[role] = name
    if not any(r.startswith(("on", "off")) for r in roles):
        return []
    out, state = [], {}
    for name, r in runs.items():  # stock vLLM with TurboQuant: does it boot on the runner asked for?
        if r.get("config") != "stock":
            continue
        runner = run_runner(r)
        if r.get("healthy_after_s") is None:
            errors = r.get("first_error_lines") or []
            raised = [x for x in errors if re.search(r"\b\w+(Error|Exception): ", x)]
            out.append(f"{name} (stock vLLM, TurboQuant, {runner}): died at boot: "
                       + ((raised[0].split("] ")[-1] if raised else "; ".join(errors[:2])) or "see its log"))
        else:
            out.append(f"{name} (stock vLLM, TurboQuant, {runner}): served after {r['healthy_after_s']} s")
    for role in ("reference", "reference V2", "off", "on", "off V2", "on V2"):
        name = roles.get(role)
        if name is None:
            continue
        problems = tqspec_problems(runs[name], role)
        if problems:
            out.append(f"{name} ({role}): NOT A TEST: {'; '.join(problems)}")
        if role.startswith("reference"):
            continue
        ref = roles.get("reference" + (" V2" if role.endswith("V2") else "")) or roles.get("reference")
        if ref is None:
            state[role] = "no reference"
            out.append(f"{name} ({role}): no TurboQuant run without MTP to compare with")
            continue
        if runs[name].get("healthy_after_s") is None:
            state[role] = "died at boot"
            out.append(f"{name} ({role}): died at boot: {runs[name].get('failure_class') or '-'}; "
                       f"{'; '.join((runs[name].get('first_error_lines') or [])[:2])}")
            continue
        c = pairs.get(f"{name} vs {ref} (lp)")
        verdict, why = tqspec_judge(c)
        graphs = runs[name].get("graph_captures")
        if graphs is not None:
            why += "; " + (", ".join(g.removeprefix("Capturing CUDA graphs ") for g in graphs) or "no CUDA graph")
            why += " captured"
        if problems or tqspec_problems(runs[ref], tqspec_role(runs[ref]) or "reference"):
            verdict, why = "not a test", f"the comparison alone: {verdict}; {why}"
        state[role] = verdict
        out.append(f"{name} vs {ref}: {verdict.upper()} ({why})")
    for runner in ("", " V2"):
        off, on = state.get("off" + runner), state.get("on" + runner)
        if off is None and on is None:
            continue
        head = f"conclusion ({runner.strip() or 'V1'}): "
        if on == "differs":
            out.append(head + f"the PATCH GIVES OTHER LOGITS than TurboQuant without MTP on this release "
                       f"({TQSPEC_PATCH} on)")
        elif off == "differs" and on == "equal":
            out.append(head + "CONFIRMED: stock vLLM's verify steps on TurboQuant give other logits than no MTP, "
                       "with no error; the patch's match: the need read from the sources holds on this release")
        elif off == "died at boot" and on == "equal":
            out.append(head + "CONFIRMED DIFFERENTLY: stock vLLM with MTP on TurboQuant dies at boot on this release "
                       "(as on 0.20.x), not silently wrong; the patch serves and matches no MTP")
        elif off == "equal" and on == "equal":
            out.append(head + "REFUTED: stock vLLM's verify steps match no MTP on this release: the source reading "
                       "(replays attend to the new tokens only) does not hold here; the patch matches too")
        elif off is None and on == "no reference":
            out.append(head + "not tested by this run: its labels have no TurboQuant run without MTP to compare "
                       f"with, nor one with {TQSPEC_PATCH} off")
        else:
            out.append(head + f"none yet (stock path: {off or 'not run'}; the patch: {on or 'not run'})")
    return out


def memory_verdict(runs: dict[str, dict[str, Any]], pairs: dict[str, Any]) -> list[str]:
    """Per run: the runner its workers built, memory-headroom's KV tokens (given up, or would give up in a dry
    run), and per phase requests, out-of-memory, and each worker's peak against what was reserved."""
    out = []
    for name, r in runs.items():
        m = r.get("memory") or {}
        runner = "/".join((r.get("runner_evidence") or {}).get("built") or []) or "unknown runner"
        recs = [x for w in (m.get("headroom") or {}).values() for x in w.get("records", [])]
        h = recs[0] if recs else {}
        mode = ("dry run (vLLM's sizing)" if h.get("dry_run") else "memory-headroom") if h else "not measured"
        if h:
            mode += (f", KV tokens {h.get('kv_tokens_before')} -> {h.get('kv_tokens_after')} "
                     f"({(h.get('kv_tokens_before') or 0) - (h.get('kv_tokens_after') or 0)} "
                     f"{'would be ' if h.get('dry_run') else ''}given up"
                     + (f", {h['moved'] / 2**30:.3f} GiB" if h.get("moved") is not None else "") + ")")
        parts = []
        for ph_name, ph in m.get("phases", {}).items():
            wins = [(w.get("window") or {}, w.get("whole_process")) for w in (ph.get("workers") or {}).values()]
            peaks = "; ".join(f"peak {x['runtime_peak'] / 2**30:.3f} GiB, {'OVER' if x['over_budget'] > 0 else 'within'}"
                              f" the reservation by {abs(x['over_budget']) / 2**30:.3f}"
                              + (" (the whole process's resident set, not an allocator peak)" if whole else "")
                              for x, whole in wins if "runtime_peak" in x) or "no window"
            parts.append(f"{ph_name} {ph.get('requests_ok')} ok / {ph.get('requests_failed')} failed, "
                         f"{'OUT OF MEMORY, ' if ph.get('oom') else ''}{'' if ph.get('server_alive') else 'DEAD, '}{peaks}")
        state = ("never served: " + str(r.get("failure_class") or "-") if r.get("healthy_after_s") is None
                 else "; ".join(parts) or "no phase measured")
        out.append(f"{name} ({runner}, {mode}): {state}")
    dev = device_peak_line(runs)
    return out + ([dev] if dev else [])


def device_peak_line(runs: dict[str, dict[str, Any]]) -> str | None:
    """The device's used memory (nvidia-smi, every process on the GPU) at its highest over the phases of
    all runs, against the fraction the series asked for (mem_total x total): servers side by side share
    one GPU, so this is one figure for them all. Each process's CUDA context lies outside vLLM's budgets."""
    worst = None
    for name, r in runs.items():
        for ph_name, ph in ((r.get("memory") or {}).get("phases") or {}).items():
            for gpu, peak in (ph.get("device_peak_mib") or {}).items():
                req = (ph.get("device_requested_mib") or {}).get(gpu)
                total = (ph.get("device_total_mib") or {}).get(gpu)
                if req and total and (worst is None or peak > worst[0]):
                    worst = (peak, req, total, gpu, f"{name} {ph_name}")
    if worst is None:
        return None
    peak, req, total, gpu, where = worst
    return (f"device (GPU {gpu}, every process on it): peak {peak} MiB of {total} MiB, "
            f"{'OVER' if peak > req else 'within'} the requested {req} MiB by {abs(peak - req)} MiB "
            f"(during {where}); each process's CUDA context lies outside every server's budget")


RELEASE_TQ_LABELS = ("tq-nomtp", "tq-mtp-on", "tq-mtp-off")
CONT_PATCH = "turboquant-prefill-continuation"
# the continuation step empties the prefix cache between phases (vLLM's dev endpoint) and reads cached tokens
CONTINUATION_BOOT = "--env VLLM_SERVER_DEV_MODE=1 --extra=--enable-prompt-tokens-details"


def continuation_lines(runs: dict[str, dict[str, Any]]) -> list[str]:
    """One line per continuation trial: the request that continues from cached context, pair vs alone, with
    turboquant-prefill-continuation on (the patch's counter during the pair) or off."""
    out = []
    for name, r in runs.items():
        brief = r.get("continuation")
        if not brief:
            continue
        off = CONT_PATCH in " ".join(str(v) for v in (r.get("overlay_env") or {}).values())
        for t in brief.get("trials") or []:
            head = f"continuation {name} ({CONT_PATCH} {'off' if off else 'on'}) trial {t.get('trial')}"
            if t.get("errors"):
                out.append(f"{head}: ERROR {t['errors'][0]}")
                continue
            c, f = t["cont_vs_alone"]["first_token"], t["fresh_vs_alone"]["first_token"]
            ov = (t.get("pair_overlay") or {})
            avoided = (ov.get("counters") or {}).get("tq_prefill_fast_path_avoided", 0)
            out.append(f"{head}: cached tokens {t.get('cached_tokens')}; continuing request, pair vs alone: top-1 "
                       f"{c['top1_equal']}/{c['positions']}, top-20 overlap >= {c['min_overlap']}, max |diff| "
                       f"{c['max_abs_diff']}; fresh request: max |diff| {f['max_abs_diff']}; fast path avoided "
                       f"during the pair: {avoided}; forwards {ov.get('top_forward_sizes')}")
    return out


def release_verdict(runs: dict[str, dict[str, Any]], pairs: dict[str, Any]) -> list[str]:
    """tqspec's lines over the TurboQuant runs of the slice, then one line per other question of the series:
    each band stress, the forced guard, and decode overlay vs stock (medians of the reps, one boot each)."""
    out = tqspec_verdict({n: r for n, r in runs.items() if n in RELEASE_TQ_LABELS}, pairs)
    for name, r in runs.items():
        mark = r.get("series") or {}
        runner = "/".join((r.get("runner_evidence") or {}).get("built") or []) or "unknown runner"
        model = str((r.get("vllm_args") or {}).get("model"))
        weights = ("Qwen3.5-MoE class, " if "qwen35moe" in model else "") + ("AWQ 4-bit" if "awq" in model else "bf16")
        guard = name == "forced-guard" or r.get("config") == "forced-guard"  # expected to stop with CapacityError
        if r.get("healthy_after_s") is None and not guard:
            out.append(f"{name} ({weights} weights, {runner}): never served: {r.get('failure_class') or '-'}; "
                       + "; ".join((r.get("first_error_lines") or [])[:2]))
            continue
        sv = r.get("stress")
        if sv and not guard:
            ev = r.get("runner_evidence") or {}
            band = sv.get("band") or ["?", "?"]
            out.append(f"{name} ({weights} weights, {runner}): band stress {sv.get('verdict')}: {sv.get('band_forwards')} "
                       f"forwards in ({band[0]}, {band[1]}], requests ok / failed {sv.get('requests_ok')} / "
                       f"{sv.get('requests_failed')}, largest forward {sv.get('max_forward')}, guard checks / trips "
                       f"{ev.get('guard_checks')} / {ev.get('guard_trips')}, telemetry from the workers: "
                       f"{'yes' if ev.get('telemetry_fired') else 'NO'}")
        if guard:
            out.append(f"{name} ({runner}): " + (mark.get("expected") or ("FAILED: " + mark["failed"] if
                                                       mark.get("failed") else "not finished")))
    out.extend(continuation_lines(runs))
    ov, st = runs.get("bf16-overlay", {}).get("steps"), runs.get("bf16-stock", {}).get("steps")
    if ov and st:
        for key in ov.get("points", {}):
            a, b = ov["points"][key].get("step_ms"), (st.get("points", {}).get(key) or {}).get("step_ms")
            if not (a and b and a.get("median") and b.get("median")):
                out.append(f"decode {key} (bf16 KV): not measured on both")
                continue
            out.append(f"decode {key} (bf16 KV, no MTP): overlay {a['median']:.3f} ms ({a.get('min')}-{a.get('max')}, "
                       f"n={a.get('n')}), stock {b['median']:.3f} ms ({b.get('min')}-{b.get('max')}, n={b.get('n')}): "
                       f"stock / overlay {b['median'] / a['median']:.3f}")
    return out
