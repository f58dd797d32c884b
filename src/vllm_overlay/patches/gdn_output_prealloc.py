"""gdn-output-prealloc: one persistent GDN output buffer, sized by construction, guarded outside
compiled code.

Stock vLLM allocates ``core_attn_out = torch.zeros((num_tokens, heads, head_dim))`` in every GDN
layer on every forward. The reference patch tree replaced it with a buffer of a guessed size
(4096 rows) sliced ``[:num_tokens]``; with max_num_batched_tokens 8192 that crashes at boot
(profiling forward) or at runtime (band traffic), and its shape guard inside the compiled forward
is decided once at trace time, so it protects nothing.

Here the buffer has the rows the token-budget resolver gives (never fewer than the largest
schedulable forward), is allocated when the layer is built (before vLLM's memory profiling, so
it is counted), is shared by the GDN layers of one engine with the same (device, dtype, heads,
head_dim), is freed with that engine's layers (a later engine in the same process gets its own,
sized for its own config), and is zeroed slice by slice like stock's ``torch.zeros``. The capacity guard runs in the model
runner, in plain Python before the compiled model is entered, for real and dummy forwards alike:
a forward larger than the buffer raises ``CapacityError`` naming both sizes and the budget's
source, and is counted in the report; it never reaches a slice.
"""

from __future__ import annotations

import os
import threading
import weakref
from types import ModuleType
from typing import Any

from vllm_overlay import budget, settings
from vllm_overlay.errors import CapacityError
from vllm_overlay.mechanisms import rewrite
from vllm_overlay.mechanisms.wrap import Installed, wrap
from vllm_overlay.patches._runner import RUNNER, RUNNER_MODULE, dummy_tokens, forward_tokens
from vllm_overlay.report import LOG, STATE
from vllm_overlay.spec import Edit, PatchSpec, Rewrite, Target

ATTR = "_vllm_overlay_gdn_out"

MOD_020 = "vllm.model_executor.layers.mamba.gdn_linear_attn"
CLS_020 = "GatedDeltaNetAttention"
MOD_032 = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
CLS_032 = "QwenGatedDeltaNetAttention"

_ZEROS = (
    "core_attn_out = torch.zeros(\n"
    "{i}    (num_tokens, self.num_v_heads // self.tp_size, self.head_v_dim),\n"
    "{i}    dtype=hidden_states.dtype,\n"
    "{i}    device=hidden_states.device,\n"
    "{i})\n"
)
# a zeroed slice of the layer's buffer; a layer built without the overlay's __init__ (vLLM's own
# tests build some) has no buffer and gets stock's allocation. As many lines as the anchor's
# allocation, so the lines after it keep their numbers in tracebacks.
_SLICE = (
    f"core_attn_out = getattr(self, {ATTR!r}, None)\n"
    "{i}if core_attn_out is None:  # no overlay buffer on this layer: stock's allocation\n"
    "{i}    core_attn_out = torch.zeros((num_tokens, self.num_v_heads // self.tp_size, self.head_v_dim), "
    "dtype=hidden_states.dtype, device=hidden_states.device)\n"
    "{i}else:\n"
    "{i}    core_attn_out = core_attn_out[:num_tokens].zero_()\n"
)


def _edit(lead: str, indent: str) -> Edit:
    """Replace the zeros allocation that follows ``lead`` (kept) with a zeroed buffer slice."""
    return Edit(
        anchor=f"{indent}{lead}\n{indent}" + _ZEROS.format(i=indent),
        replacement=f"{indent}{lead}\n{indent}" + _SLICE.format(i=indent),
    )


_MAIN = _edit("# see discussions in https://github.com/vllm-project/vllm/pull/28182", "    ")
_FUSED = Edit(  # the allocation sits one level deeper, inside the if
    anchor="    if use_fused_gdn_spec_decode:\n        " + _ZEROS.format(i="        "),
    replacement="    if use_fused_gdn_spec_decode:\n        " + _SLICE.format(i="        "),
)
_CPU = _edit("num_tokens = hidden_states.size(0)", "    ")

