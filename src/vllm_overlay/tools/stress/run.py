"""Run a stress: plan, print the plan, send traffic, read telemetry, judge, write outputs."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

from vllm_overlay import settings
from vllm_overlay.budget import BUDGET_SETTINGS
from vllm_overlay.tools.output import Out
from vllm_overlay.tools.progress import Ticker
from vllm_overlay.reports import Scan, scan, shared_line
from vllm_overlay.tools.stress import metrics_text
from vllm_overlay.tools.stress import plan as planmod
from vllm_overlay.tools.stress.plot import forward_sizes_png
from vllm_overlay.tools.stress.target import ServerError
from vllm_overlay.tools.stress.verdict import BAD_USAGE, DID_NOT_TEST, NAMES, SLOW_FACTOR, UNREACHABLE, Outcome, judge, sizes_delta
from vllm_overlay.telemetry import in_band, merge_sizes


@dataclass
class Options:
    model: str | None = None
    url: str | None = None
    allow_remote: bool = False
    band: tuple[int, int] | None = None
    min_band_forwards: int = 10
    requests: int | None = None
    duration: float | None = None
    out: str = "stress-out"
    report_dir: str | None = None  # server mode: the server's VLLM_OVERLAY_REPORT_DIR
    server_id: str | None = None  # server mode: the server's VLLM_OVERLAY_SERVER_ID (else from /metrics)
    telemetry: str = "auto"  # server mode: "reports", "metrics" (the server's /metrics) or "auto"
    api_key: str | None = None  # server mode: the server's --api-key (never written to stress.json)
    seed: int = 0
    engine_args: dict[str, Any] = field(default_factory=dict)
    allow_partial_band: bool = False  # PASSED without a forward in the band's top quarter (said in the verdict)


def default_band(mnbt: int, server_cap: int | None = None) -> tuple[int, int]:
    """(profile cap, or an explicit budget below mnbt, or mnbt // 2 ; mnbt]. Over HTTP the cap is
    the server's own (``server_cap``, from its reports or /metrics) when the server names it."""
    cap = int(settings.value("VLLM_OVERLAY_PROFILE_RUN_CAP")) if server_cap is None else server_cap
    if 0 < cap < mnbt:
        return cap, mnbt
    for name in BUDGET_SETTINGS:
        r = settings.resolve(name)
        if r.is_set and int(r.value) < mnbt:
            return int(r.value), mnbt
    return mnbt // 2, mnbt


def summary_rows(result: dict[str, Any]) -> list[list[str]]:
    def fmt(v: Any) -> str:
        return "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))

    lo, hi = result["band"]
    quarters = {f"_q{q['quarter']}": q["forwards"] for q in result.get("band_quarters") or []}
    return [[label, fmt(quarters[key] if key in quarters else result.get(key))] for label, key in (
        (f"band forwards in ({lo}, {hi}]", "band_forwards"), ("forwards (all)", "forwards"),
        ("max forward size", "max_forward"), ("max forward / HI", "max_forward_share_of_hi"),
        *((f"band quarter {q['quarter']} ({q['range'][0]}, {q['range'][1]}]", f"_q{q['quarter']}")
          for q in result.get("band_quarters") or []),
        ("guard fallbacks (trips)", "guard_trips"),
        ("requests ok", "requests_ok"), ("requests failed", "requests_failed"),
        ("generated tokens/s", "tokens_per_s"), ("p50 TTFT of band prefills (s)", "ttft_p50_s"),
        ("p99 TTFT of band prefills (s)", "ttft_p99_s"), ("warm-up wave, before the clock (s)", "warmup_s"),
        ("timed waves", "waves_timed"), ("of them top-up waves", "waves_topup"), ("median wave (s)", "wave_s_median"), ("wall after warm-up (s)", "wall_s"),
    )]


def execute(opts: Options, out: Out | None = None) -> dict[str, Any]:
    """Run one stress; returns the result dict (``exit_code`` says the verdict)."""
    out = out or Out()
    try:
        make_out_dir(opts.out)
    except OSError as exc:
        out.line(f"bad usage: --out {opts.out!r}: cannot be a folder for stress.json ({exc.strerror or exc})",
                 "error")
        return {"exit_code": BAD_USAGE, "verdict": NAMES[BAD_USAGE], "why": f"--out {opts.out!r}: {exc}"}
    try:
        return _execute(opts, out)
    except planmod.UsageError as exc:
        out.line(f"bad usage: {exc}", "error")
        return _early_result(opts, out, BAD_USAGE, str(exc))
    except ServerError as exc:
        out.line(f"{NAMES[UNREACHABLE]}: {exc}", "error")
        return _early_result(opts, out, UNREACHABLE, str(exc))


def _early_result(opts: Options, out: Out, code: int, why: str) -> dict[str, Any]:
    """The result of a run that sent no traffic (bad usage, no usable server), in stress.json too."""
    result = {"exit_code": code, "verdict": NAMES[code], "why": why,
              "mode": "offline" if opts.model else "server", "target": opts.model or opts.url}
    result["json"] = os.path.abspath(os.path.join(opts.out, "stress.json"))
    try:
        with open(result["json"], "w") as f:
            json.dump(result, f, indent=1)
        out.line(f"wrote {result['json']}")
    except OSError as exc:
        out.line(f"could not write {result['json']}: {exc}", "error")
    return result


def make_out_dir(path: str) -> None:
    """Create the output folder with a .gitignore of its own (``*``), so that a run inside a git
    checkout never leaves untracked files behind, wherever the user runs it."""
    os.makedirs(path, exist_ok=True)
    marker = os.path.join(path, ".gitignore")
    if not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write("# written by vllm-overlay: run outputs, not sources\n*\n")


def with_chunking(limits: planmod.Limits, cfg: dict[str, Any], source: str) -> planmod.Limits:
    """The limits with the scheduler's chunking and speculative tokens from an engine config
    (``block_size``, ``mamba_cache_mode``, ``num_speculative_tokens``), where it names them."""
    from dataclasses import replace

    block = cfg.get("block_size")
    if not isinstance(block, int) or block <= 0:
        return limits
    spec = cfg.get("num_speculative_tokens")
    return replace(limits, block_size=block, mamba_aligned=cfg.get("mamba_cache_mode") == "align",
                   spec_tokens=spec if isinstance(spec, int) and spec > 0 else 0, chunking_source=source)


def engine_chunking(llm: Any) -> dict[str, Any]:
    """block_size, mamba_cache_mode and num_speculative_tokens of an in-process engine ({} if unread)."""
    try:
        cfg = llm.llm_engine.vllm_config
        spec = getattr(cfg, "speculative_config", None)
        return {"block_size": int(cfg.cache_config.block_size),
                "mamba_cache_mode": str(getattr(cfg.cache_config, "mamba_cache_mode", "none")),
                "num_speculative_tokens": int(getattr(spec, "num_speculative_tokens", 0) or 0)}
    except Exception:  # noqa: BLE001 - an engine without these fields: the nominal plan stands
        return {}


def plan_vs_seen(plan: planmod.Plan, sizes: dict[int, int], exact: bool) -> list[str]:
    """A line for each planned forward size that no forward of the run had, saying why it can differ."""
    if not exact:
        return []
    lines = []
    for sh in plan.shapes:
        if sizes.get(sh.forward):
            continue
        near = [s for s in sizes if plan.lo < s <= plan.hi]
        seen = f"band forwards seen: {min(near)}..{max(near)}" if near else "no band forward seen"
        lines.append(f"planned forward {sh.forward} ({len(sh.prompts)} prompts) not seen ({seen}): over HTTP a "
                     "wave's prompts can reach the engine in different steps, and a decode stream's renewal "
                     "or a speculative token can share the step")
    return lines


def _limits_offline(engine_args: dict[str, Any]) -> planmod.Limits:
    """The plan's limits; the engine gets the same values, so the two can never disagree."""
    engine_args.setdefault("max_num_batched_tokens", 8192)
    engine_args.setdefault("max_model_len", 8192)
    engine_args.setdefault("max_num_seqs", 64)
    return planmod.Limits(
        max_num_batched_tokens=int(engine_args["max_num_batched_tokens"]),
        max_model_len=int(engine_args["max_model_len"]),
        max_num_seqs=int(engine_args["max_num_seqs"]),
        prefill_chunk_clamp=int(settings.value("VLLM_OVERLAY_PREFILL_CHUNK_CLAMP")),
    )


def _execute(opts: Options, out: Out) -> dict[str, Any]:
    if bool(opts.model) == bool(opts.url):
        raise planmod.UsageError("give exactly one of --model DIR (offline) or --url URL (server)")
    if opts.min_band_forwards < 1:
        raise planmod.UsageError(f"--min-band-forwards {opts.min_band_forwards}: expected an integer >= 1")
    if opts.requests is not None and opts.requests < 1:
        raise planmod.UsageError(f"--requests {opts.requests}: expected an integer >= 1")
    if opts.duration is not None and not (math.isfinite(opts.duration) and opts.duration > 0):
        raise planmod.UsageError(f"--duration {opts.duration}: expected seconds > 0")
    first: metrics_text.Scrape | None = None  # server mode, telemetry from /metrics: the scrape before traffic
    sid: str | None = None  # server mode: the server id its reports must carry
    not_counted: list[dict[str, Any]] = []
    server_cap: int | None = None
    if opts.model:
        if not os.path.isfile(os.path.join(opts.model, "config.json")):
            raise planmod.UsageError(f"--model {opts.model!r}: no config.json in that directory")
        limits = _limits_offline(opts.engine_args)
        report_dir = os.path.abspath(os.path.join(opts.out, "reports"))
    else:
        from vllm_overlay.tools.stress import server

        from vllm_overlay.tools.stress import target as targetmod

        base = server.check_url(opts.url or "", opts.allow_remote)
        preflight_end = time.monotonic() + targetmod.PREFLIGHT_S
        tgt = targetmod.probe(base, opts.api_key, preflight_end)
        first = _metrics_first(opts, tgt)
        sid = _server_id(opts, tgt)
        if first is not None:
            report_dir = f"{base}/metrics"
            live = dict(first.engine_config)
            if first.servers > 1:
                raise planmod.UsageError(_shared_refusal(sid, f"{base}/metrics counts {first.servers} live servers"))
        else:
            report_dir = opts.report_dir or settings.value("VLLM_OVERLAY_REPORT_DIR")
            if sid is None:
                raise planmod.UsageError(
                    f"cannot tie the reports in {report_dir} to the server at {base}: its /metrics names no "
                    "server id (no vllm_overlay_ series); pass --server-id ID (the server's "
                    "VLLM_OVERLAY_SERVER_ID, written in each of its reports)")
            found = scan(report_dir, server=sid, live=True) if os.path.isdir(report_dir) else Scan()
            if (line := shared_line(sid, found.servers())) is not None:
                raise planmod.UsageError(_shared_refusal(sid, line))
            not_counted = _name_not_counted(out, report_dir, sid, found)
            live = {}
            for rep in sorted(found.reports, key=lambda r: r.get("written", 0)):
                live.update(rep.get("engine_config") or {})
        limits = with_chunking(server_limits(report_dir, opts.engine_args, live), live,
                               "the server's engine config")
        if isinstance(live.get("profile_run_cap"), int):
            server_cap = int(live["profile_run_cap"])
    lo, hi = opts.band or default_band(limits.max_num_batched_tokens, server_cap)
    if not opts.model and first is not None:
        _check_band_edges(lo, hi, first)
    plan = planmod.make_plan(lo, hi, limits, opts.min_band_forwards, opts.requests)
    out.line(f"plan{' (before the boot: nominal chunking)' if opts.model else ''}: {plan.describe()}")
    out.line(f"limits: max_num_batched_tokens {limits.max_num_batched_tokens}, max_model_len "
             f"{limits.max_model_len}, max_num_seqs {limits.max_num_seqs}; "
             f"{'telemetry' if first is not None else 'reports'}: {report_dir}")

    boot_s = None
    since = time.time()
    if opts.model:
        from vllm_overlay.tools.stress import offline

        os.makedirs(report_dir, exist_ok=True)
        os.environ["VLLM_OVERLAY_REPORT_DIR"] = report_dir  # inherited by the engine's processes
        out.line(f"booting vLLM on {opts.model} ...")
        t0 = time.perf_counter()
        try:
            llm = offline.build_engine(opts.model, opts.engine_args)
        except Exception as exc:  # noqa: BLE001 - a failed boot is a failed run, with its error
            outcome = Outcome(engine_error=f"boot failed: {type(exc).__name__}: {exc}")
            llm = None
        boot_s = time.perf_counter() - t0
        if llm is not None and (chunking := engine_chunking(llm)):
            try:
                plan = planmod.make_plan(lo, hi, with_chunking(limits, chunking, "the engine's config"),
                                         opts.min_band_forwards, opts.requests)
                out.line(f"plan (from the engine's chunking): {plan.describe()}")
            except planmod.UsageError as exc:
                out.line(f"plan kept as printed: the engine's chunking ({chunking}) allows no other ({exc})",
                         "warning")
        before: dict[int, int] = {}
    elif first is None:
        before = merge_sizes(scan(report_dir, server=sid, live=True).reports) if os.path.isdir(report_dir) else {}

    out.line("one warm-up wave first (kernels compile on first use); the clock starts after it")

    with Ticker(out, plan.waves, "band waves") as tick:
        def after_warmup() -> None:
            # forwards of the warm-up wave are not the run's: snapshot telemetry once it has flushed
            nonlocal before, first
            tick.note(f"warm-up wave done after {time.perf_counter() - t_warm:.1f} s (decode streams started, "
                      "one wave served); timed waves start now")
            if first is not None:
                time.sleep(2.5)  # the workers' reports flush within a second; /metrics reads them
                try:
                    first = metrics_text.scrape(base, timeout=10, api_key=opts.api_key)
                except (OSError, ValueError) as exc:  # the server died after the warm-up: the waves fail
                    tick.note(f"cannot read {base}/metrics after the warm-up: {exc}")
            else:
                before = merge_sizes(_read_reports(report_dir, since if not opts.model else None, sid))

        t_warm = time.perf_counter()
        if opts.model:
            if llm is not None:
                outcome = offline.run(llm, plan, opts.duration, opts.seed, tick, after_warmup)
                _shutdown(llm)
        else:
            from vllm_overlay.tools.stress import server

            def band_count() -> int:
                # band forwards since the warm-up, read as the verdict will read them
                try:
                    if first is not None:
                        return (metrics_text.scrape(base, timeout=10, api_key=opts.api_key).band(lo, hi)
                                - first.band(lo, hi))
                except (OSError, ValueError, KeyError) as exc:  # no top-up; the verdict says why
                    tick.note(f"cannot read {base}/metrics for the band count: {exc}")
                    return opts.min_band_forwards
                now = merge_sizes(scan(report_dir, since, sid, live=True).reports if os.path.isdir(report_dir) else [])
                return in_band(sizes_delta(before, now), lo, hi)

            # --requests fixes the traffic; otherwise waves are added until the band is reached
            def top_count() -> int:
                # forwards of this run in the band's top quarter, read as the verdict will read them
                q3 = planmod.quarter_edges(lo, hi)[3]
                try:
                    if first is not None:
                        now = metrics_text.scrape(base, timeout=10, api_key=opts.api_key)
                        if q3 in now.buckets and q3 in first.buckets:
                            return now.band(q3, hi) - first.band(q3, hi)
                        return int(now.max_forward > max(first.max_forward, q3))
                except (OSError, ValueError, KeyError):
                    return 1  # no top-up on an unreadable /metrics; the verdict says what it saw
                now_sizes = merge_sizes(scan(report_dir, since, sid).reports if os.path.isdir(report_dir) else [])
                return in_band(sizes_delta(before, now_sizes), q3, hi)

            topup = None if opts.requests is not None else server.TopUp(
                band_count, opts.min_band_forwards, tick.note,
                None if opts.allow_partial_band else top_count)
            outcome = server.run(base, plan, opts.duration, opts.seed, tick,
                                 alive=lambda: server.health_error(base, opts.api_key), after_warmup=after_warmup,
                                 topup=topup, api_key=opts.api_key, preflight_end=preflight_end)
    if first is None:
        final = _read_scan(report_dir, since if not opts.model else None, sid)
        reports = final.reports
        if sid is not None:  # server mode: name what another server wrote during the run, once
            named = {o["path"] for o in not_counted}
            late = Scan(foreign=[r for r in final.foreign if r["_path"] not in named],
                        skipped={p: w for p, w in final.skipped.items() if p not in named})
            not_counted += _name_not_counted(out, report_dir, sid, late)
        sizes = sizes_delta(before, merge_sizes(reports))
        budgets = [b["rows"] for r in reports for b in r.get("buffers", [])]
        result = judge(lo, hi, opts.min_band_forwards, sizes, outcome, reports, opts.allow_partial_band)
        if sid is not None and (line := shared_line(sid, final.servers())) is not None:
            _not_judged(result, _shared_refusal(sid, line))
    else:
        reports, sizes, budgets, max_forward, exact, servers_n = _read_metrics(base, first, opts.api_key)
        result = judge(lo, hi, opts.min_band_forwards, sizes, outcome, reports, opts.allow_partial_band,
                       bucket_edges=sorted(first.buckets), max_forward=max_forward if exact else None)
        if servers_n > 1:
            _not_judged(result, _shared_refusal(sid, f"{base}/metrics counted {servers_n} live servers after the run"))
        # /metrics has buckets, not sizes: `sizes` maps each bucket's upper edge to its forwards.
        # The band count is exact (the band's edges are bucket edges, checked before traffic);
        # the largest forward is exact when it grew during this run, else an upper bound (the
        # smaller of its bucket's upper edge and the largest forward since the server started).
        result["sizes_are_bucket_edges"] = True
        result["max_forward_exact"] = exact
        result["max_forward"] = max_forward
    cap = int(settings.value("VLLM_OVERLAY_PROFILE_RUN_CAP")) or None
    result.update({
        "mode": "offline" if opts.model else "server",
        "telemetry": "metrics" if first is not None else "reports",
        "target": opts.model or opts.url,
        "plan": plan.to_json(),
        "limits": limits.__dict__,
        "boot_s": round(boot_s, 2) if boot_s is not None else None,
        "gdn_buffer_rows": min(budgets) if budgets else None,
        "profile_cap": cap,
        "report_dir": report_dir,
        "server_id": sid,
        "reports_not_counted": not_counted,
        "engine_args": opts.engine_args,
    })
    result["plan_vs_seen"] = plan_vs_seen(plan, sizes, first is None)
    png = os.path.join(opts.out, "forward_sizes.png")
    forward_sizes_png(png, sizes, lo, hi, limits.max_num_batched_tokens, result["gdn_buffer_rows"], cap,
                      f"vllm-overlay stress: {result['verdict']} ({result['band_forwards']} band forwards)")
    result["png"] = os.path.abspath(png)
    result["json"] = os.path.abspath(os.path.join(opts.out, "stress.json"))
    with open(result["json"], "w") as f:
        json.dump(result, f, indent=1)
    out.table(f"stress: {result['verdict']}", ("measure", "value"), summary_rows(result))
    for line in result["plan_vs_seen"]:
        out.line(line)
    for slow in result["slow_waves"]:
        out.line(f"slow wave: wave {slow['wave']} took {slow['s']:.1f} s, more than {SLOW_FACTOR:g} x the "
                 f"median {slow['median_s']:.2f} s", "warning")
    level = {"PASSED": "ok", "FAILED": "error", "DID NOT TEST": "warning"}.get(result["verdict"], "error")
    out.line(f"{result['verdict']}: {result['why']}", level)
    if outcome.errors:
        out.line(f"first error: {outcome.errors[0]}")
    out.line(f"wrote {result['json']} and {result['png']}")
    return result


def _shared_refusal(sid: str | None, line: str) -> str:
    return (f"the server id {sid} is shared by several live servers ({line}): their forwards cannot be told "
            "apart, so this run is not judged; give each server its own VLLM_OVERLAY_SERVER_ID")


def _not_judged(result: dict[str, Any], why: str) -> None:
    """A verdict that cannot stand (another server's forwards are in its counts): DID NOT TEST."""
    if result["exit_code"] in (0, DID_NOT_TEST):
        result.update(exit_code=DID_NOT_TEST, verdict=NAMES[DID_NOT_TEST], why=why)


def _server_id(opts: Options, tgt: Any) -> str | None:
    """The id this server's reports carry: --server-id, else the one its /metrics names."""
    named = tgt.server_id
    if opts.server_id and named and opts.server_id != named:
        raise planmod.UsageError(f"--server-id {opts.server_id!r}: the server at {tgt.base} names itself "
                                 f"{named!r} on /metrics; drop --server-id or give that one")
    return opts.server_id or named


def _name_not_counted(out: Out, report_dir: str, sid: str, found: Scan) -> list[dict[str, Any]]:
    """One line naming the reports in the directory that are not this server's (never counted)."""
    others = [{"path": r["_path"], "server_id": r.get("server_id")} for r in found.foreign]
    if others:
        shown = ", ".join(f"{os.path.basename(o['path'])} (server id {o['server_id']})" for o in others[:3])
        more = f" and {len(others) - 3} more" if len(others) > 3 else ""
        out.line(f"not counted: {len(others)} report(s) in {report_dir} of other servers than this one "
                 f"({sid}): {shown}{more}", "warning")
    for path, why in sorted(found.skipped.items()):
        out.line(f"not counted: {path}: not a report ({why})", "warning")
        others.append({"path": path, "skipped": why})
    return others


def _metrics_first(opts: Options, tgt: Any) -> metrics_text.Scrape | None:
    """The scrape of the server's /metrics before traffic, when the verdict is to come from it:
    --telemetry metrics, or auto without --report-dir (a server in a container, on another host)."""
    base = tgt.base
    if opts.telemetry not in ("auto", "reports", "metrics"):
        raise planmod.UsageError(f"--telemetry {opts.telemetry!r}: expected auto, reports or metrics")
    if opts.telemetry == "reports" or (opts.telemetry == "auto" and opts.report_dir):
        return None
    if opts.telemetry == "metrics" and opts.report_dir:
        raise planmod.UsageError("--telemetry metrics reads the server's /metrics; drop --report-dir DIR")
    scrape = tgt.scrape
    if scrape is None:
        if opts.telemetry == "metrics":
            raise planmod.UsageError(f"--telemetry metrics: cannot read {base}/metrics: {tgt.metrics_error}")
        return None
    if not scrape.found:
        if opts.telemetry == "metrics":
            raise planmod.UsageError(
                f"--telemetry metrics: {base}/metrics has no vllm_overlay_ series (is the overlay, with "
                "its prometheus-metrics patch, installed in the server's environment?)")
        return None
    return scrape


def _check_band_edges(lo: int, hi: int, scrape: metrics_text.Scrape) -> None:
    edges = sorted(scrape.buckets)
    missing = [e for e in (lo, hi) if e and e not in scrape.buckets]
    if missing:
        near = sorted(edges, key=lambda e: abs(e - missing[0]))[:4]
        raise planmod.UsageError(
            f"--band {lo},{hi}: {', '.join(map(str, missing))} is not a bucket edge of the server's "
            f"{metrics_text.HIST} histogram, so /metrics cannot count the band exactly; nearest edges: "
            f"{', '.join(map(str, sorted(near)))} (or pass --report-dir DIR for exact sizes)")


def _read_metrics(base: str, before: metrics_text.Scrape, api_key: str | None
                  ) -> tuple[list[dict[str, Any]], dict[int, int], list[int], int | None, bool, int]:
    """(process records, forwards per bucket edge, GDN buffer rows, the largest forward of this
    run, whether that is exact, the live servers /metrics counts under this server id)."""
    time.sleep(2.5)  # the serving processes flush their reports every second
    try:
        after = metrics_text.scrape(base, timeout=10, api_key=api_key)
    except (OSError, ValueError):
        return [], {}, [], None, False, 1  # the server is gone: the outcome already says why
    procs = []
    for pid, proc in after.processes.items():
        procs.append({**proc, "_path": f"{base}/metrics (pid {pid})"})
    sizes = after.sizes_since(before)
    if after.max_forward > before.max_forward:
        return procs, sizes, after.buffer_rows, after.max_forward, True, after.servers
    return (procs, sizes, after.buffer_rows, min(max(sizes), after.max_forward) if sizes else None, False,
            after.servers)


def _read_scan(report_dir: str, since: float | None, server: str | None) -> Scan:
    # the serving processes flush every second and at exit; give them two flush periods
    time.sleep(2.5)
    # server mode (a server id): the reports of processes gone from this host are not counted
    return scan(report_dir, since, server, live=server is not None) if os.path.isdir(report_dir) else Scan()


def _read_reports(report_dir: str, since: float | None, server: str | None) -> list[dict[str, Any]]:
    return _read_scan(report_dir, since, server).reports


def _shutdown(llm: Any) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort; the processes also die with us
        pass


def server_limits(report_dir: str, engine_args: dict[str, Any], live: dict[str, Any]) -> planmod.Limits:
    """The server's limits: the CLI's flags, else the live config its worker reports or its
    /metrics name."""

    def pick(key: str) -> int:
        if engine_args.get(key):
            return int(engine_args[key])
        if isinstance(live.get(key), int) and live[key] > 0:
            return int(live[key])
        flag = "--" + key.replace("_", "-")
        raise planmod.UsageError(
            f"server mode: the server's {key} is unknown (no overlay report with it in {report_dir}); "
            f"pass {flag} N or --report-dir DIR"
        )

    return planmod.Limits(pick("max_num_batched_tokens"), pick("max_model_len"), pick("max_num_seqs"),
                          int(settings.value("VLLM_OVERLAY_PREFILL_CHUNK_CLAMP")))
