"""moe-configs: tuned fused-MoE kernel configs for the hybrid MoE shapes, for the exact device only.

vLLM picks the Triton tile sizes of its fused-MoE kernel from a JSON file named
``E={E},N={N},device_name={device}[,dtype={dtype}][,block_shape=[n,k]].json``, looked up in
``VLLM_TUNED_CONFIG_FOLDER`` and then in the configs folder it ships. For the experts of
Qwen3-Next / Qwen3.6-35B-A3B (E=256, N=512 at one GPU, N=256 at tensor parallel 2, bf16) it ships
none for most cards, logs ``Using default MoE config. Performance might be sub-optimal!`` and falls
back to a generic heuristic.

This patch wraps ``get_moe_configs`` (outside its lru_cache). When vLLM's own lookup would find a
file, vLLM answers unchanged. Otherwise it looks for the very same file name (vLLM computes it,
device name included, so a config is only ever used on the device it was tuned on) in the folder
``vllm-overlay tune-moe`` writes (``VLLM_OVERLAY_MOE_CONFIG_DIR``) and then in the configs that ship
with this package. The report records, per (E, N, dtype, device), the file used or "vLLM default",
and each shape gets one log line.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from types import ModuleType
from typing import Any

from vllm_overlay import report, settings
from vllm_overlay.logs import LOG
from vllm_overlay.report import STATE
from vllm_overlay.spec import PatchSpec, Proof, Support, Target, why_from, wraps

FUSED_MOE = "vllm.model_executor.layers.fused_moe.fused_moe"
PATCH_ID = "moe-configs"
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "moe_configs")
CONFIG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")

FM_PATH = "model_executor/layers/fused_moe/fused_moe.py"

GET_CONFIGS = Target(FUSED_MOE, "get_moe_configs", "<=0.33.0", params=("E", "N", "dtype", "block_n", "block_k"))
GET_CONFIGS_DOWN = Target(FUSED_MOE, "get_moe_configs", ">=0.34.0",
                          params=("E", "N", "dtype", "block_n", "block_k", "down_moe"))

SPEC = PatchSpec(
    id=PATCH_ID,
    hooks=("on_revert",),
    title="Tuned fused-MoE configs for the hybrid MoE shapes, for the exact device only",
    why=why_from(__doc__),
    upstream="https://github.com/vllm-project/vllm/blob/v0.20.2/vllm/model_executor/layers/fused_moe/fused_moe.py "
             "(get_moe_configs; configs/ holds no E=256,N=512 bf16 file for the H200)",
    targets=(GET_CONFIGS, GET_CONFIGS_DOWN),
    mechanism="wrap",
    support=(
        Support(">=0.20.0,<=0.33.0", "applies",
                "get_moe_configs(E, N, dtype, block_n, block_k) is an lru_cache'd module function that "
                "try_get_optimal_moe_config calls by its module-global name (so the wrapper, installed "
                "outside the cache, sees every lookup); vLLM ships no tuned E=256,N=512 bf16 file for the H200 "
                "in any of these releases (for the H100 only, plus A100 80GB PCIe and H20 in later ones)",
                (Proof(FM_PATH, "@functools.lru_cache\ndef get_moe_configs(\n    E: int,\n    N: int,\n"
                                "    dtype: str | None,\n    block_n: int | None = None,\n"
                                "    block_k: int | None = None,\n) -> dict[int, Any] | None:"),
                 Proof(FM_PATH, "configs = get_moe_configs(E, N, dtype, block_n, block_k)"),
                 Proof(FM_PATH, "user_defined_config_folder = envs.VLLM_TUNED_CONFIG_FOLDER"))),
        Support("==0.34.0", "applies",
                "as before, with a new argument down_moe (the Triton experts ask for a separate down-projection "
                "config, file name ending _down.json, for block-FP8 weights): the wrapper passes it on, keys "
                "its decisions by it, and looks only for the _down.json name vLLM would, so a gate/up config is "
                "never handed to the down projection",
                (Proof(FM_PATH, "@functools.lru_cache\ndef get_moe_configs(\n    E: int,\n    N: int,\n"
                                "    dtype: str | None,\n    block_n: int | None = None,\n"
                                "    block_k: int | None = None,\n    down_moe: bool = False,\n"
                                ") -> dict[int, Any] | None:"),
                 Proof(FM_PATH, 'json_file_name = json_file_name.removesuffix(".json") + "_down.json"'),
                 Proof(FM_PATH, "configs = get_moe_configs(E, N, dtype, block_n, block_k)"),
                 Proof(FM_PATH, "user_defined_config_folder = envs.VLLM_TUNED_CONFIG_FOLDER"))),
    ),
    default=True,
    retire_when="vLLM ships tuned configs for E=256,N=512 and N=256 (bf16, fp8) for the cards users serve on, "
                "or users point VLLM_TUNED_CONFIG_FOLDER at their tuned folder themselves.",
    settings=("VLLM_OVERLAY_MOE_CONFIG_DIR",),
    beyond_matrix="carry",
    beyond_matrix_why=("a fused-MoE config only chooses tile sizes for vLLM's own kernel: a misfit costs speed, not "
                       "correctness"),
)


# ---- where configs live -----------------------------------------------------------------------


def user_dir() -> str:
    """The folder `tune-moe` writes and this patch reads (VLLM_OVERLAY_MOE_CONFIG_DIR, default
    vllm-overlay/moe-configs under $XDG_CACHE_HOME or ~/.cache)."""
    return str(settings.value("VLLM_OVERLAY_MOE_CONFIG_DIR"))


def shipped_files() -> list[str]:
    if not os.path.isdir(SHIPPED_DIR):
        return []
    return sorted(f for f in os.listdir(SHIPPED_DIR) if f.endswith(".json"))


def device_of(file_name: str) -> str:
    """The device part of a vLLM config file name (``...,device_name=NVIDIA_H200,dtype=...``)."""
    part = file_name.split("device_name=", 1)[-1]
    return part.split(",", 1)[0].removesuffix(".json")


def dtype_label(dtype: str | None) -> str:
    return dtype or "bf16/fp16"  # vLLM names no dtype for the unquantized kernel


def shape_key(E: int, N: int, dtype: str | None, block_shape: list[int] | None, device: str,  # noqa: N803
              down_moe: bool = False) -> str:
    blocks = f",block_shape=[{block_shape[0]},{block_shape[1]}]" if block_shape else ""
    return f"E={E},N={N},dtype={dtype_label(dtype)}{blocks},device={device}" + (",down" if down_moe else "")


def down_name(file_name: str) -> str:
    """The file vLLM 0.34.0 reads for a down-projection lookup (``get_moe_configs(..., down_moe=True)``)."""
    return file_name.removesuffix(".json") + "_down.json"


def vllm_paths(module: ModuleType, file_name: str) -> list[str]:
    """The paths vLLM's own get_moe_configs tries, in its order (same in 0.20.0 to 0.33.0)."""
    paths = []
    folder = getattr(getattr(module, "envs", None), "VLLM_TUNED_CONFIG_FOLDER", None)
    if folder is not None:
        paths.append(os.path.join(folder, file_name))
    paths.append(os.path.join(os.path.dirname(os.path.realpath(module.__file__)), "configs", file_name))
    return paths