REWRITES = (
    Rewrite(Target(MOD_020, f"{CLS_020}.forward_cuda", "==0.20.2"), "0.20.2",
            "model_executor/layers/mamba/gdn_linear_attn.py",
            "314bf317cb49a4f0a3e33ae6e03dfbacadd2527721f58d9b8977c9f840b291c4", (_MAIN,)),
    Rewrite(Target(MOD_032, f"{CLS_032}.forward_cuda", "==0.32.0"), "0.32.0",
            "model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py",
            "4677edfe53828b96e1d00976ef4f3e9368d1b0ece2aeaa994b393369025c49fc", (_FUSED, _MAIN)),
    Rewrite(Target(MOD_032, f"{CLS_032}.forward_cpu", "==0.32.0"), "0.32.0",
            "model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py",
            "087e254665af31d99d48002f126119ba1b420b469da281e6259da003efe6dabb", (_CPU,)),
)

SPEC = PatchSpec(
    id="gdn-output-prealloc",
    title="GDN output buffer sized by the token-budget resolver, guarded outside compiled code",
    why=__doc__.split("\n\n")[1] + " " + __doc__.split("\n\n")[2],
    upstream="https://github.com/vllm-project/vllm/pull/28182 (why the buffer must be zeroed)",
    targets=(
        Target(MOD_020, f"{CLS_020}.__init__", "==0.20.2"),
        Target(MOD_020, f"{CLS_020}.forward_cuda", "==0.20.2"),
        Target(MOD_032, f"{CLS_032}.__init__", "==0.32.0"),
        Target(MOD_032, f"{CLS_032}.forward_cuda", "==0.32.0"),
        Target(MOD_032, f"{CLS_032}.forward_cpu", "==0.32.0"),
        Target(RUNNER_MODULE, f"{RUNNER}._model_forward"),
        Target(RUNNER_MODULE, f"{RUNNER}._dummy_run"),
    ),
    mechanism="wrap+rewrite",
    vllm=">=0.20.2,<=0.32.0",
    default=True,
    retire_when=(
        "vLLM allocates the GDN output from a persistent buffer sized by max_num_batched_tokens "
        "itself, or the per-forward torch.zeros shows no cost in bench/ (then turn it off)."
    ),
    requires=("compile-cache-key",),
    settings=(
        "VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET", "VLLM_OVERLAY_GDN_MAX_BATCHED_TOKENS",
        "VLLM_OVERLAY_STRICT", "VLLM_OVERLAY_TEST_BUFFER_ROWS", "VLLM_OVERLAY_TEST_GUARD",
    ),
    changes_traced_code=True,
    rewrites=REWRITES,
)


def layer_class(version: str) -> tuple[str, str]:
    return (MOD_020, CLS_020) if version.startswith("0.20.") else (MOD_032, CLS_032)


def MODULES(version: str) -> list[str]:  # noqa: N802 - part of the patch interface
    return [layer_class(version)[0], RUNNER_MODULE]


# ---- the buffer pool -----------------------------------------------------------------------
#
# One buffer per (engine, device, dtype, heads, head_dim). The engine is the VllmConfig that is
# current while the layers are built (the runner's own config): a second engine in the same
# process (a notebook, an evaluation script, in-process tests) gets a buffer sized for its own
# max_num_batched_tokens, never the first engine's. Only the layers hold a buffer strongly; the
# pool holds weak references, so a released engine's buffer is freed with its layers (and the
# report says so), and its entries are dropped when its config is collected.

Key = tuple[str, str, str, int, int]  # (engine, device, dtype, heads, head_dim)
ANY: Any = object()  # "every engine" for buffers() / capacity() / check()

_lock = threading.Lock()
_pool: dict[Key, weakref.ref[Any]] = {}
_layers: list[weakref.ref[Any]] = []
_sizes: dict[Key, dict[str, Any]] = {}
_engines: dict[str, weakref.finalize] = {}  # engine id -> finalizer of its config


