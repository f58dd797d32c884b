"""`vllm-overlay doctor`: vLLM, platform, every setting with its source, dangerous combinations."""

from __future__ import annotations

import argparse
import os

from packaging.version import Version

from vllm_overlay import carry, levels, reports, settings, versions
from vllm_overlay.budget import BUDGET_SETTINGS
from vllm_overlay.tools.cli import levels_line
from vllm_overlay.errors import OverlayError, SettingError
from vllm_overlay.tools.output import Out


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("doctor", help="versions, settings and their sources, dangerous combinations")
    p.add_argument("--max-num-batched-tokens", type=positive_int("--max-num-batched-tokens"), default=None,
                   metavar="N",
                   help="the max_num_batched_tokens you serve with (enables the budget checks)")
    p.set_defaults(func=run)


def positive_int(flag: str):  # type: ignore[no-untyped-def]
    def parse(text: str) -> int:
        if not text.strip().isascii() or not text.strip().isdigit() or int(text) < 1:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: expected an integer >= 1")
        return int(text)

    return parse


def startup_errors() -> list[str]:
    """Exactly what register() stops start-up with: settings (values, unknown names, near-miss
    aliases), then the patch switches (unknown ids, conflicts)."""
    from vllm_overlay.core import decide

    problems = settings.startup_problems()
    if not problems:
        try:
            decide(vllm=None)
        except OverlayError as exc:
            problems.append(str(exc))
    return problems


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
    for name in ("VLLM_OVERLAY_TEST_VLLM_VERSION", "VLLM_OVERLAY_TEST_NEWEST_RELEASE"):
        if r[name].is_set:
            out.append(("warning", f"{name}={r[name].value}: test only; the overlay meets the installed vLLM "
                        f"as the test asks: {r[name].setting.help.removeprefix('TEST ONLY. ').split('. ')[0]}"))
    headroom = bool(r["VLLM_OVERLAY_MEMORY_HEADROOM"].value)
    if not headroom:
        out.append(("warning", "VLLM_OVERLAY_MEMORY_HEADROOM=0: unsafe; the KV cache is sized from vLLM's "
                    "profiling forward alone, which misses the GDN and attention temporaries of a real "
                    "forward of max_num_batched_tokens (memory-headroom is off)"))
    if headroom and r["VLLM_OVERLAY_MEMORY_HEADROOM_DRY_RUN"].value:
        out.append(("warning", "VLLM_OVERLAY_MEMORY_HEADROOM_DRY_RUN=1: unsafe; memory-headroom measures and "
                    "reports what it would move but leaves the KV cache as vLLM's profiling forward sized it"))
    if cap:
        out.append(("info", f"VLLM_OVERLAY_PROFILE_RUN_CAP={cap}: not needed for the GDN boot crash "
                    "(the overlay sizes the buffer itself); activations above the cap are not profiled"
                    + ("; memory-headroom measures a forward of max_num_batched_tokens before the KV "
                       "cache is sized" if headroom else ", and with VLLM_OVERLAY_MEMORY_HEADROOM=0 "
                       "nothing measures them")))
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


def runner_lines(version: str | None, environ: dict[str, str] | None = None) -> list[tuple[str, str | None]]:
    """Which model runner vLLM's worker builds: the one named by the reports of the last run in
    VLLM_OVERLAY_REPORT_DIR, else what VLLM_USE_V2_MODEL_RUNNER asks for."""
    env = os.environ if environ is None else environ
    out: list[tuple[str, str | None]] = []
    try:
        directory = settings.value("VLLM_OVERLAY_REPORT_DIR", environ)
        built = [r for r in reports.load(directory) if r.get("runner")] if os.path.isdir(directory) else []
    except Exception:  # noqa: BLE001 - an unreadable report directory: fall back to the request
        built = []
    if built:
        last = max(built, key=lambda r: r.get("written", 0))
        runner = last["runner"]
        out.append((f"model runner: {runner['kind']} ({runner['class']}), built by pid {last['pid']} "
                    f"(report {reports.where(last)})", None))
        for pid, rec in sorted(last.get("patches", {}).items()):
            missing = (rec.get("runner") or {}).get("missing")
            if missing:
                out.append((f"model runner: patch {pid} did not fire on it: {'; '.join(missing)}", "warning"))
        return out
    asked = env.get("VLLM_USE_V2_MODEL_RUNNER")
    if version is not None and not levels.runner_exists(version, "V1"):
        if asked is not None and asked != "1":  # vLLM refuses every other value, set but empty included
            out.append((f"model runner: Model Runner V2; vLLM {version} has no V1 runner and refuses "
                        f"VLLM_USE_V2_MODEL_RUNNER={asked!r} at start-up (only 1 is accepted): unset it", "error"))
        else:
            out.append((f"model runner: Model Runner V2 (vLLM {version} has only V2); no worker report in "
                        f"{directory} names the one built yet", None))
        return out
    if asked is not None and asked.strip().lower() in ("1", "true"):
        want = "Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1)"
    elif asked is not None and asked.strip().lower() in ("0", "false"):
        want = "V1 (VLLM_USE_V2_MODEL_RUNNER=0)"
    elif version is not None and Version(version) < Version("0.22.0"):
        want = "V1 (vLLM before 0.22.0 builds Model Runner V2 only with VLLM_USE_V2_MODEL_RUNNER=1)"
    else:
        want = ("chosen by vLLM at start-up (VllmConfig.use_v2_model_runner: Model Runner V2 where the model and "
                "build support it, e.g. CUDA with Triton; set VLLM_USE_V2_MODEL_RUNNER=0 or 1 to choose)")
    out.append((f"model runner: {want}; no worker report in {directory} names the one built yet", None))
    return out


