"""Shared helpers for patches on vLLM's two model runners, and the check that their hooks fired.

vLLM's worker builds one of two model runners:

- V1: ``vllm.v1.worker.gpu_model_runner.GPUModelRunner`` (the CPU build's
  ``vllm.v1.worker.cpu_model_runner.CPUModelRunner`` inherits it). Every forward goes through
  ``_model_forward``; dummy, profiling, warm-up and graph-capture forwards through ``_dummy_run``.
- V2 (Model Runner V2): ``vllm.v1.worker.gpu.model_runner.GPUModelRunner`` (the CPU build's
  ``vllm.v1.worker.cpu.model_runner.CPUModelRunner`` inherits it). It has no ``_model_forward``:
  real forwards go through ``execute_model`` -> ``prepare_inputs(..., batch_desc)``; dummy and
  profiling forwards through ``_dummy_run`` -> ``execute_model(..., dummy_run=True)``; CUDA graphs
  are captured by its graph manager inside ``capture_model`` (``capture_model(profile_only=True)``
  measures graph memory from 0.30.0); start-up warm-up runs ``execute_model`` on requests named
  ``_warmup_{i}_``. Opt-in with ``VLLM_USE_V2_MODEL_RUNNER=1``; vLLM chooses it by itself on CUDA in
  recent releases (``VllmConfig.use_v2_model_runner``).

A patch wraps the methods of both classes (its ``PatchSpec`` lists both, with per-release
ranges); which wrappers run is decided by the runner the worker actually builds. Each runner
wrapper calls ``fired(patch, runner, hook)``; each runner patch also wraps the worker's
``execute_model`` with ``first_forward_check(...)``, which, after the worker's first forward,
checks that every hook of the patch on the built runner is in place and that the ones every
forward passes through fired. One that did not is a loud WARNING (counter
``runner_hooks_not_fired``) or, under VLLM_OVERLAY_STRICT=1, a ``StrictModeError`` that stops the
engine at that forward (on V2 that is the start-up warm-up; on V1 the first request).
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from vllm_overlay import report, settings
from vllm_overlay.errors import StrictModeError
from vllm_overlay.report import LOG, STATE

RUNNER_CLASS = "GPUModelRunner"
V1_MODULE = "vllm.v1.worker.gpu_model_runner"
V2_MODULE = "vllm.v1.worker.gpu.model_runner"
V1_RELEASES = "<=0.33.0"  # the releases that have the V1 runner (0.34.0 removed it): its targets' range
RUNNER_MODULE, RUNNER = V1_MODULE, RUNNER_CLASS  # the V1 runner (the names earlier code uses)
KIND_OF_MODULE = {V1_MODULE: "V1", V2_MODULE: "V2"}
RUNNER_MODULES = (V1_MODULE, V2_MODULE)  # a PatchSpec's either_modules group: vLLM imports the one it builds
WORKER_MODULE = "vllm.v1.worker.gpu_worker"  # Worker; the CPU build's CPUWorker inherits its execute_model
WORKER = "Worker"
WARMUP_PREFIX = "_warmup_"  # Model Runner V2's start-up warm-up requests (vllm/v1/worker/gpu/warmup.py)
# every request id prefix of V2's warm-up steps: the kernel warm-up's _warmup_{i}_, the mixed prefill +
# decode warm-up's _v2_mixed_warmup_* (from 0.34.0 also the extensible KV cache's sizing steps, one of
# max_num_batched_tokens tokens) and the context-prefill warm-up's _context_warmup_{i}_
WARMUP_PREFIXES = (WARMUP_PREFIX, "_v2_mixed_warmup", "_context_warmup_")


def forward_tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """Token rows of a ``_model_forward(input_ids, positions, ..., inputs_embeds)`` call."""
    names = ("input_ids", "positions", "intermediate_tensors", "inputs_embeds")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    for key in ("input_ids", "inputs_embeds"):
        t = bound.get(key)
        if t is not None:
            return int(t.shape[0])
    pos = bound.get("positions")
    if pos is not None:
        return int(pos.shape[-1])
    return None


def dummy_tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    return int(kwargs["num_tokens"] if "num_tokens" in kwargs else args[0])


def scheduler_output(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return kwargs.get("scheduler_output", args[0] if args else None)


def is_warmup(sched: Any) -> bool:
    """Model Runner V2's start-up warm-up step (every request is one of its warm-up requests,
    ``WARMUP_PREFIXES``): counted as a dummy forward, never as traffic."""
    ids = getattr(sched, "num_scheduled_tokens", None) or {}
    return bool(ids) and all(str(r).startswith(WARMUP_PREFIXES) for r in ids)


def kind(runner: Any) -> str | None:
    """"V1" or "V2": which of vLLM's model runners ``runner`` is (by its class's bases), or None."""
    for klass in type(runner).__mro__:
        if klass.__name__ == RUNNER_CLASS and klass.__module__ in KIND_OF_MODULE:
            return KIND_OF_MODULE[klass.__module__]
    return None


def class_name(runner: Any) -> str:
    return f"{type(runner).__module__}.{type(runner).__qualname__}"


# ---- which hooks fired on which runner ---------------------------------------------------------

_lock = threading.Lock()
_measuring = threading.local()  # memory-headroom's measuring forwards (measuring() below)
_fired: weakref.WeakKeyDictionary[Any, set[tuple[str, str]]] = weakref.WeakKeyDictionary()
_checked: dict[str, weakref.WeakSet[Any]] = {}  # patch id -> runners whose first forward was checked
_noted: list[Any] = [None]  # weak reference to the runner RUNNER_REPORT describes
# the report's ``runner``: the kind (V1, V2) and class of the model runner the worker built
RUNNER_REPORT = report.section("runner", report.Fields)


def _renew_after_fork() -> None:
    global _lock, _measuring
    _lock = threading.Lock()
    _measuring = threading.local()


os.register_at_fork(after_in_child=_renew_after_fork)


def note(runner: Any) -> None:
    """The report names the runner the worker built (the latest one, when a process builds several)."""
    ref = _noted[0]
    if ref is not None and ref() is runner:
        return
    try:
        _noted[0] = weakref.ref(runner)
    except TypeError:
        _noted[0] = None
    k = kind(runner)
    RUNNER_REPORT.replace({"kind": k or "unknown", "class": class_name(runner)})


def fired(patch_id: str, runner: Any, hook: str) -> None:
    """Record that ``patch_id``'s wrapper of ``hook`` ran on ``runner`` (cheap after the first time)."""
    try:
        seen = _fired.get(runner)
    except TypeError:  # not weak-referenceable: nothing to track
        return
    if seen is not None and (patch_id, hook) in seen:
        return
    with _lock:
        seen = _fired.setdefault(runner, set())
        seen.add((patch_id, hook))
    note(runner)