def _renew_after_fork() -> None:
    """The child's own lock; the buffers its memory inherited stay (its layers point at them)
    and are listed in its report as inherited (report.py's handler ran first and reset STATE)."""
    global _lock, _sizes
    _lock = threading.Lock()
    _sizes = {k: {**v, "inherited_from": STATE.forked_from} for k, v in _sizes.items()}
    with STATE.lock:
        STATE.buffers.extend(_sizes.values())


os.register_at_fork(after_in_child=_renew_after_fork)


def engine_id(vllm_config: Any | None) -> str:
    """The engine a buffer belongs to: its VllmConfig object (``none`` without one)."""
    return "none" if vllm_config is None else f"config-{id(vllm_config):x}"


def buffers(vllm_config: Any = ANY) -> list[Any]:
    """The live buffers (of one engine's config, or of every engine)."""
    want = None if vllm_config is ANY else engine_id(vllm_config)
    with _lock:
        live = [(k, ref()) for k, ref in _pool.items()]
    return [t for k, t in live if t is not None and (want is None or k[0] == want)]


def capacity(vllm_config: Any = ANY) -> int | None:
    """Rows of the smallest live buffer of this engine's config (every engine's with no
    argument), or None when no GDN layer of it was built in this process."""
    return min((int(t.shape[0]) for t in buffers(vllm_config)), default=None)


def _rows() -> tuple[int, str]:
    forced = settings.resolve("VLLM_OVERLAY_TEST_BUFFER_ROWS")
    if forced.is_set:
        LOG.warning(
            "TEST ONLY: VLLM_OVERLAY_TEST_BUFFER_ROWS=%s forces the GDN buffer size, bypassing the "
            "token-budget resolver", forced.value,
        )
        return int(forced.value), f"TEST {forced.source}"
    b = budget.resolve("gdn-output")
    return b.value, b.source


def _dtype(layer: Any, cfg: Any | None) -> tuple[Any, str]:
    """The activations' dtype: what the layer's output projection consumes (its params_dtype,
    which quantized weights leave at the activation dtype), else the model config's."""
    import torch

    dt = getattr(getattr(layer, "out_proj", None), "params_dtype", None)
    if isinstance(dt, torch.dtype) and dt.is_floating_point:
        return dt, "out_proj.params_dtype"
    if cfg is not None:
        return cfg.model_config.dtype, "model_config.dtype"
    return torch.get_default_dtype(), "torch default dtype"


def _freed(key: Key) -> None:
    with _lock:
        if key in _pool and _pool[key]() is None:
            del _pool[key]
        info = _sizes.pop(key, None)
    if info is not None:
        with STATE.lock:
            info["freed"] = True
            STATE.dirty = True
        LOG.info("GDN output buffer %s freed (its engine's layers were released)", list(key))


def _engine_gone(engine: str) -> None:
    with _lock:
        _engines.pop(engine, None)
        for key in [k for k in _pool if k[0] == engine]:
            del _pool[key]


