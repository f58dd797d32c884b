"""`vllm-overlay report DIR`: pretty-print the JSON reports of one server (the newest, or
``--server-id ID``), or of every server and run in DIR (``--all``)."""

from __future__ import annotations

import argparse
from typing import Any

from vllm_overlay.tools.output import Out
from vllm_overlay.reports import load, scan, shown_status, waiting_for  # noqa: F401 - load re-exported
from vllm_overlay.telemetry import bucket_counts, merge_sizes


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("report", help="pretty-print one server's JSON reports in DIR: the newest server's, unless "
                                      "--server-id or --all (exit 1 when a worker rank sent none)")
    p.add_argument("dir", metavar="DIR", help="a VLLM_OVERLAY_REPORT_DIR")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--server-id", metavar="ID", default=None,
                       help="the reports of this server (its VLLM_OVERLAY_SERVER_ID, on /metrics as server_id)")
    which.add_argument("--all", action="store_true", help="every report in DIR, of every server and run")
    p.set_defaults(func=run)


def servers(reports: list[dict[str, Any]]) -> dict[str | None, dict[str, Any]]:
    """Each server id in the reports (None: reports without one) -> its process count and newest write."""
    out: dict[str | None, dict[str, Any]] = {}
    for r in reports:
        sid = r.get("server_id") if isinstance(r.get("server_id"), str) else None
        s = out.setdefault(sid, {"processes": 0, "written": 0.0})
        s["processes"] += 1
        w = r.get("written")
        if isinstance(w, (int, float)) and w > s["written"]:
            s["written"] = float(w)
    return out


def print_reports(out: Out, reports: list[dict[str, Any]]) -> None:
    rows = []
    for r in reports:
        c, fw = r.get("counts") or {}, (r.get("telemetry") or {}).get("forwards") or {}
        shown = [shown_status(r, rec) for rec in (r.get("patches") or {}).values()]
        armed = str(shown.count("armed")) if "armed" in c else "-"  # worker-only ones: in the patches table
        rows.append([str(r["pid"]), str(r.get("role", "-")), str(r.get("vllm_version")), str(c.get("applied", "-")),
                     armed, str(c.get("skipped", "-")), str(c.get("off", "-")),
                     str(c.get("failed", "-")), f"{(r.get('load_apply_s') or 0) * 1000:.0f} ms",
                     str(fw.get("count", "-")), str(fw.get("min")), str(fw.get("max")),
                     str((r.get("counters") or {}).get("guard_trips", 0)),
                     (r.get("runner") or {}).get("kind", "-")])
    out.table("processes", ("pid", "role", "vLLM", "applied", "armed", "skipped", "off", "failed",
                            "load+apply", "forwards", "min", "max", "guard trips", "runner"), rows, ids=(0, 1))
    for line, level in runner_lines(reports):
        out.line(line, level)
    seen: dict[tuple[str, str, str], list[str]] = {}
    for r in reports:
        for pid, rec in (r.get("patches") or {}).items():
            status = shown_status(r, rec)
            reason = str(rec.get("reason", ""))
            if status == "worker-only":
                reason = f"acts in the workers: waits for {waiting_for(rec).replace(',', ', ')}, which vLLM imports in workers only"
            elif status == "armed":
                reason = f"waits for {waiting_for(rec).replace(',', ', ')}" + (f"; {reason}" if reason else "")
            seen.setdefault((pid, status, reason), []).append(str(r.get("role")))
    out.table("patches (per process)", ("patch", "status", "processes", "reason"),
              [[pid, status, ", ".join(sorted(set(roles))), reason]
               for (pid, status, reason), roles in sorted(seen.items())], ids=(0, 1))
    sizes = merge_sizes(reports)
    if sizes:
        out.table("forwards by scheduled tokens (all workers)", ("bucket", "forwards"),
                  [[label, str(count)] for label, count in bucket_counts(sizes).items()])
    for r in reports:
        for b in r.get("buffers", []):
            out.line(f"pid {r['pid']}: GDN buffer {b.get('key')} {b.get('rows')} rows from {b.get('source')} "
                     f"({(b.get('bytes') or 0) / 2**20:.1f} MiB, {b.get('layers')} layers)"
                     + (" freed" if b.get("freed") else ""))
        for h in r.get("patches", {}).get("memory-headroom", {}).get("headroom", []):
            out.line(f"pid {r['pid']}: memory-headroom at {h['tokens']} tokens: profiled peak "
                     f"{h['profiled_peak'] / 2**30:.3f} GiB, measured {h['measured_peak'] / 2**30:.3f} GiB, moved "
                     f"{h['moved'] / 2**30:.3f} GiB; KV tokens {h['kv_tokens_before']} -> {h['kv_tokens_after']}"
                     + (" (dry run: nothing moved)" if h.get("dry_run") else ""))
        rt = r.get("patches", {}).get("memory-headroom", {}).get("runtime")
        if rt and "runtime_peak" in rt:
            over = rt["over_budget"]
            reserved = (rt["budget"] - rt["baseline"]) / 2**30
            whole = rt.get("whole_process", str(rt.get("meter", "")).startswith("resident set"))
            if over <= 0:
                verdict = f"{-over / 2**30:.3f} GiB to spare"
            elif whole:  # the resident set cannot tell forwards from the rest of the process
                verdict = (f"{over / 2**30:.3f} GiB above it in the resident set, which counts the whole process "
                           "(the scheduler's block pool, requests, modules, an in-process caller), not forwards "
                           "alone: no alarm (CUDA's allocator meter judges forwards)")
            else:
                verdict = f"EXCEEDED by {over / 2**30:.3f} GiB"
            out.line(f"pid {r['pid']}: memory-headroom at runtime: peak {rt['runtime_peak'] / 2**30:.3f} GiB above "
                     f"the pre-profiling baseline (KV cache left out), reserved {reserved:.3f} GiB: {verdict}"
                     + f"; {len(rt.get('windows', []))} windows")
        for shape, source in sorted(r.get("patches", {}).get("moe-configs", {}).get("moe_configs", {}).items()):
            out.line(f"pid {r['pid']}: fused-MoE config {shape}: {source}")
        for e in r.get("events", [])[-10:]:
            out.line(f"pid {r['pid']}: {e}")


