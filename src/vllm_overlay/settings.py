"""Every environment variable vllm-overlay reads, declared in one place.

Each setting has a name, a parser, a default, the accepted range in words, a help text and
its legacy aliases. Values are read from the environment on every call (no cache), so tests
and the CLI see exactly what a vLLM process would see. A bad value raises ``SettingError``
naming the variable, the value and what is accepted; an alias set to a value different from
its primary's is an error naming both. A setting that names a file or folder has a ``check``
too (that it is what the variable needs: a directory, a readable table), run by
``startup_problems`` (start-up and `vllm-overlay doctor`), not on every read.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vllm_overlay import report_files
from vllm_overlay.errors import SettingError

TOKEN_MAX = 1_048_576


@dataclass(frozen=True)
class Setting:
    name: str
    parse: Callable[[str], Any]
    default: Any
    accepted: str
    help: str
    aliases: tuple[str, ...] = ()
    test_only: bool = False
    # the file-system check of a value that names a path: why it cannot serve, or None
    check: Callable[[Any, bool], str | None] | None = None  # (value, is the default)


@dataclass(frozen=True)
class Resolved:
    """A setting's value and where it came from ("env NAME", "alias NAME" or "default")."""

    setting: Setting
    value: Any
    source: str
    raw: str | None

    @property
    def is_set(self) -> bool:
        return self.source != "default"


def _int_range(lo: int, hi: int | None) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        text = raw.strip()
        digits = text[1:] if text.startswith("-") and lo < 0 else text  # no sign where none is accepted ("-0")
        if not text.isascii() or not digits.isdigit():  # "４０９６" is digits to str.isdigit
            raise ValueError
        value = int(text)
        if value < lo or (hi is not None and value > hi):
            raise ValueError
        return value

    return parse


def _bool(raw: str) -> bool:
    text = raw.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError


def _auto_bool(raw: str) -> bool | str:
    """"auto", or a boolean as _bool reads it."""
    return "auto" if raw.strip().lower() == "auto" else _bool(raw)


def _id_list(raw: str) -> tuple[str, ...]:
    items = tuple(part.strip() for part in raw.split(",") if part.strip())
    for item in items:
        if not all(c.isalnum() or c == "-" for c in item):
            raise ValueError
    return items


def _path(raw: str) -> str:
    if not raw.strip() or "\0" in raw:
        raise ValueError
    path = os.path.abspath(os.path.expanduser(raw.strip()))
    if len(path) > report_files.PATH_MAX or any(len(part) > report_files.NAME_MAX for part in path.split(os.sep)):
        raise ValueError
    return path


PATH_ACCEPTED = (f"an absolute or relative path of at most {report_files.PATH_MAX} characters, "
                 f"{report_files.NAME_MAX} per name")


def _server_id(raw: str) -> str:
    text = raw.strip()
    if not text or len(text) > 128 or not all(c.isascii() and (c.isalnum() or c in "._:-") for c in text):
        raise ValueError
    return text


def _report_dir_check(path: str, default: bool) -> str | None:
    return report_files.dir_problem(path, default)


def _folder_check(path: str, default: bool) -> str | None:
    if default and not os.path.lexists(path):
        return None  # the default folder may not exist yet: nothing is read from it then
    if not os.path.isdir(path):
        return "does not exist" if not os.path.lexists(path) else "is not a folder"
    return None


def _gemv_table_check(path: str, default: bool) -> str | None:
    if not os.path.isfile(path):
        return "does not exist" if not os.path.lexists(path) else "is not a regular file"
    if os.path.getsize(path) > report_files.MAX_REPORT_BYTES:
        return f"is larger than {report_files.MAX_REPORT_BYTES} bytes: not a table of tile configs"
    from vllm_overlay.gemv_table import load_table

    try:
        table = load_table(path, "VLLM_OVERLAY_DECODE_GEMV_CONFIGS")
    except ValueError as exc:
        return f"is not a usable table: {str(exc).split(': ', 1)[-1]}"
    empty = [name for name, shapes in table.items() if not name.strip() or not shapes]
    if not table or empty:
        return ("names no device" if not table
                else f"is not a usable table: device {empty[0]!r} has an empty name or no shape")
    return None


