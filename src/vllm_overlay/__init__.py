"""vllm-overlay: declared, reversible patches for vLLM, applied in every vLLM process.

Importing this package does nothing. vLLM calls ``register()`` (entry point group
``vllm.general_plugins``, name ``overlay``) in each of its processes; ``revert()`` takes every
applied patch off; ``flush()`` writes this process's JSON report now.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["register", "revert", "flush", "__version__"]


def register() -> None:
    """Apply the registry's patches in this process (re-entrant, idempotent)."""
    from vllm_overlay.core import register as _register

    _register()


def revert() -> list[str]:
    """Take every patch this process applied off again; returns what could not be taken off."""
    from vllm_overlay.core import revert as _revert

    return _revert()


def flush() -> str | None:
    """Write this process's report now; returns the file's path."""
    from vllm_overlay.report import flush as _flush

    return _flush()
