"""`vllm-overlay plan`: the ledger, generated from the registry, and what would apply here."""

from __future__ import annotations

import argparse

from vllm_overlay import carry, settings, versions
from vllm_overlay.tools.cli import levels_line
from vllm_overlay.core import decide, unknown_release
from vllm_overlay.tools.output import Out

STYLE = {"planned": "ok", "off": "dim", "skipped": "warning", "upstream-merged": "info", "not-needed": "info"}


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("plan", help="what would apply on the installed vLLM and why (applies nothing)")
    p.add_argument("--ledger", action="store_true", help="also print every patch's why, upstream and retire-when")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings.validate_all()  # what start-up checks first: a bad or unknown setting is an error here too
    out = Out()
    inst = carry.installed()
    where = f"{inst.distribution} {inst.version} ({inst.platform})" if inst else "vLLM not installed"
    beyond = carry.beyond(inst.version) if inst is not None else None
    if inst is not None and inst.version not in versions.RELEASES and beyond is None:
        out.line(f"every patch skipped: {unknown_release(inst.version)}", "warning")
    decisions = decide(vllm=inst)
    if beyond is not None:  # the line every process logs at start-up
        out.line(carry.summary(decisions, beyond), "warning")
    rows, styles = [], []
    for d in decisions:
        s = d.spec
        targets = ", ".join(str(t) for t in s.targets if inst is None or t.applies_to(inst.version))
        if d.release:
            targets = ", ".join(str(t) for t in s.targets if t.applies_to(d.release))
        rows.append([s.id, "would apply" if d.status == "planned" else d.status, d.reason, s.mechanism,
                     s.vllm, targets])
        styles.append(STYLE[d.status])
    out.table(f"vllm-overlay plan on {where}", ("patch", "decision", "reason", "mechanism", "vLLM", "targets"),
              rows, ids=(0, 5), row_styles=styles)
    if (text := levels_line.line(inst)) is not None:
        out.line(text)
    if args.ledger:
        for d in decisions:
            s = d.spec
            out.heading(f"{s.id}: {s.title}")
            out.line(f"why: {s.why}")
            out.line(f"upstream: {s.upstream}")
            out.line(f"default: {s.default_text().replace('`', '')}")
            out.line(f"requires: {', '.join(s.requires) or '-'}; conflicts: {', '.join(s.conflicts) or '-'}")
            out.line(f"settings: {', '.join(s.settings) or '-'}")
            for t in s.targets:
                out.line(f"target: {t}" + (f" (vLLM {t.vllm})" if t.vllm else "")
                         + (f" ({t.platform} only)" if t.platform else ""))
            for row in s.support:
                out.line(f"vLLM {row.vllm}: {row.status}: {row.reason}")
            out.line(f"retire when: {s.retire_when}")
            out.line(f"beyond the matrix: {s.beyond_matrix or 'not declared'}: {s.beyond_matrix_why}")
            for rw in s.rewrites:
                out.line(f"rewrite: {rw.target} for vLLM {rw.version}, sha256 {rw.sha256[:16]}..., "
                         f"{len(rw.edits)} anchor(s)")
    return 0