def load_config_file(path: str) -> dict[int, dict[str, Any]]:
    """A config file in vLLM's format: {"<batch size>": {BLOCK_SIZE_M: ..., ...}, "triton_version": ...}.
    Raises ValueError naming the file and what is wrong."""
    with open(path) as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object of batch size -> config")
    raw.pop("triton_version", None)
    out: dict[int, dict[str, Any]] = {}
    for key, cfg in raw.items():
        if not str(key).isdigit() or int(key) < 1:
            raise ValueError(f"{path}: key {key!r}: expected a batch size (an integer >= 1)")
        if not isinstance(cfg, dict) or any(k not in cfg for k in CONFIG_KEYS[:4]):
            raise ValueError(f"{path}: batch size {key}: expected an object with {', '.join(CONFIG_KEYS)}")
        out[int(key)] = cfg
    if not out:
        raise ValueError(f"{path}: no batch sizes in the file")
    return out


# ---- the wrapper ------------------------------------------------------------------------------

_LOCK = threading.Lock()
_DECIDED: dict[tuple[Any, ...], tuple[str, dict[int, Any] | None, bool]] = {}  # args -> (source, ours, ours?)


_NOTED_SHIPPED = [False]  # the report names the shipped configs once, at the first lookup


def reset() -> None:
    """Forget decided shapes (revert, tests)."""
    with _LOCK:
        _DECIDED.clear()
        _NOTED_SHIPPED[0] = False


def note_shipped() -> None:
    """Record, once per process, which configs ship with this package (at the first lookup: the
    patch itself is only the wrapper declared in SPEC)."""
    with _LOCK:
        if _NOTED_SHIPPED[0]:
            return
        _NOTED_SHIPPED[0] = True
    shipped = shipped_files()
    report.patch_note(PATCH_ID, shipped_configs=shipped)
    if not shipped:
        STATE.event("moe-configs: no tuned configs ship with this vllm-overlay; user-tuned files in "
                    f"{user_dir()} are used for the exact device they were tuned on")


def on_revert() -> None:
    reset()


