"""Named errors. Every message names the setting or argument, the value, and what is accepted."""

from __future__ import annotations


class OverlayError(Exception):
    """Base class of every error vllm-overlay raises on purpose."""


class SettingError(OverlayError, ValueError):
    """A setting (environment variable) has a value outside what it accepts."""


class UnknownPatchError(OverlayError, ValueError):
    """A patch id given in a switch is not in the registry."""


class PatchConflictError(OverlayError):
    """Two enabled patches conflict, or an enabled patch requires a disabled one."""


class AnchorError(OverlayError):
    """A source rewrite cannot apply: the anchor or the pristine hash does not match."""


class StrictModeError(OverlayError):
    """VLLM_OVERLAY_STRICT=1 and an enabled patch could not apply."""


class BudgetError(OverlayError, ValueError):
    """A token budget cannot be used (strict mode refused a raise, or it is out of range)."""


class CapacityError(OverlayError, RuntimeError):
    """A forward asked for more rows than a preallocated buffer holds.

    Raised from uncompiled code before the forward runs, so a compiled graph never
    slices past the end of a buffer.
    """
