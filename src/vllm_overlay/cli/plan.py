"""`vllm-overlay plan`: the ledger, generated from the registry, and what would apply here."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from vllm_overlay import versions
from vllm_overlay.core import decide, unknown_release

STYLE = {"planned": "green", "off": "dim", "skipped": "yellow", "upstream-merged": "cyan", "not-needed": "cyan"}


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("plan", help="what would apply on the installed vLLM and why (applies nothing)")
    p.add_argument("--ledger", action="store_true", help="also print every patch's why, upstream and retire-when")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    console = Console()
    inst = versions.installed_vllm()
    where = f"{inst.distribution} {inst.version} ({inst.platform})" if inst else "vLLM not installed"
    if inst is not None and inst.version not in versions.RELEASES:
        print(f"every patch skipped: {unknown_release(inst.version)}")
    table = Table(title=f"vllm-overlay plan on {where}")
    for col in ("patch", "decision", "reason", "mechanism", "vLLM"):
        table.add_column(col, overflow="fold")
    table.add_column("targets", no_wrap=True)
    decisions = decide(vllm=inst)
    for d in decisions:
        s = d.spec
        targets = "\n".join(t.qualname for t in s.targets if inst is None or t.applies_to(inst.version))
        status = "would apply" if d.status == "planned" else d.status
        table.add_row(s.id, f"[{STYLE[d.status]}]{status}[/]", d.reason, s.mechanism, s.vllm, targets)
    console.print(table)
    if args.ledger:
        for d in decisions:
            s = d.spec
            console.rule(f"[bold]{s.id}[/]: {s.title}")
            console.print(f"[bold]why[/]: {s.why}")
            console.print(f"[bold]upstream[/]: {s.upstream}")
            console.print(f"[bold]default[/]: {'on' if s.default else 'off'}"
                          + (f" (on when {s.enabled_by} > 0)" if s.enabled_by else ""))
            console.print(f"[bold]requires[/]: {', '.join(s.requires) or '-'}   "
                          f"[bold]conflicts[/]: {', '.join(s.conflicts) or '-'}")
            console.print(f"[bold]settings[/]: {', '.join(s.settings) or '-'}")
            for t in s.targets:
                console.print(f"[bold]target[/]: {t}" + (f" (vLLM {t.vllm})" if t.vllm else ""))
            for row in s.support:
                console.print(f"[bold]vLLM {row.vllm}[/]: {row.status}: {row.reason}")
            console.print(f"[bold]retire when[/]: {s.retire_when}")
            for rw in s.rewrites:
                console.print(f"[bold]rewrite[/]: {rw.target} for vLLM {rw.version}, "
                              f"sha256 {rw.sha256[:16]}..., {len(rw.edits)} anchor(s)")
    return 0