def _attach(layer: Any) -> None:
    import torch

    heads = int(layer.num_v_heads // layer.tp_size)
    dim = int(layer.head_v_dim)
    cfg = budget.current_vllm_config()
    dtype, dtype_source = _dtype(layer, cfg)
    device = torch.get_default_device()
    engine = engine_id(cfg)
    key: Key = (engine, str(device), str(dtype), heads, dim)
    with _lock:
        ref = _pool.get(key)
        buf = ref() if ref is not None else None
        if buf is None:
            rows, source = _rows()
            buf = torch.zeros((rows, heads, dim), dtype=dtype, device=device)
            _pool[key] = weakref.ref(buf)
            weakref.finalize(buf, _freed, key)
            if cfg is not None and engine not in _engines:
                _engines[engine] = weakref.finalize(cfg, _engine_gone, engine)
            info = {"key": list(key), "engine": engine, "rows": rows, "source": source,
                    "dtype_source": dtype_source, "bytes": buf.numel() * buf.element_size(), "layers": 0}
            _sizes[key] = info
            with STATE.lock:
                STATE.buffers.append(info)
            LOG.info("GDN output buffer %s: %d rows (%s), %.1f MiB shared by every GDN layer of this engine",
                     list(key), rows, source, info["bytes"] / 2**20)
        with STATE.lock:
            _sizes[key]["layers"] += 1
            STATE.dirty = True
        _layers.append(weakref.ref(layer))
    object.__setattr__(layer, ATTR, buf)


def _init(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    _attach(instance)
    return result


_unreadable_logged: set[str] = set()


def check(num_tokens: int | None, where: str, vllm_config: Any = ANY) -> None:
    """The capacity guard: plain Python, before any compiled code sees the forward. Checks the
    buffers of the engine whose config is ``vllm_config`` (the runner's)."""
    if not settings.value("VLLM_OVERLAY_TEST_GUARD"):
        return
    cap = capacity(vllm_config)
    if cap is None:
        return
    if num_tokens is None:  # the token count could not be read from the call: not checked
        STATE.count("guard_unreadable")
        if where not in _unreadable_logged:
            _unreadable_logged.add(where)
            msg = (f"gdn-output-prealloc: capacity guard could not read the token count of a {where} "
                   "(no input_ids / inputs_embeds / positions); that forward was NOT checked "
                   "(counter guard_unreadable)")
            LOG.warning(msg)
            STATE.event(msg)
        return
    STATE.count("guard_checks")
    if num_tokens > cap:
        STATE.count("guard_trips")
        engine = None if vllm_config is ANY else engine_id(vllm_config)
        with _lock:
            info = next((v for k, v in _sizes.items() if engine is None or k[0] == engine), {})
        STATE.event(f"guard trip: {where} of {num_tokens} tokens > buffer {cap} rows")
        STATE.write()
        raise CapacityError(
            f"vllm-overlay: a {where} of {num_tokens} tokens exceeds the GDN output buffer of "
            f"{cap} rows (size from {info.get('source', 'unknown')}); refusing to run it rather than "
            f"slice past the buffer. Set VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET >= {num_tokens} or unset "
            "VLLM_OVERLAY_TEST_BUFFER_ROWS."
        )


def _engine_of(runner: Any) -> Any:
    return getattr(runner, "vllm_config", ANY)


def _model_forward(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    check(forward_tokens(args, kwargs), "forward", _engine_of(instance))
    return wrapped(*args, **kwargs)


def _dummy_run(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    check(dummy_tokens(args, kwargs), "profile forward" if kwargs.get("is_profile") else "dummy forward",
          _engine_of(instance))
    return wrapped(*args, **kwargs)


def install(module_name: str, module: ModuleType) -> list[Installed]:
    from vllm_overlay.versions import installed_vllm

    inst = installed_vllm()
    assert inst is not None
    if module_name == RUNNER_MODULE:
        return [
            wrap(RUNNER_MODULE, f"{RUNNER}._model_forward", _model_forward),
            wrap(RUNNER_MODULE, f"{RUNNER}._dummy_run", _dummy_run),
        ]
    mod, cls = layer_class(inst.version)
    out: list[Installed] = []
    try:
        for rw in REWRITES:
            if rw.version == inst.version:
                out.append(rewrite.apply(rw, SPEC.id))
        out.append(wrap(mod, f"{cls}.__init__", _init))
    except Exception:
        for done in reversed(out):
            done.undo()
        raise
    return out


def on_revert() -> None:
    with _lock:
        for ref in _layers:
            layer = ref()
            if layer is not None and ATTR in layer.__dict__:
                del layer.__dict__[ATTR]
        _layers.clear()
        _pool.clear()
        _sizes.clear()
        for fin in _engines.values():
            fin.detach()
        _engines.clear()
        _unreadable_logged.clear()