def carry_line(inst: versions.Installed) -> str | None:
    """On a release newer than the matrix: the line each process logs at start-up (carry.summary);
    None elsewhere, or where the settings do not let start-up get that far."""
    from vllm_overlay.core import decide

    beyond = carry.beyond(inst.version)
    if beyond is None:
        return None
    try:
        return carry.summary(decide(vllm=inst), beyond)
    except OverlayError:  # a bad setting or switch: reported below, with the text start-up stops with
        return None


def run(args: argparse.Namespace) -> int:
    out = Out()
    real = versions.installed_vllm()
    inst = carry.installed()
    if inst:
        known = inst.version in versions.RELEASES
        beyond = carry.beyond(inst.version)
        span = f"{versions.RELEASES[0]} to {versions.RELEASES[-1]}"
        shown = (f" (presented as {inst.version} by VLLM_OVERLAY_TEST_VLLM_VERSION, test only)"
                 if real is not None and real.version != inst.version else "")
        if known:
            note = ""
        elif beyond is not None:
            note = f" (newer than the support matrix, {span}: each patch applies where its checks hold, below)"
        else:
            note = f" (not in the support matrix, {span}: no patch applies: {carry.not_carried(inst.version)})"
        out.line(f"vLLM: {inst.distribution} {real.version if real else inst.version} on {inst.platform}{shown}"
                 + note, None if known else "warning")
        if (text := carry_line(inst)) is not None:
            out.line(text, "warning")
    else:
        out.line(f"vLLM: not installed (the support matrix covers {versions.RELEASES[0]} to "
                 f"{versions.RELEASES[-1]}: `vllm-overlay matrix`)", "error")
    for text, level in runner_lines(inst.version if inst else None):
        out.line(text, level)
    if (text := levels_line.line(inst)) is not None:
        out.line(text)
    try:
        import torch

        out.line(f"torch: {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    except Exception as exc:  # noqa: BLE001
        out.line(f"torch: cannot import ({exc})", "error")
    rows, styles, invalid = [], [], []
    for setting, res in settings.snapshot():
        label = setting.name + (" (test only)" if setting.test_only else "")
        if setting.aliases:
            label += f" (alias {', '.join(setting.aliases)})"
        if isinstance(res, SettingError):
            invalid.append(str(res))
            rows.append([label, os.environ.get(setting.name, ""), "INVALID", setting.accepted])
            styles.append("error")
        else:
            shown = "unset" if res.value in (None, ()) else str(res.value)
            rows.append([label, shown, res.source, setting.accepted])
            styles.append(None)
    out.table("settings", ("setting", "value", "from", "accepted"), rows, row_styles=styles)
    problems = startup_errors()
    if problems:
        for text in problems:  # the exact text vLLM start-up stops with
            out.line(f"error: {text}", "error")
        out.line(f"{len(problems)} setting(s) invalid: vLLM will refuse to start with the overlay", "error")
        return 1
    found = findings(args.max_num_batched_tokens)
    for level, text in found:
        out.line(f"{level}: {text}", level)
    if not found:
        out.line("no dangerous combination found", "ok")
    return 1 if any(level == "error" for level, _ in found) else 0
