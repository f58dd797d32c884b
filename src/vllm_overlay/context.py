"""What core hands a patch about the other patches of its process.

core imports the patches (through the registry) and installs them; a patch never imports core. A
patch whose behaviour depends on which other patches are live declares the hook ``bind``
(``PatchSpec.hooks``) and defines ``bind(context)``: core calls it with the process's PatchContext
before the patch's first target is installed, and the patch keeps it. Today compile-cache-key (it
folds the live patches that change traced code into vLLM's compile-cache key) and profile-run-cap
(its warning says whether memory-headroom measures the forward it caps) read it. Until core binds a
context (a patch module imported on its own, a tool) ``UNBOUND`` answers: no patch is live.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from vllm_overlay.spec import PatchSpec


@dataclass(frozen=True)
class PatchContext:
    """A read-only view of the process's patches that core keeps current."""

    applied_ids: Callable[[], list[str]]  # ids of the live patches whose status is "applied"
    traced_code_ids: Callable[[], list[str]]  # sorted ids of the live patches that change traced code
    specs: tuple[PatchSpec, ...] = ()  # the registry's specs, in install order

    def traced_settings(self) -> tuple[str, ...]:
        """The settings that change what the overlay's traced code does: each ``traced_settings`` of the
        specs that change traced code, in registry order, each once."""
        out: list[str] = []
        for spec in self.specs:
            if spec.changes_traced_code:
                out.extend(n for n in spec.traced_settings if n not in out)
        return tuple(out)


UNBOUND = PatchContext(applied_ids=list, traced_code_ids=list)