def _args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int, str | None, int | None, int | None,
                                                                  bool]:
    """(E, N, dtype, block_n, block_k, down_moe) of a get_moe_configs call (down_moe: vLLM 0.34.0 on)."""
    names = ("E", "N", "dtype", "block_n", "block_k", "down_moe")
    vals: list[Any] = [None, None, None, None, None, False]
    if len(args) > len(names) or any(k not in names for k in kwargs):
        raise TypeError("unknown get_moe_configs arguments")
    for i, v in enumerate(args):
        vals[i] = v
    for i, n in enumerate(names):
        if n in kwargs:
            vals[i] = kwargs[n]
    return int(vals[0]), int(vals[1]), vals[2], vals[3], vals[4], bool(vals[5])


def _record(key: str, source: str, line: str, warn: bool) -> None:
    report.patch_put(PATCH_ID, "moe_configs", key, source)
    (LOG.warning if warn else LOG.info)(line)
    STATE.write()


def decide(module: ModuleType, E: int, N: int, dtype: str | None,  # noqa: N803
           block_n: int | None, block_k: int | None, down_moe: bool = False) -> tuple[str, str | None, str]:
    """(report key, our file to load or None, the report's source text) for one shape; a down-projection
    lookup (``down_moe``) looks for the ``_down.json`` name only, as vLLM does."""
    block_shape = [block_n, block_k] if block_n and block_k else None
    name = module.get_config_file_name(E, N, dtype, block_shape)
    device = device_of(name)
    if down_moe:
        name = down_name(name)
    key = shape_key(E, N, dtype, block_shape, device, down_moe)
    if getattr(getattr(module, "envs", None), "VLLM_BATCH_INVARIANT", False):
        return key, None, "vLLM default (VLLM_BATCH_INVARIANT is set: vLLM uses no tuned config)"
    for path in vllm_paths(module, name):
        if os.path.exists(path):
            return key, None, path
    for path in (os.path.join(user_dir(), name), os.path.join(SHIPPED_DIR, name)):
        if os.path.exists(path):
            return key, path, path
    return key, None, "vLLM default"


@wraps(GET_CONFIGS, GET_CONFIGS_DOWN)
def _get_moe_configs(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        E, N, dtype, block_n, block_k, down_moe = _args(args, kwargs)  # noqa: N806
    except (TypeError, ValueError):
        return wrapped(*args, **kwargs)  # a call shape we do not know: vLLM decides alone
    cache_key = (E, N, dtype, block_n, block_k, down_moe)
    with _LOCK:
        hit = _DECIDED.get(cache_key)
    if hit is not None:
        source, configs, ours = hit
        return configs if ours else wrapped(*args, **kwargs)
    module = sys.modules[FUSED_MOE]
    try:
        note_shipped()
        key, ours_path, source = decide(module, E, N, dtype, block_n, block_k, down_moe)
    except Exception as exc:  # noqa: BLE001 - never break vLLM's kernel path: vLLM decides alone
        LOG.warning("moe-configs: E=%d N=%d dtype=%s: lookup failed (%s: %s); vLLM decides alone",
                    E, N, dtype_label(dtype), type(exc).__name__, exc)
        STATE.event(f"moe-configs: E={E},N={N},dtype={dtype_label(dtype)}: lookup failed: {exc}")
        with _LOCK:
            _DECIDED[cache_key] = ("vLLM (lookup failed)", None, False)
        return wrapped(*args, **kwargs)
    device = key.rsplit("device=", 1)[-1]
    configs: dict[int, Any] | None = None
    if ours_path is not None:
        try:
            configs = load_config_file(ours_path)
        except (OSError, ValueError) as exc:
            source = "vLLM default"
            _record(key, f"vLLM default (unreadable {ours_path}: {exc})",
                    f"moe-configs: {key}: vLLM default; could not use {ours_path}: {exc}", warn=True)
            ours_path = None
    if ours_path is not None:
        kind = "user-tuned" if not ours_path.startswith(SHIPPED_DIR + os.sep) else "shipped with vllm-overlay"
        _record(key, ours_path, f"moe-configs: {key}: {ours_path} ({kind}, {len(configs or {})} batch sizes)",
                warn=False)
    elif source == "vLLM default":
        shipped = [f for f in shipped_files() if device_of(f) == device]
        note = (f"no shipped config for device {device}" if not shipped
                else f"vllm-overlay ships {len(shipped)} config(s) for {device}, none for this shape")
        _record(key, "vLLM default",
                f"moe-configs: {key}: vLLM default ({note}; no tuned file in {user_dir()}; "
                f"`vllm-overlay tune-moe` writes one)", warn=False)
    elif key not in report.patch_entry(PATCH_ID).get("moe_configs", {}):
        _record(key, source, f"moe-configs: {key}: {source} (vLLM's own lookup)", warn=False)
    with _LOCK:
        _DECIDED[cache_key] = (source, configs, ours_path is not None)
    return configs if ours_path is not None else wrapped(*args, **kwargs)