def fired_hooks(runner: Any, patch_id: str) -> set[str]:
    try:
        return {h for p, h in _fired.get(runner, ()) if p == patch_id}
    except TypeError:
        return set()


def _definition(cls: type, name: str) -> Any:
    for klass in cls.__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    return None


def check_runner(spec: Any, runner: Any, forward_hooks: dict[str, tuple[str, ...]]) -> list[str]:
    """The hooks of ``spec`` on ``runner``'s kind that are not in place or did not fire: a hook
    named in ``forward_hooks[kind]`` must have fired (every forward passes through it); any other
    must be the method ``type(runner)`` really calls (its definition carries the patch's wrapper),
    unless it fired. Records the outcome in the patch's report entry."""
    from vllm_overlay.mechanisms.wrap import marks

    k = kind(runner)
    version = STATE.carried_from or STATE.vllm_version or ""  # carried over: the targets of that release
    got = fired_hooks(runner, spec.id)
    if k is None:
        missing = [f"every runner hook ({class_name(runner)} is neither vLLM's V1 model runner nor Model Runner V2)"]
        hooks: list[str] = []
    else:
        hooks = [t.qualname.split(".")[-1] for t in spec.wrap_targets(version)
                 if KIND_OF_MODULE.get(t.module) == k]
        missing = []
        for name in hooks:
            if name in forward_hooks.get(k, ()):
                if name not in got:
                    missing.append(f"{name} (not fired)")
            elif name not in got and spec.id not in marks(_definition(type(runner), name)):
                missing.append(f"{name} (not the method {type(runner).__name__} calls)")
    report.patch_note(spec.id, runner={"kind": k or "unknown", "class": class_name(runner), "hooks": hooks,
                                       "fired": sorted(got), "missing": missing})
    return missing


