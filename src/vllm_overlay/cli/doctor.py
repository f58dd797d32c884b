"""`vllm-overlay doctor`: vLLM, platform, every setting with its source, dangerous combinations."""

from __future__ import annotations

import argparse
import os

from rich.console import Console
from rich.table import Table

from vllm_overlay import settings, versions
from vllm_overlay.budget import BUDGET_SETTINGS
from vllm_overlay.errors import SettingError


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("doctor", help="versions, settings and their sources, dangerous combinations")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="the max_num_batched_tokens you serve with (enables the budget checks)")
    p.set_defaults(func=run)


def findings(mnbt: int | None, environ: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """(level, text) for every dangerous or pointless combination of settings."""
    out: list[tuple[str, str]] = []
    r = {s.name: settings.resolve(s.name, environ) for s in settings.SETTINGS}
    budget = next((r[name] for name in BUDGET_SETTINGS if r[name].is_set), r[BUDGET_SETTINGS[-1]])
    cap = int(r["VLLM_OVERLAY_PROFILE_RUN_CAP"].value)
    clamp = int(r["VLLM_OVERLAY_PREFILL_CHUNK_CLAMP"].value)
    if not r["VLLM_OVERLAY_TEST_GUARD"].value:
        out.append(("error", "VLLM_OVERLAY_TEST_GUARD=0: the capacity guard is disabled (test only); an "
                    "undersized buffer would reach compiled code and crash with setStorage"))
    if r["VLLM_OVERLAY_TEST_BUFFER_ROWS"].is_set:
        out.append(("error", f"VLLM_OVERLAY_TEST_BUFFER_ROWS={r['VLLM_OVERLAY_TEST_BUFFER_ROWS'].value}: "
                    "the GDN buffer size is forced (test only), bypassing the token-budget resolver"))
    if cap:
        out.append(("info", f"VLLM_OVERLAY_PROFILE_RUN_CAP={cap}: not needed for the GDN boot crash "
                    "(the overlay sizes the buffer itself); activations above the cap are not profiled"))
    if mnbt is None:
        if budget.is_set or cap or clamp:
            out.append(("info", "pass --max-num-batched-tokens N to check budget, cap and clamp against it"))
        return out
    if budget.is_set and int(budget.value) < mnbt:
        out.append(("warning", f"{budget.source.split()[-1]}={budget.value} is below max_num_batched_tokens "
                    f"{mnbt}: the overlay raises it to {mnbt} (VLLM_OVERLAY_STRICT=1 refuses to start)"))
    if cap and cap >= mnbt:
        out.append(("warning", f"VLLM_OVERLAY_PROFILE_RUN_CAP={cap} >= max_num_batched_tokens {mnbt}: "
                    "the cap never fires (no-op)"))
    if clamp and clamp > mnbt:
        out.append(("warning", f"VLLM_OVERLAY_PREFILL_CHUNK_CLAMP={clamp} > max_num_batched_tokens {mnbt}: "
                    "the scheduler never gives one request more than that anyway (no-op)"))
    return out


def run(args: argparse.Namespace) -> int:
    console = Console()
    inst = versions.installed_vllm()
    if inst:
        known = inst.version in versions.RELEASES
        span = f"{versions.RELEASES[0]} to {versions.RELEASES[-1]}"
        console.print(f"vLLM: {inst.distribution} {inst.version} on {inst.platform}"
                      + ("" if known else f"  [yellow](not in the support matrix, {span}: no patch applies)[/]"),
                      soft_wrap=True)
    else:
        console.print(f"[red]vLLM: not installed[/] (the support matrix covers {versions.RELEASES[0]} to "
                      f"{versions.RELEASES[-1]}: `vllm-overlay matrix`)", soft_wrap=True)
    try:
        import torch

        console.print(f"torch: {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    except Exception as exc:  # noqa: BLE001
        console.print(f"[red]torch: cannot import ({exc})[/]")
    table = Table(title="settings")
    for col in ("setting", "value", "from", "accepted"):
        table.add_column(col, overflow="fold")
    errors = 0
    for setting, res in settings.snapshot():
        if isinstance(res, SettingError):
            errors += 1
            table.add_row(setting.name, f"[red]{os.environ.get(setting.name, '')}[/]", f"[red]{res}[/]",
                          setting.accepted)
        else:
            shown = "unset" if res.value in (None, ()) else str(res.value)
            label = setting.name + (" [dim](test only)[/]" if setting.test_only else "")
            if setting.aliases:
                label += f" [dim](alias {', '.join(setting.aliases)})[/]"
            table.add_row(label, shown, res.source, setting.accepted)
    console.print(table)
    if errors:
        console.print(f"[red]{errors} setting(s) invalid: vLLM will refuse to start with the overlay[/]")
        return 1
    found = findings(args.max_num_batched_tokens)
    color = {"error": "red", "warning": "yellow", "info": "cyan"}
    for level, text in found:
        console.print(f"[{color[level]}]{level}[/]: {text}")
    if not found:
        console.print("[green]no dangerous combination found[/]")
    return 1 if any(level == "error" for level, _ in found) else 0
