"""Wrapping with wrapt, with revert, post-import hooks and a check for cached copies.

``resolve`` walks the class's own ``__dict__`` along the MRO (as wrapt's resolve_path does) so
the attribute is replaced where it is really defined and restored exactly on revert.

Every wrapper this module makes carries the id of the patch that made it (``MARK`` on the
wrapper object itself, read without going through the proxy, so an outer wrapper never reports
an inner one's mark). Several patches may wrap the same method (``GPUModelRunner._dummy_run`` is
wrapped by three); the same patch wrapping it twice is refused. The mark is ours, so this works
the same under wrapt 1.x (where ``FunctionWrapper`` is an ``ObjectProxy``) and 2.x (where it is not).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import wrapt

_HOOK_LOCK = threading.Lock()
MARK = "_self_overlay_patch"  # wrapt keeps ``_self_`` attributes on the wrapper, not the wrapped
_installing = threading.local()  # the patch whose install() runs in this thread (set by core)


def _renew_after_fork() -> None:
    global _HOOK_LOCK, _installing
    _HOOK_LOCK = threading.Lock()
    _installing = threading.local()


os.register_at_fork(after_in_child=_renew_after_fork)


@contextlib.contextmanager
def installing(patch_id: str) -> Iterator[None]:
    """Wrappers made inside this block carry ``patch_id`` (core runs each install() in one)."""
    before = getattr(_installing, "patch", None)
    _installing.patch = patch_id
    try:
        yield
    finally:
        _installing.patch = before


def mark_of(obj: Any) -> str | None:
    """The patch id this exact object was marked with by ``wrap``, or None (never forwarded to a
    wrapped object: a wrapt proxy would answer with the wrapped object's attributes)."""
    try:
        value = object.__getattribute__(obj, MARK)
    except (AttributeError, TypeError):
        return None
    return value if isinstance(value, str) else None


def wrapper_chain(obj: Any, limit: int = 64) -> list[Any]:
    """``obj`` and every object below it through ``__wrapped__`` (wrapt proxies, functools.wraps)."""
    chain = [obj]
    while len(chain) < limit:
        try:
            inner = object.__getattribute__(chain[-1], "__wrapped__")
        except (AttributeError, TypeError, ValueError):
            try:
                inner = chain[-1].__wrapped__
            except Exception:  # noqa: BLE001 - not a wrapper
                break
        if inner is None or any(inner is c for c in chain):
            break
        chain.append(inner)
    return chain


def marks(obj: Any) -> list[str]:
    """Patch ids of the overlay wrappers in ``obj``'s wrapper chain, outermost first."""
    return [m for m in (mark_of(o) for o in wrapper_chain(obj)) if m is not None]


def argument(params: tuple[str, ...], name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
             default: Any = None) -> Any:
    """The value of parameter ``name`` in a wrapped call ``(args, kwargs)`` of a function whose
    parameters are ``params`` in order (keyword first, then position; ``default`` when not passed)."""
    if name in kwargs:
        return kwargs[name]
    position = params.index(name)
    return args[position] if len(args) > position else default


def with_argument(params: tuple[str, ...], name: str, value: Any, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` with parameter ``name`` set to ``value`` where the call passed it (by keyword
    when it passed it so, or not at all); the caller's tuple and dict are not changed."""
    position = params.index(name)
    if name in kwargs or len(args) <= position:
        return args, {**kwargs, name: value}
    return args[:position] + (value,) + args[position + 1:], kwargs


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
        """Restore ``original``. When another vllm-overlay wrapper was put over ours since (three
        patches wrap ``_dummy_run``), ours is cut out of the chain below it instead, so a failed or
        reverted patch never leaves its wrapper behind. Anything else changed it: refuse."""
        current = self.owner.__dict__.get(self.name) if isinstance(self.owner, type) else getattr(
            self.owner, self.name, None
        )
        if current is self.replacement:
            setattr(self.owner, self.name, self.original)
            _LIVE.pop(id(self.replacement), None)
            return
        above = current
        while mark_of(above) is not None:  # walk down our own wrappers only
            inner = above.__wrapped__
            if inner is self.replacement:
                above.__wrapped__ = self.original
                outer_rec = _LIVE.get(id(above))
                if outer_rec is not None and outer_rec.replacement is above:
                    outer_rec.original = self.original
                _LIVE.pop(id(self.replacement), None)
                return
            above = inner
        raise RuntimeError(
            f"{self.where} was changed by someone else after vllm-overlay patched it; "
            "not restoring over their change"
        )


_LIVE: dict[int, Installed] = {}  # id(replacement) -> its record, while the replacement is in place


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


def wrap(module_name: str, qualname: str, wrapper: Callable[..., Any], patch: str | None = None) -> Installed:
    """Wrap ``module:qualname`` with ``wrapper(wrapped, instance, args, kwargs)``, marked with
    ``patch`` (default: the patch whose install() is running, see ``installing``)."""
    patch = patch or getattr(_installing, "patch", None)
    if not patch:
        raise ValueError(
            f"wrap({module_name}:{qualname}): patch=None and no patch is installing; pass patch='<id>'"
        )
    owner, name, original = resolve(module_name, qualname)
    if patch in marks(original):
        raise RuntimeError(
            f"{module_name}:{qualname} is already wrapped by vllm-overlay patch {patch!r}; "
            "refusing to wrap it twice"
        )
    replacement = wrapt.FunctionWrapper(original, wrapper)
    setattr(replacement, MARK, patch)
    setattr(owner, name, replacement)
    rec = Installed(owner, name, original, replacement, f"{module_name}:{qualname}",
                    cached_copies(original, owner, name))
    _LIVE[id(replacement)] = rec
    return rec


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