def first_forward_check(spec_of: Callable[[], Any], forward_hooks: dict[str, tuple[str, ...]]) -> Callable[..., Any]:
    """The wrapper of ``Worker.execute_model`` for the patch whose spec ``spec_of()`` returns: after
    the worker's first forward on a runner, ``check_runner``; a hook that is not in place or did
    not fire is a WARNING, or a StrictModeError under VLLM_OVERLAY_STRICT=1."""

    def _worker_execute_model(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        runner = getattr(instance, "model_runner", None)
        spec = spec_of()
        done = _checked.setdefault(spec.id, weakref.WeakSet())
        if runner is None or runner in done:
            return wrapped(*args, **kwargs)
        sched = scheduler_output(args, kwargs)
        if not int(getattr(sched, "total_num_scheduled_tokens", 0) or 0):
            return wrapped(*args, **kwargs)
        result = wrapped(*args, **kwargs)
        done.add(runner)
        note(runner)
        missing = check_runner(spec, runner, forward_hooks)
        if missing:
            k = kind(runner) or "unknown"
            msg = (f"{spec.id}: armed, but on the model runner this worker built ({k}: {class_name(runner)}) "
                   f"these hooks did not fire by its first forward: {'; '.join(missing)}. The patch does "
                   "NOTHING on this runner (counter runner_hooks_not_fired)")
            STATE.count("runner_hooks_not_fired")
            STATE.event(msg)
            STATE.write()
            if settings.value("VLLM_OVERLAY_STRICT"):
                raise StrictModeError(f"VLLM_OVERLAY_STRICT=1 refuses to serve: {msg}")
            LOG.warning(msg)
        return result

    return _worker_execute_model


def on_revert(patch_id: str) -> None:
    _checked.pop(patch_id, None)
    with _lock:
        for seen in list(_fired.values()):
            for item in [x for x in seen if x[0] == patch_id]:
                seen.discard(item)


# ---- memory-headroom's measuring forwards ------------------------------------------------------

@contextlib.contextmanager
def measuring() -> Iterator[None]:
    """memory-headroom's measuring forwards run inside this: Model Runner V2 runs them as profiling
    forwards (``_dummy_run(is_profile=True)``: eager, tokens routed to experts), and the patches that
    act on vLLM's own profiling forward (profile-run-cap) leave them alone."""
    _measuring.on = True
    try:
        yield
    finally:
        _measuring.on = False


def in_measurement() -> bool:
    return bool(getattr(_measuring, "on", False))


def tp_rank() -> int | None:
    """This worker's tensor-parallel rank (TP ranks run the same forwards: telemetry counts rank 0)."""
    return _rank_in("get_tp_group")


def _rank_in(group_getter: str) -> int | None:
    try:
        from vllm.distributed import parallel_state

        return int(getattr(parallel_state, group_getter)().rank_in_group)
    except Exception:  # noqa: BLE001 - not initialised (e.g. a bare runner in a test)
        return None


def worker_rank() -> int | None:
    return _rank_in("get_world_group")
