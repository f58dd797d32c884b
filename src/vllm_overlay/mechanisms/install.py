"""Install a patch from its PatchSpec alone: when ``module_name`` is imported, apply the source
rewrites recorded for the installed release in that module, then wrap every target of that
module that applies to the release with the wrapper function bound to the target (``spec.wraps``). A failure undoes
what this call installed before it raises, so a patch is either in place for a module or not.

A patch whose spec declares the hook ``prepare`` (``PatchSpec.hooks``) has ``prepare(module_name)`` of
its module run first, when ``module_name`` is imported, for work that is not a wrap (importing a
submodule its targets live in, registering an object); its declared ``on_revert()`` undoes it, here
too when the install fails."""

from __future__ import annotations

from types import ModuleType

from vllm_overlay.mechanisms import rewrite, wrap
from vllm_overlay.spec import PatchSpec, Target, binding_problems


def install(spec: PatchSpec, patch_module: ModuleType, module_name: str, version: str,
            platform: str | None = None, check_params: bool = False) -> list[wrap.Installed]:
    """``version``: the release whose targets and rewrites to install. ``check_params``: first check that
    each wrapped target takes the parameters its wrapper reads (a patch carried over to a release newer
    than the matrix, where no sweep checked them), else raise naming the target and the parameters."""
    unbound = binding_problems(spec)
    if unbound:
        raise ValueError("; ".join(unbound))
    out: list[wrap.Installed] = []
    prepare = getattr(patch_module, "prepare", None) if "prepare" in spec.hooks else None
    try:
        if callable(prepare):
            prepare(module_name)
        for rw in spec.rewrites_for(version):
            if rw.target.module == module_name and rw.target.on_platform(platform):
                out.append(rewrite.apply(rw, spec.id))
        for t in spec.wrap_targets(version, platform):
            if t.module != module_name:
                continue
            assert t.wrapper is not None  # wrap_targets holds the bound targets only
            if check_params and t.params:
                _check_params(t)
            out.append(wrap.wrap(t.module, t.qualname, t.wrapper))
    except Exception:
        for done in reversed(out):
            done.undo()
        if callable(prepare) and "on_revert" in spec.hooks:
            patch_module.on_revert()
        raise
    if not out:
        raise RuntimeError(
            f"patch {spec.id!r}: nothing of {module_name} to install on vLLM {version} "
            "(the spec names this module but no target or rewrite of it applies)"
        )
    return out


def _check_params(target: Target) -> None:
    import inspect

    _, _, current = wrap.resolve(target.module, target.qualname)
    func = getattr(current, "__func__", current)
    try:
        names = set(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return  # no signature to read (a builtin): the wrapper reads arguments as vLLM passes them
    missing = [p for p in target.params if p not in names]
    if missing:
        raise TypeError(f"{target} takes no parameter(s) {', '.join(missing)}, which its wrapper {target.wrapper_name} "
                        f"reads (found: {', '.join(names) or 'none'})")
