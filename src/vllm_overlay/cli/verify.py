"""`vllm-overlay verify`: every source anchor and pristine hash against vLLM sources."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from vllm_overlay import anchors, versions, wheels
from vllm_overlay.errors import OverlayError


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("verify", help="check every anchor and hash; exit 1 on drift")
    p.add_argument("--wheel", metavar="PATH", help="check against this vLLM wheel's sources instead")
    p.add_argument("--version", metavar="X.Y.Z",
                   help="with --download: the vLLM version whose wheel to fetch and check")
    p.add_argument("--download", action="store_true",
                   help="download (and cache) the CUDA vLLM wheel of --version and check it")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    console = Console()
    if args.download:
        if not args.version:
            raise OverlayError("--download needs --version X.Y.Z (e.g. --version 0.20.2)")
        args.wheel = wheels.fetch_vllm_wheel(args.version)
    if args.wheel:
        version = args.version or wheels.version_of(args.wheel)
        read, where = anchors.wheel_reader(args.wheel), args.wheel
    else:
        inst = versions.installed_vllm()
        if inst is None:
            raise OverlayError("vLLM is not installed here; pass --wheel PATH or --download --version X.Y.Z")
        version, read, where = inst.version, anchors.installed_reader(), f"installed {inst.distribution}"
    checks = anchors.check(version, read)
    table = Table(title=f"anchors for vLLM {version} ({where})")
    for col in ("patch", "target", "result", "detail"):
        table.add_column(col, overflow="fold")
    for c in checks:
        table.add_row(c.patch_id, str(c.rw.target), "[green]ok[/]" if c.ok else "[red]DRIFT[/]", c.detail)
    console.print(table)
    if not checks:
        console.print(f"[yellow]no source rewrite is recorded for vLLM {version}[/]")
        return 1
    bad = [c for c in checks if not c.ok]
    console.print(f"{len(checks) - len(bad)} ok, {len(bad)} drifted")
    return 1 if bad else 0