# vllm_overlay.levels.PROCESS_LEVELS, weakest first (carried-over: a release newer than the matrix)
REQUIRE_LEVELS = ("carried-over", "source-checked", "cpu-proven", "gpu-proven")


def _level(raw: str) -> str:
    text = raw.strip().lower()
    if text not in REQUIRE_LEVELS:
        raise ValueError
    return text


def _release(raw: str) -> str:
    text = raw.strip()
    parts = text.split(".")
    if len(parts) != 3 or not all(p.isascii() and p.isdigit() for p in parts):
        raise ValueError
    return text


def _matrix_release(raw: str) -> str:
    from vllm_overlay.versions import RELEASES

    text = _release(raw)
    if text not in RELEASES:
        raise ValueError
    return text


def default_report_dir() -> str:
    return report_files.default_dir()


def default_moe_config_dir(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    cache = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "vllm-overlay", "moe-configs")


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "VLLM_OVERLAY", _bool, True, "1 or 0 (also true/false, yes/no, on/off)",
        "Master switch. 0 applies no patch at all, default-on ones included; the report "
        "still says so.",
    ),
    Setting(
        "VLLM_OVERLAY_ENABLE", _id_list, (), "comma-separated patch ids (see `vllm-overlay plan`)",
        "Turn on patches that are off by default. An unknown id is an error listing the known ids.",
    ),
    Setting(
        "VLLM_OVERLAY_DISABLE", _id_list, (), "comma-separated patch ids (see `vllm-overlay plan`)",
        "Turn off patches, default-on ones included. Wins over VLLM_OVERLAY_ENABLE.",
    ),
    Setting(
        "VLLM_OVERLAY_STRICT", _bool, False, "1 or 0",
        "1: an enabled patch that cannot apply stops start-up with one clear error, a token "
        "budget below the largest schedulable forward is refused instead of raised, and a runner "
        "patch whose hooks on the model runner the worker built (V1 or V2) are not in place or did "
        "not fire by the worker's first forward stops the engine at that forward. 0: such a patch "
        "is skipped, or its hooks named, with one WARNING line naming it and the reason.",
    ),
    Setting(
        "VLLM_OVERLAY_REQUIRE", _level, None, "one of " + ", ".join(REQUIRE_LEVELS) + " (unset: no requirement)",
        "The support level a patch must have on this process's cell (installed release, platform, the "
        "model runner vLLM builds) to apply: gpu-proven (a GPU run served traffic with it), cpu-proven "
        "(an engine test ran it on the CPU build), source-checked (its targets, anchors and hashes were "
        "checked in the release's wheel only). A patch below it is skipped, with one WARNING per "
        "process naming the level required and each level found. Where vLLM chooses the runner at "
        "start-up (CUDA from 0.22.0 without VLLM_USE_V2_MODEL_RUNNER) every process takes the weaker of "
        "the V1 and V2 levels, so all processes of a server decide alike; set VLLM_USE_V2_MODEL_RUNNER "
        "to be judged by the runner you build. `vllm-overlay plan` shows the levels.",
    ),
    Setting(
        "VLLM_OVERLAY_CARRY_OVER", _bool, True, "1 or 0 (0: every patch skipped on a release newer than the matrix)",
        "On a vLLM release newer than the newest of the support matrix, each wanted patch runs at start-up "
        "the checks of its support row of that newest release (its proofs, its rewrites' pristine hashes and "
        "anchors) against the installed vLLM's files, read as files; where all hold it applies at the "
        "support level carried-over, where one fails it is skipped naming the check and the file, and one "
        "WARNING per process names the release and the counts. A patch whose spec says beyond_matrix='never' "
        "is skipped there. 0: every patch is skipped on such a release, with one line. Releases older than "
        "the matrix, or left out of it by name (versions.LEFT_OUT), are never carried over.",
    ),
    Setting(
        "VLLM_OVERLAY_REPORT_DIR", _path, None,
        f"a directory, or a path to create one at ({PATH_ACCEPTED})",
        "Where each process writes its JSON report, overlay-KEY-PID-INSTANCE.json (KEY: a hash of "
        "the server id). Default: vllm-overlay-reports-UID under the system temp dir, created "
        "owner-only (mode 0700) and refused when it is a symbolic link, not owned by this user or "
        "writable by others (docs/security.md). Report files not written for 24 h are removed when an "
        "overlay process starts there.",
        check=_report_dir_check,
    ),
    Setting(
        "VLLM_OVERLAY_SERVER_ID", _server_id, None,
        "1 to 128 characters from a-z, A-Z, 0-9 and . _ : -",
        "Which serving processes belong together: the first overlay process of a server (the "
        "API server, or the driver of an offline engine) sets it when unset, and its engine and "
        "worker processes inherit it. The /metrics series and `vllm-overlay stress` read only the "
        "reports carrying the server's id. An id the overlay made in another program (a launcher "
        "that loaded vLLM's plugins) is replaced in a server's main process. Set it yourself only "
        "to give a server a stable name.",
    ),
    Setting(
        "VLLM_OVERLAY_SERVER_TREE", _server_id, None, "set by the overlay (the same characters as VLLM_OVERLAY_SERVER_ID)",
        "Set by the overlay, never by hand: which server's process tree a process belongs to (a program's main "
        "process makes its own, the processes it starts inherit it). Two live servers with one "
        "VLLM_OVERLAY_SERVER_ID have two trees: /metrics says so (vllm_overlay_server_id_servers) and "
        "`vllm-overlay stress` refuses to judge.",
    ),
    Setting(
        "VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET", _int_range(1, TOKEN_MAX), None,
        f"an integer in [1, {TOKEN_MAX}]",
        "Token rows of every preallocated buffer. Overrides VLLM_OVERLAY_GDN_MAX_BATCHED_TOKENS "
        "and the live max_num_batched_tokens. A value below the largest forward the engine can "
        "schedule is raised to that size with a WARNING (refused under VLLM_OVERLAY_STRICT=1).",
        aliases=("GENESIS_PREALLOC_TOKEN_BUDGET",),
    ),
    Setting(
        "VLLM_OVERLAY_GDN_MAX_BATCHED_TOKENS", _int_range(1, TOKEN_MAX), None,
        f"an integer in [1, {TOKEN_MAX}]",
        "Token rows of the GDN buffers when VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET is unset. Same "
        "floor as above.",
        aliases=("GENESIS_GDN_MAX_BATCHED_TOKENS",),
    ),
    Setting(
        "VLLM_OVERLAY_PROFILE_RUN_CAP", _int_range(0, TOKEN_MAX), 0,
        f"an integer in [0, {TOKEN_MAX}] (0 disables the cap)",
        "Caps the token count of vLLM's memory-profiling dummy forward only; never a buffer size. "
        "Activations of forwards above the cap are then not profiled, so vLLM alone would size the "
        "KV cache too large; memory-headroom (on unless VLLM_OVERLAY_MEMORY_HEADROOM=0) measures a "
        "forward of max_num_batched_tokens before the KV cache is sized and takes the difference "
        "from it. The overlay's own buffer sizing makes the cap unnecessary for the GDN boot "
        "crash it was invented for; use it only to shorten profiling.",
        aliases=("GENESIS_PROFILE_RUN_CAP_M",),
    ),
    Setting(
        "VLLM_OVERLAY_MEMORY_HEADROOM", _bool, True,
        "1 or 0 (0 turns the correction off: UNSAFE, the KV cache may take memory a forward of "
        "max_num_batched_tokens needs)",
        "memory-headroom: after vLLM's memory profiling and before the KV cache is allocated, each "
        "worker measures the peak of a forward of max_num_batched_tokens tokens with real attention "
        "metadata and takes any shortfall against the profiled peak from the KV cache (one line, "
        "report fields). 0 turns that off: vLLM then sizes the KV cache from its profiling forward "
        "alone, which on hybrid models misses the GDN and attention temporaries (and, with "
        "VLLM_OVERLAY_PROFILE_RUN_CAP, every forward above the cap), so a long prompt can run out "
        "of memory under traffic.",
    ),
    Setting(
        "VLLM_OVERLAY_MEMORY_HEADROOM_DRY_RUN", _bool, False,
        "1 or 0 (1 measures and reports but moves nothing: UNSAFE as VLLM_OVERLAY_MEMORY_HEADROOM=0)",
        "memory-headroom measures as usual, logs what it would move and watches the runtime peak "
        "against vLLM's own reservation (report field runtime), but leaves the KV cache as vLLM sized "
        "it: a server with vLLM's sizing and the numbers that show whether that sizing held. For "
        "comparisons; unsafe for the same reason as VLLM_OVERLAY_MEMORY_HEADROOM=0.",
    ),
    Setting(
        "VLLM_OVERLAY_PREFILL_CHUNK_CLAMP", _int_range(0, TOKEN_MAX), 0,
        f"an integer in [0, {TOKEN_MAX}] (0 disables the clamp)",
        "Bounds one request's prefill chunk per step (vLLM's long_prefill_token_threshold). It "
        "does not bound a forward's total: co-scheduled requests still push a forward up to "
        "max_num_batched_tokens.",
    ),
    Setting(
        "VLLM_OVERLAY_TQ_HYBRID_BOUNDARY", _int_range(0, 64), 0,
        "an integer in [0, 64] (0: every full-attention layer uses TurboQuant)",
        "hybrid-turboquant (vLLM 0.20.x): how many of the FIRST and LAST full-attention layers of a "
        "hybrid model keep the model dtype instead of TurboQuant (boundary protection). Default 0, "
        "as vLLM does on hybrids from 0.22.0; capped so that both ends together keep at most half of the "
        "full-attention layers (a loud line says so).",
    ),
    Setting(
        "VLLM_OVERLAY_MOE_CONFIG_DIR", _path, None, "an existing folder",
        "moe-configs: the folder of fused-MoE configs tuned on this machine (`vllm-overlay tune-moe` "
        "writes there; the patch reads there when vLLM ships no config for the exact device). Default: "
        "vllm-overlay/moe-configs under $XDG_CACHE_HOME (or ~/.cache).",
        check=_folder_check,
    ),
    Setting(
        "VLLM_OVERLAY_DECODE_GEMV", _auto_bool, "auto", "auto, 1 or 0 (also true/false, yes/no, on/off)",
        "decode-gemv (CUDA): the unquantized linear layers of a one-row forward (decode at one stream) run "
        "the overlay's Triton GEMV instead of cuBLAS; larger forwards keep torch.nn.functional.linear. "
        "auto: only where a table was measured: VLLM_OVERLAY_DECODE_GEMV_CONFIGS, the table "
        "`vllm-overlay tune-gemv` measured for this device and vLLM release (~/.cache/vllm-overlay/decode-gemv/), or the "
        "shipped one on a device and release a served A/B measured (NVIDIA H200, vLLM 0.33.0), and with CUDA "
        "graphs on; a shape a table marks cublas keeps cuBLAS; elsewhere those layers keep cuBLAS with one "
        "WARNING naming the command. 1: on every CUDA device (heuristic configs where no table covers it). 0: off. "
        "Outputs can differ from stock by a bf16 rounding step (bench/decode_gemv_ab.sh compares them).",
    ),
    Setting(
        "VLLM_OVERLAY_DECODE_GEMV_CONFIGS", _path, None,
        "a JSON file of tile configs (the format in the meaning column)",
        "decode-gemv: kernel tile sizes per device and weight shape, "
        '{"devices": {DEVICE NAME: {"NxK": [BLOCK_N, BLOCK_K, num_warps, num_stages] or "cublas"}}} as '
        "`vllm-overlay tune-gemv --out` or bench/decode_gemv_h200.py writes it; used before the table tune-gemv "
        "cached for this device and release and the table that ships with the package. A device whose "
        'table says it was measured on another vLLM release ("measured": {DEVICE NAME: {"vllm": "X.Y.Z"}}) is '
        "said and not used. Shapes in no table get a heuristic config.",
        check=_gemv_table_check,
    ),
    Setting(
        "VLLM_OVERLAY_MOE_DECODE", _bool, False, "1 or 0 (also true/false, yes/no, on/off)",
        "moe-decode (CUDA): a forward of 1 to 4 tokens runs the routed experts of each plain unquantized MoE layer "
        "on vLLM's Triton backend in the overlay's two Triton launches instead of vLLM's fused_experts; larger "
        "forwards and other layers keep vLLM's kernel (a layer that does not qualify is said once, with why). "
        "Off by default: no served A/B against stock has measured it yet (bench/moe_decode_kernel.py times the "
        "kernel alone). Outputs can differ from stock by a bf16 rounding step.",
    ),
    Setting(
        "VLLM_OVERLAY_TEST_BUFFER_ROWS", _int_range(1, TOKEN_MAX), None,
        f"an integer in [1, {TOKEN_MAX}]",
        "TEST ONLY. Forces the GDN buffer to this many rows, bypassing the resolver and its floor, "
        "to reproduce the legacy bug or prove the capacity guard. Never set it in production.",
        test_only=True,
    ),
    Setting(
        "VLLM_OVERLAY_TEST_VLLM_VERSION", _release, None, "a release X.Y.Z",
        "TEST ONLY. Presents the installed vLLM as this release to the overlay (its files are read as they "
        "are), so that the CPU build can be met as a release newer than the support matrix. Never set it in "
        "production.",
        test_only=True,
    ),
    Setting(
        "VLLM_OVERLAY_TEST_NEWEST_RELEASE", _matrix_release, None, "a release of the support matrix",
        "TEST ONLY. The release whose support rows the carry-over checks and applies, in place of the newest "
        "of the matrix (so a test on the CPU build, 0.32.0, carries 0.32.0's rows whatever releases the "
        "matrix gains). Never set it in production.",
        test_only=True,
    ),
    Setting(
        "VLLM_OVERLAY_TEST_GUARD", _bool, True, "1 or 0",
        "TEST ONLY. 0 disables the capacity guard, so an undersized buffer reaches the compiled "
        "forward as in the legacy patch tree. Never set it in production.",
        test_only=True,
    ),
)

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


