"""compile-cache-key: make vLLM's compile-cache key see the overlay's in-memory code changes."""

from __future__ import annotations

import hashlib
from typing import Any

from vllm_overlay import settings
from vllm_overlay.context import UNBOUND, PatchContext
from vllm_overlay.spec import PatchSpec, Proof, Support, Target, wraps

MODULE = "vllm.config.vllm"
QUALNAME = "VllmConfig.compute_hash"  # vLLM 0.20.0-0.33.0: the config's part of the key, a hex string
FACTORS = "VllmConfig.compile_factors"  # vLLM 0.34.0 and later: the config's part of the key, a dict
FACTOR_KEY = "vllm_overlay"  # the entry the overlay adds to compile_factors() (only while it changes traced code)

COMPUTE_HASH = Target(MODULE, QUALNAME, "<=0.33.0")
COMPILE_FACTORS = Target(MODULE, FACTORS, ">=0.34.0")


def traced_settings() -> tuple[str, ...]:
    """The settings that change what the overlay's traced code does: every registry patch with
    ``changes_traced_code`` names them in its ``traced_settings`` (in registry order, each once). Read
    from the other patches' specs for this spec's ``settings`` (what it reads); the key itself reads them
    from the context core binds (PatchContext.traced_settings, the same list)."""
    import importlib

    from vllm_overlay.registry import PATCH_MODULES

    out: list[str] = []
    for name in PATCH_MODULES:
        if name == __name__:
            continue
        spec = importlib.import_module(name).SPEC
        if spec.changes_traced_code:
            out.extend(n for n in spec.traced_settings if n not in out)
    return tuple(out)


def _spec() -> PatchSpec:
    return PatchSpec(
        id="compile-cache-key",
        title="Mix the overlay's traced-code patches into vLLM's compile-cache key",
        why=(
            "vLLM caches compiled graphs under a key made from its config and the contents of the "
            "traced source files on disk. An in-memory rewrite changes neither, so a graph compiled "
            "with a patched forward is loaded by a later run without the patch (seen on the H200: "
            "\"'GatedDeltaNetAttention' object has no attribute '_legacy_buf'\"), and the reverse. "
            "This patch folds the ids of the live patches that change traced code, and the settings "
            "that change what that code does, into VllmConfig.compute_hash() (vLLM 0.20.0-0.33.0) or, "
            "from 0.34.0, into VllmConfig.compile_factors() as one more entry. With no such patch "
            "live the key is exactly stock vLLM's, so an overlay-off run shares stock's cache."
        ),
        upstream="https://github.com/vllm-project/vllm/blob/v0.20.2/vllm/compilation/backends.py",
        targets=(COMPUTE_HASH, COMPILE_FACTORS),
        mechanism="wrap",
        support=(
            Support(">=0.20.0,<=0.33.0", "applies",
                    "VllmConfig.compute_hash, which the patch folds the traced-code patches into, exists "
                    "in every release"),
            Support("==0.34.0", "applies",
                    "compute_hash gave way to VllmConfig.compile_factors(), a dict the compile cache hashes "
                    "(compilation/caching.py, compute_env_and_config_hashes); the patch adds its digest as "
                    f"the entry {FACTOR_KEY!r} while a live patch changes traced code, and nothing otherwise",
                    (Proof("compilation/caching.py", "config_factors = vllm_config.compile_factors()"),
                     Proof("compilation/caching.py", "config_hash = hash_factors(config_factors)"),
                     Proof("config/vllm.py", "def compile_factors(self, include_version: bool = True) -> "
                                             "CompileFactors:"),
                     Proof("config/vllm.py", "def compute_hash(", present=False))),
        ),
        default=True,
        retire_when="vLLM offers a hook for plugins to contribute to the compile-cache key.",
        settings=traced_settings(),  # what it reads: the traced patches' traced_settings
        hooks=("bind",),
        beyond_matrix="carry",
        beyond_matrix_why=("it only folds the overlay's traced-code patches into vLLM's compile-cache key; where "
                           "VllmConfig.compute_hash is gone its wrap fails at start-up, loudly"),
    )


def __getattr__(name: str) -> Any:
    """``SPEC`` is built on first use, from the other patches' specs (which import nothing of this one)."""
    if name == "SPEC":
        spec = _spec()
        globals()["SPEC"] = spec
        return spec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_context: list[PatchContext] = [UNBOUND]  # what core binds before the first target is installed


def bind(context: PatchContext) -> None:
    _context[0] = context


def overlay_factor() -> str:
    """'' when no live patch changes traced code, else a stable digest of what does."""
    context = _context[0]
    parts = context.traced_code_ids()
    if not parts:
        return ""
    env = [f"{n}={settings.resolve(n).value!r}" for n in context.traced_settings()]
    from vllm_overlay import __version__

    return hashlib.sha256("|".join([__version__, *parts, *env]).encode()).hexdigest()


@wraps(COMPUTE_HASH)
def _compute_hash(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    h = wrapped(*args, **kwargs)
    factor = overlay_factor()
    if not factor or not isinstance(h, str):
        return h
    return hashlib.sha256(f"{h}|vllm-overlay:{factor}".encode()).hexdigest()[: len(h)]


@wraps(COMPILE_FACTORS)
def _compile_factors(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    factors = wrapped(*args, **kwargs)
    factor = overlay_factor()
    if not factor or not isinstance(factors, dict):
        return factors
    return {**factors, FACTOR_KEY: factor}
