"""vllm-overlay: declared, reversible patches for vLLM, applied in every vLLM process.

Importing this package does nothing. vLLM calls ``register()`` (entry point group
``vllm.general_plugins``, name ``overlay``) in each of its processes; ``revert()`` takes every
applied patch off; ``flush()`` writes this process's JSON report now.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["register", "revert", "flush", "__version__"]


def register() -> None:
    """Apply the registry's patches in this process (re-entrant, idempotent).

    A bad setting (or a switch naming an unknown patch, a conflict, a strict-mode refusal) raises
    its named error. In a vLLM server process (``vllm serve``, ``python -m vllm.entrypoints...``)
    it stops the server instead with that one ERROR line and exit code 2: vLLM calls plugins
    without catching, so the error would otherwise end in a 20-line traceback."""
    from vllm_overlay.core import register as _register
    from vllm_overlay.errors import OverlayError

    try:
        _register()
    except OverlayError as exc:
        if not _vllm_cli():
            raise
        import logging

        from vllm_overlay import logs

        logs.setup()
        logging.getLogger("vllm_overlay").error("%s; the server is not started", exc)
        raise SystemExit(2) from None


def _vllm_cli() -> bool:
    """Whether this process is vLLM's command line (``vllm serve``) or one of its entrypoints."""
    import os
    import sys

    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and str(getattr(spec, "name", "")).startswith("vllm.entrypoints"):
        return True
    return bool(sys.argv) and os.path.basename(sys.argv[0]) == "vllm"


def revert() -> list[str]:
    """Take every patch this process applied off again; returns what could not be taken off."""
    from vllm_overlay.core import revert as _revert

    return _revert()


def flush() -> str | None:
    """Write this process's report now; returns the file's path."""
    from vllm_overlay.report import flush as _flush

    return _flush()