def _parse(setting: Setting, name: str, raw: str) -> Any:
    try:
        return setting.parse(raw)
    except ValueError:
        raise SettingError(f"{name}={shown(raw)}: expected {setting.accepted}") from None


def shown(raw: str) -> str:
    """A value as an error names it: quoted, cut after 120 characters (saying how long it is)."""
    return repr(raw) if len(raw) <= 120 else f"{raw[:120]!r}... ({len(raw)} characters)"


def resolve(name: str, environ: Mapping[str, str] | None = None) -> Resolved:
    """Value and source of one setting, read from ``environ`` (default: os.environ)."""
    env = os.environ if environ is None else environ
    setting = BY_NAME[name]
    found: list[tuple[str, str, Any]] = []
    for key in (setting.name, *setting.aliases):
        raw = env.get(key)
        if raw is None or raw == "":
            continue
        found.append((key, raw, _parse(setting, key, raw)))
    if not found:
        value = setting.default
        if name == "VLLM_OVERLAY_REPORT_DIR" and value is None:
            value = default_report_dir()
        if name == "VLLM_OVERLAY_MOE_CONFIG_DIR" and value is None:
            value = default_moe_config_dir(env)
        return Resolved(setting, value, "default", None)
    key, raw, value = found[0]
    for other_key, other_raw, other_value in found[1:]:
        if other_value != value:
            raise SettingError(
                f"{key}={raw!r} and its alias {other_key}={other_raw!r} disagree: "
                f"set one of them, or both to the same value"
            )
    source = f"env {key}" if key == setting.name else f"alias {key}"
    return Resolved(setting, value, source, raw)


