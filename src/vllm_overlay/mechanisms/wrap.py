"""Wrapping with wrapt, with revert, post-import hooks and a check for cached copies.

``resolve`` walks the class's own ``__dict__`` along the MRO (as wrapt's resolve_path does) so
the attribute is replaced where it is really defined and restored exactly on revert.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import wrapt

_HOOK_LOCK = threading.Lock()


@dataclass
class Installed:
    """A replaced attribute: ``owner.name`` was ``original`` and is now ``replacement``."""

    owner: Any
    name: str
    original: Any
    replacement: Any
    where: str
    cached_copies: tuple[str, ...] = ()

    def undo(self) -> None:
        current = self.owner.__dict__.get(self.name) if isinstance(self.owner, type) else getattr(
            self.owner, self.name, None
        )
        if current is not self.replacement:
            raise RuntimeError(
                f"{self.where} was changed by someone else after vllm-overlay patched it; "
                "not restoring over their change"
            )
        setattr(self.owner, self.name, self.original)


def resolve(module_name: str, qualname: str) -> tuple[Any, str, Any]:
    """(owner, attribute name, current value) of ``module:qualname``, read from __dict__."""
    module = importlib.import_module(module_name)
    owner: Any = module
    parts = qualname.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part)
    name = parts[-1]
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if name in vars(klass):
                # the defining class's own attribute (no descriptor binding); when it comes from a
                # base class, the patch is set on the class we were asked for and revert restores it
                return owner, name, vars(klass)[name]
        raise AttributeError(f"{module_name}:{qualname}: {owner.__name__} has no attribute {name!r}")
    if not hasattr(owner, name):
        raise AttributeError(f"{module_name}:{qualname}: no attribute {name!r}")
    return owner, name, getattr(owner, name)


def cached_copies(original: Any, owner: Any, name: str) -> tuple[str, ...]:
    """Modules holding ``original`` under some name (``from x import f``): they bypass a patch."""
    if isinstance(owner, type):
        return ()
    found = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or mod is owner:
            continue
        try:
            items = list(vars(mod).items())
        except TypeError:
            continue
        for attr, value in items:
            if value is original:
                found.append(f"{mod_name}.{attr}")
    return tuple(sorted(found))


def wrap(module_name: str, qualname: str, wrapper: Callable[..., Any]) -> Installed:
    """Wrap ``module:qualname`` with ``wrapper(wrapped, instance, args, kwargs)``."""
    owner, name, original = resolve(module_name, qualname)
    if isinstance(original, wrapt.ObjectProxy) and getattr(original, "_self_overlay", False):
        raise RuntimeError(f"{module_name}:{qualname} is already wrapped by vllm-overlay")
    replacement = wrapt.FunctionWrapper(original, wrapper)
    replacement._self_overlay = True
    setattr(owner, name, replacement)
    return Installed(owner, name, original, replacement, f"{module_name}:{qualname}",
                     cached_copies(original, owner, name))


def rebind(module_name: str, qualname: str, new: Any) -> Installed:
    """Replace ``module:qualname`` with ``new`` (used by the source rewrite)."""
    owner, name, original = resolve(module_name, qualname)
    setattr(owner, name, new)
    return Installed(owner, name, original, new, f"{module_name}:{qualname}",
                     cached_copies(original, owner, name))


def when_imported(module_name: str, hook: Callable[[Any], None]) -> bool:
    """Run ``hook(module)`` now if the module is imported, else when it first is.

    Returns True when the hook ran at once. The hook itself must check whether it is still
    wanted (wrapt cannot unregister a post-import hook).
    """
    with _HOOK_LOCK:
        if module_name in sys.modules and sys.modules[module_name] is not None:
            hook(sys.modules[module_name])
            return True
        wrapt.register_post_import_hook(hook, module_name)
        return False