def runner_lines(reports: list[dict[str, Any]]) -> list[tuple[str, str | None]]:
    """The model runner each worker built (V1 or Model Runner V2), and any runner hook of a patch
    that was not in place or did not fire by that worker's first forward."""
    out: list[tuple[str, str | None]] = []
    for r in reports:
        runner = r.get("runner") or {}
        if not runner:
            continue
        out.append((f"pid {r['pid']}: model runner {runner.get('kind')} ({runner.get('class')})", None))
        for pid, rec in sorted(r.get("patches", {}).items()):
            missing = (rec.get("runner") or {}).get("missing")
            if missing:
                out.append((f"pid {r['pid']}: patch {pid}: runner hooks that did not fire: {'; '.join(missing)}",
                            "warning"))
    return out


def run(args: argparse.Namespace) -> int:
    out = Out()
    found = scan(args.dir)
    known = servers(found.reports)
    if not getattr(args, "all", False) and known:
        sid = getattr(args, "server_id", None)
        if sid is None:  # the newest server: the one whose processes wrote last
            sid = max(known, key=lambda k: known[k]["written"])
        elif sid not in known:
            shown = ", ".join(str(k) for k in known)
            out.line(f"--server-id {sid!r}: no report in {args.dir} carries that server id; there: {shown}",
                     "error")
            return 2
        found = scan(args.dir, server=sid)
        others = {k: v for k, v in known.items() if k != sid}
        line = f"server {sid}: {known[sid]['processes']} process report(s)"
        if others:
            names = ", ".join(f"{k} ({v['processes']})" for k, v in list(others.items())[:3])
            more = f" and {len(others) - 3} more" if len(others) > 3 else ""
            line += (f"; not shown: {sum(v['processes'] for v in others.values())} report(s) of {len(others)} "
                     f"other server(s) or run(s): {names}{more} (--all shows every one, --server-id ID one)")
        out.line(line)
    reports = found.reports
    for path, why in sorted(found.skipped.items()):
        out.line(f"skipped {path}: not a report ({why})", "warning")
    if not reports:
        out.line(f"no overlay-*.json report in {args.dir}: was the overlay installed in the vLLM environment "
                 "and VLLM_OVERLAY_REPORT_DIR set to this directory?", "error")
        return 1
    print_reports(out, reports)
    for m in found.missing:
        out.line(f"rank {m['rank']} of the engine core pid {m['engine_pid']} ({m['host']}): MISSING, no overlay "
                 f"report: {m['why']}", "error")
    return 1 if found.missing else 0