def value(name: str, environ: Mapping[str, str] | None = None) -> Any:
    return resolve(name, environ).value


def snapshot(environ: Mapping[str, str] | None = None) -> list[tuple[Setting, Resolved | SettingError]]:
    """Every setting with its resolution or the error it raises (for `doctor`)."""
    rows: list[tuple[Setting, Resolved | SettingError]] = []
    for setting in SETTINGS:
        try:
            rows.append((setting, resolve(setting.name, environ)))
        except SettingError as exc:
            rows.append((setting, exc))
    return rows


def _did_you_mean(key: str, names: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(key, names, n=1, cutoff=0.8)
    return f"; did you mean {close[0]}?" if close else ""


def check(res: Resolved) -> str | None:
    """The file-system check of a resolved setting: one line naming the variable, the value, why
    it cannot serve and what is accepted; None when it can (or has no check)."""
    st = res.setting
    if st.check is None or res.value is None:
        return None
    why = st.check(res.value, not res.is_set)
    if why is None:
        return None
    if res.is_set:
        return f"{res.source.split()[-1]}={shown(res.raw or '')}: {res.value} {why}; expected {st.accepted}"
    return f"{st.name} unset: its default {res.value} {why}: refused; set {st.name} to a directory of your own"


def off(environ: Mapping[str, str] | None = None) -> bool:
    """Whether VLLM_OVERLAY turns the overlay off (0); a bad value of it is not off."""
    try:
        return not value("VLLM_OVERLAY", environ)
    except SettingError:
        return False


def ignored_when_off(environ: Mapping[str, str] | None = None) -> list[str]:
    """The other vllm-overlay variables set while VLLM_OVERLAY=0 (not checked, not used)."""
    env = os.environ if environ is None else environ
    known = {n for s in SETTINGS for n in (s.name, *s.aliases)}
    return sorted(k for k in env if k != "VLLM_OVERLAY" and env[k] != ""
                  and (k.startswith("VLLM_OVERLAY") or k in known))


def startup_problems(environ: Mapping[str, str] | None = None) -> list[str]:
    """Every error register() stops start-up with, in order: bad values (the files and folders
    they name included), unknown VLLM_OVERLAY* names, and near misses of the legacy aliases
    (GENESIS_*, e.g. GENESIS_PROFILE_RUN_CAP for GENESIS_PROFILE_RUN_CAP_M), each with a "did you
    mean" where a known name is close. None with VLLM_OVERLAY=0: the overlay is off, its other
    settings are not judged (``ignored_when_off`` names them)."""
    env = os.environ if environ is None else environ
    if off(env):
        return []
    out: list[str] = []
    for setting in SETTINGS:
        try:
            res = resolve(setting.name, env)
        except SettingError as exc:
            out.append(str(exc))
            continue
        if (why := check(res)) is not None:
            out.append(why)
    primaries = [s.name for s in SETTINGS]
    aliases = [a for s in SETTINGS for a in s.aliases]
    known = set(primaries) | set(aliases)
    for key in sorted(env):
        if key in known:
            continue
        if key.startswith("VLLM_OVERLAY"):
            out.append(f"{key}={env[key]!r}: unknown vllm-overlay setting{_did_you_mean(key, primaries + aliases)}; "
                       "known settings: " + ", ".join(primaries))
        elif key.startswith("GENESIS_") and (hint := _did_you_mean(key, aliases)):
            out.append(f"{key}={env[key]!r}: not a vllm-overlay setting, so it has no effect{hint} (the legacy "
                       f"names vllm-overlay reads: {', '.join(aliases)})")
    return out


def validate_all(environ: Mapping[str, str] | None = None) -> None:
    """Raise the first of startup_problems() as a SettingError (called by register())."""
    problems = startup_problems(environ)
    if problems:
        raise SettingError(problems[0])
