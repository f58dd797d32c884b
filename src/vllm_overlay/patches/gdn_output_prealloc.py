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
source, and is counted in the report; it never reaches a slice. On vLLM's V1 runner the guard
reads each forward's input rows in ``_model_forward``; Model Runner V2 has no ``_model_forward``,
so there it reads the padded token count its ``prepare_inputs`` receives (``batch_desc``), the
token count of each ``_dummy_run``, and, before ``capture_model``, the largest CUDA graph size
its graph manager will capture.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref
from typing import Any

from vllm_overlay import budget, settings
from vllm_overlay.errors import CapacityError
from vllm_overlay.patches import _gdn_metrics, _runner
from vllm_overlay.patches._gdn_buffers import BUFFERS
from vllm_overlay.patches._runner import (
    RUNNER_CLASS,
    RUNNER_MODULES,
    V1_MODULE,
    V1_RELEASES,
    V2_MODULE,
    WORKER,
    WORKER_MODULE,
    dummy_tokens,
    forward_tokens,
)
from vllm_overlay.report import LOG, STATE
from vllm_overlay.spec import Edit, PatchSpec, Proof, Support, Target, per_release, why_from, wraps

ATTR = "_vllm_overlay_gdn_out"

MOD_020 = "vllm.model_executor.layers.mamba.gdn_linear_attn"  # vLLM 0.20.x
CLS_020 = "GatedDeltaNetAttention"
PATH_020 = "model_executor/layers/mamba/gdn_linear_attn.py"
MOD_QWEN = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"  # vLLM 0.22.0 and later
CLS_QWEN = "QwenGatedDeltaNetAttention"
PATH_QWEN = "model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py"
MOD_032, CLS_032 = MOD_QWEN, CLS_QWEN  # the names tests and earlier code use

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
    "{i}    core_attn_out = hidden_states.new_zeros((num_tokens, self.num_v_heads // self.tp_size, "
    "self.head_v_dim))\n"
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
_FUSED = Edit(  # 0.32.0 and later: the allocation sits one level deeper, inside the if
    anchor="    if use_fused_gdn_spec_decode:\n        " + _ZEROS.format(i="        "),
    replacement="    if use_fused_gdn_spec_decode:\n        " + _SLICE.format(i="        "),
)
_FUSED_DECODE = Edit(  # 0.28.0 to 0.31.0 name the fused branch use_fused_gdn_decode
    anchor="    if use_fused_gdn_decode:\n        " + _ZEROS.format(i="        "),
    replacement="    if use_fused_gdn_decode:\n        " + _SLICE.format(i="        "),
)
_CPU = _edit("num_tokens = hidden_states.size(0)", "    ")

# Pristine sha256 of each rewritten function per release (`vllm-overlay verify --propose` prints them)
REWRITES = (
    *per_release(Target(MOD_020, f"{CLS_020}.forward_cuda"), PATH_020, (_MAIN,), {
        "0.20.0": "314bf317cb49a4f0a3e33ae6e03dfbacadd2527721f58d9b8977c9f840b291c4",
        "0.20.1": "314bf317cb49a4f0a3e33ae6e03dfbacadd2527721f58d9b8977c9f840b291c4",
        "0.20.2": "314bf317cb49a4f0a3e33ae6e03dfbacadd2527721f58d9b8977c9f840b291c4",
    }),
    *per_release(Target(MOD_QWEN, f"{CLS_QWEN}.forward_cuda"), PATH_QWEN, (_MAIN,), {
        "0.22.0": "62f58d4df44cb49920ddd1be9ab01d2b437acee91156257ee3f37ff5d7ecd97b",
        "0.22.1": "62f58d4df44cb49920ddd1be9ab01d2b437acee91156257ee3f37ff5d7ecd97b",
        "0.23.0": "96b258b76c6cef374c5607bd0c3730b185031c7601efdeb0813d7e03ce852098",
        "0.24.0": "96b258b76c6cef374c5607bd0c3730b185031c7601efdeb0813d7e03ce852098",
        "0.25.0": "96b258b76c6cef374c5607bd0c3730b185031c7601efdeb0813d7e03ce852098",
        "0.25.1": "96b258b76c6cef374c5607bd0c3730b185031c7601efdeb0813d7e03ce852098",
        "0.26.0": "042c8e612a6819c7feb18c0ab845a9df1a15f56f63e69892845d53ac8369d66d",
        "0.27.0": "042c8e612a6819c7feb18c0ab845a9df1a15f56f63e69892845d53ac8369d66d",
        "0.27.1": "042c8e612a6819c7feb18c0ab845a9df1a15f56f63e69892845d53ac8369d66d",
    }),
    *per_release(Target(MOD_QWEN, f"{CLS_QWEN}.forward_cuda"), PATH_QWEN, (_FUSED_DECODE, _MAIN), {
        "0.28.0": "0f0ab2a8a4eec49a07240bf780b837deac4a419e1a6720fc0ef3fad97e87020d",
        "0.29.0": "0f0ab2a8a4eec49a07240bf780b837deac4a419e1a6720fc0ef3fad97e87020d",
        "0.30.0": "0f0ab2a8a4eec49a07240bf780b837deac4a419e1a6720fc0ef3fad97e87020d",
        "0.31.0": "8f9660027310781fa65eae9cb284ae9685c8ef745c148f22cce044832edf6bb2",
    }),
    *per_release(Target(MOD_QWEN, f"{CLS_QWEN}.forward_cuda"), PATH_QWEN, (_FUSED, _MAIN), {
        "0.32.0": "4677edfe53828b96e1d00976ef4f3e9368d1b0ece2aeaa994b393369025c49fc",
        "0.33.0": "4677edfe53828b96e1d00976ef4f3e9368d1b0ece2aeaa994b393369025c49fc",
    }),
    # 0.34.0: the main path allocates torch.empty (left as it is); the fused spec-decode path still zeros
    *per_release(Target(MOD_QWEN, f"{CLS_QWEN}.forward_cuda"), PATH_QWEN, (_FUSED,), {
        "0.34.0": "f862cdd031514498a931ada9f6931b5a1fe517e3f4fe22823bf466fc85002cf2",
    }),
    *per_release(Target(MOD_QWEN, f"{CLS_QWEN}.forward_cpu"), PATH_QWEN, (_CPU,), {
        "0.22.0": "d66cf1a6746e4421fb83d89e48089f719a70539b34904a72e84c5506d72559f5",
        "0.22.1": "d66cf1a6746e4421fb83d89e48089f719a70539b34904a72e84c5506d72559f5",
        "0.23.0": "d66cf1a6746e4421fb83d89e48089f719a70539b34904a72e84c5506d72559f5",
        "0.24.0": "d66cf1a6746e4421fb83d89e48089f719a70539b34904a72e84c5506d72559f5",
        "0.25.0": "d66cf1a6746e4421fb83d89e48089f719a70539b34904a72e84c5506d72559f5",
        "0.25.1": "d66cf1a6746e4421fb83d89e48089f719a70539b34904a72e84c5506d72559f5",
        "0.26.0": "8cfb077b07e04effa8c6e6d69adb7e8ea80d95689207aadb202bf3aa021afdff",
        "0.27.0": "8cfb077b07e04effa8c6e6d69adb7e8ea80d95689207aadb202bf3aa021afdff",
        "0.27.1": "8cfb077b07e04effa8c6e6d69adb7e8ea80d95689207aadb202bf3aa021afdff",
        "0.28.0": "8cfb077b07e04effa8c6e6d69adb7e8ea80d95689207aadb202bf3aa021afdff",
        "0.29.0": "8cfb077b07e04effa8c6e6d69adb7e8ea80d95689207aadb202bf3aa021afdff",
        "0.30.0": "8cfb077b07e04effa8c6e6d69adb7e8ea80d95689207aadb202bf3aa021afdff",
        "0.31.0": "087e254665af31d99d48002f126119ba1b420b469da281e6259da003efe6dabb",
        "0.32.0": "087e254665af31d99d48002f126119ba1b420b469da281e6259da003efe6dabb",
        "0.33.0": "087e254665af31d99d48002f126119ba1b420b469da281e6259da003efe6dabb",
    }),
)
GONE = ("core_attn_out = torch.zeros(",)  # no per-forward allocation may remain after the rewrite
REWRITES = tuple(dataclasses.replace(rw, gone=GONE) for rw in REWRITES)

INIT_020 = Target(MOD_020, f"{CLS_020}.__init__", "<0.22.0")
INIT_QWEN = Target(MOD_QWEN, f"{CLS_QWEN}.__init__", ">=0.22.0")
V1_MODEL_FORWARD = Target(V1_MODULE, f"{RUNNER_CLASS}._model_forward", V1_RELEASES,
                          params=("input_ids", "positions", "intermediate_tensors", "inputs_embeds"))
V1_DUMMY_RUN = Target(V1_MODULE, f"{RUNNER_CLASS}._dummy_run", V1_RELEASES, params=("num_tokens", "is_profile"))
V2_PREPARE_INPUTS = Target(V2_MODULE, f"{RUNNER_CLASS}.prepare_inputs", params=("scheduler_output", "batch_desc"))
V2_DUMMY_RUN = Target(V2_MODULE, f"{RUNNER_CLASS}._dummy_run", params=("num_tokens", "is_profile"))
V2_CAPTURE = Target(V2_MODULE, f"{RUNNER_CLASS}.capture_model")
WORKER_EXECUTE = Target(WORKER_MODULE, f"{WORKER}.execute_model", params=("scheduler_output",))

SPEC = PatchSpec(
    id="gdn-output-prealloc",
    hooks=("on_revert", "metric_families", "bucket_edges"),
    title="GDN output buffer sized by the token-budget resolver, guarded outside compiled code",
    why=why_from(__doc__),
    upstream="https://github.com/vllm-project/vllm/pull/28182 (why the buffer must be zeroed)",
    targets=(
        INIT_020,
        Target(MOD_020, f"{CLS_020}.forward_cuda", "<0.22.0"),  # the forwards: rewritten (REWRITES)
        INIT_QWEN,
        Target(MOD_QWEN, f"{CLS_QWEN}.forward_cuda", ">=0.22.0"),
        Target(MOD_QWEN, f"{CLS_QWEN}.forward_cpu", ">=0.22.0,<=0.33.0"),  # no CPU build of vLLM after 0.32.0
        V1_MODEL_FORWARD, V1_DUMMY_RUN, V2_PREPARE_INPUTS, V2_DUMMY_RUN, V2_CAPTURE, WORKER_EXECUTE,
    ),
    mechanism="wrap+rewrite",
    support=(
        Support("<0.22.0", "applies",
                f"{CLS_020}.forward_cuda allocates core_attn_out = torch.zeros((num_tokens, ...)) on "
                "every forward (no forward_cpu in 0.20.x). Model Runner V2 refuses hybrid models here "
                "(VLLM_USE_V2_MODEL_RUNNER does not yet support: hybrid/mamba models), so only the V1 "
                "runner ever builds a GDN layer; the V2 hooks are in place but see no buffer",
                (Proof(PATH_020, "core_attn_out = torch.zeros("),
                 Proof("config/vllm.py", '"hybrid/mamba models"'))),
        Support(">=0.22.0,<0.23.0", "applies",
                f"the layer moved to {CLS_QWEN} (mamba/gdn/); its forward_cuda and forward_cpu allocate "
                "core_attn_out = torch.zeros((num_tokens, ...)) on every forward. Model Runner V2 still "
                "refuses hybrid models (hybrid/mamba models)",
                (Proof(PATH_QWEN, "core_attn_out = torch.zeros("),
                 Proof("config/vllm.py", '"hybrid/mamba models"'))),
        Support(">=0.23.0,<0.25.0", "applies",
                f"{CLS_QWEN}.forward_cuda and forward_cpu allocate core_attn_out = torch.zeros((num_tokens, "
                "...)) on every forward. Model Runner V2 refuses hybrid models only with prefix caching "
                "(mamba_cache_mode 'align'); without it the V2 hooks guard the buffer",
                (Proof(PATH_QWEN, "core_attn_out = torch.zeros("),
                 Proof("config/vllm.py", '"hybrid/mamba models with align cache mode"'))),
        Support(">=0.25.0,<=0.33.0", "applies",
                f"{CLS_QWEN}.forward_cuda and forward_cpu allocate core_attn_out = torch.zeros((num_tokens, "
                "...)) on every forward. Model Runner V2 accepts hybrid models: its hooks (prepare_inputs' "
                "batch_desc, _dummy_run, capture_model) guard the buffer",
                (Proof(PATH_QWEN, "core_attn_out = torch.zeros("),
                 Proof("config/vllm.py", '"hybrid/mamba models', present=False))),
        Support("==0.34.0", "applies",
                f"{CLS_QWEN}.forward_cuda's main path now allocates core_attn_out = torch.empty(...) per forward "
                "(no memset, sized per forward: nothing to save and no size to disagree), and is left as it "
                "is; its fused spec-decode path (the CUDA GDN decode kernel with a speculative config, i.e. MTP, "
                "on every forward of a bf16 model, prefills included) still allocates torch.zeros((num_tokens, "
                "...)) per forward: only layers that take that path get the buffer, guarded by the V2 hooks "
                "(V1 removed). Measured on an H100 with MTP 3 (2026-12-07): the Qwen3-Next layout falls back to "
                "the Triton spec-decode path, so no layer took the buffer there; the zeroing it saves on the "
                "fused path is 6-9 us a layer up to 4,096 tokens and 20 us at 8,192 (eager, "
                "bench/results/gdn-zero-cost-h100.json)",
                (Proof(PATH_QWEN, "core_attn_out = torch.empty("),
                 Proof(PATH_QWEN, "        if use_fused_gdn_spec_decode:\n            core_attn_out = torch.zeros("),
                 Proof(PATH_QWEN, 'self.gdn_decode_kernel == "cuda" and self.speculative_config is not None'),
                 Proof("platforms/interface.py", "Model Runner V1 has been removed"))),
    ),
    default=True,
    retire_when=(
        "vLLM allocates the GDN output from a persistent buffer sized by max_num_batched_tokens "
        "itself, or the per-forward torch.zeros shows no cost in bench/ (then turn it off)."
    ),
    # compile-cache-key: the rewritten forward is traced code; forward-telemetry: it records the live
    # runner's max_num_tokens, which the buffer's floor (budget.largest_forward) reads
    requires=("compile-cache-key", "forward-telemetry"),
    # a forward on the buffer is checked against its rows: none where every layer kept vLLM's own allocation
    # (vLLM 0.34.0 off its fused spec-decode path)
    shown_by=("guard_checks",),
    settings=(
        "VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET", "VLLM_OVERLAY_GDN_MAX_BATCHED_TOKENS",
        "VLLM_OVERLAY_STRICT", "VLLM_OVERLAY_TEST_BUFFER_ROWS", "VLLM_OVERLAY_TEST_GUARD",
    ),
    changes_traced_code=True,
    traced_settings=(
        "VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET", "VLLM_OVERLAY_GDN_MAX_BATCHED_TOKENS",
        "VLLM_OVERLAY_TEST_BUFFER_ROWS", "VLLM_OVERLAY_TEST_GUARD",
    ),
    rewrites=REWRITES,
    either_modules=(RUNNER_MODULES,),
    # _dummy_run, Worker.execute_model: the buffer check runs before telemetry records the forward,
    # so a forward it refuses is never counted as run
    wraps_outside=("forward-telemetry",),
    beyond_matrix="carry",
    beyond_matrix_why=("its rewrite carries only onto a forward byte-identical to the newest release's (the pristine"
                       " hash is checked), and the capacity guard outside compiled code refuses a buffer smaller "
                       "than a forward"),
)


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
    and are listed in its report as inherited (report.py's handler ran first and emptied BUFFERS)."""
    global _lock, _sizes
    _lock = threading.Lock()
    _sizes = {k: {**v, "inherited_from": STATE.forked_from} for k, v in _sizes.items()}
    for info in _sizes.values():
        BUFFERS.add(info)


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
        BUFFERS.note(info, freed=True)
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
            BUFFERS.add(info)
            LOG.info("GDN output buffer %s: %d rows (%s), %.1f MiB shared by every GDN layer of this engine",
                     list(key), rows, source, info["bytes"] / 2**20)
        BUFFERS.note(_sizes[key], layers=_sizes[key]["layers"] + 1)  # under _lock: no lost count
        _layers.append(weakref.ref(layer))
    object.__setattr__(layer, ATTR, buf)


EMPTY_MAIN_FROM = "0.34.0"  # from here forward_cuda's main path allocates torch.empty: only the fused path zeros
_noted_empty: list[bool] = [False]


def needs_buffer(layer: Any) -> bool:
    """Whether this layer's forward allocates zeros per forward on this vLLM: every layer before 0.34.0; from
    0.34.0 only a layer that takes the fused spec-decode path (``enable_fused_gdn_spec_decode``)."""
    from packaging.version import Version

    # the release whose rewrite is in place: on a release newer than the matrix, the one whose rows were
    # carried over (its forward's allocations are what the rewrite replaced)
    version = STATE.carried_from or STATE.vllm_version
    if not version or Version(version) < Version(EMPTY_MAIN_FROM):
        return True
    if getattr(layer, "enable_fused_gdn_spec_decode", False):
        return True
    STATE.count("gdn_layers_left_to_vllm")
    if not _noted_empty[0]:
        _noted_empty[0] = True
        msg = (f"gdn-output-prealloc: vLLM {version} allocates the GDN output with torch.empty on its main path "
               "(no per-forward zeros to save); only layers on the fused spec-decode path (MTP) get the buffer, "
               "this one keeps vLLM's allocation (counter gdn_layers_left_to_vllm)")
        LOG.info(msg)
        STATE.event(msg)
    return False


@wraps(INIT_020, INIT_QWEN)
def _init(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    if needs_buffer(instance):
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


@wraps(V1_MODEL_FORWARD)
def _model_forward(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    _runner.fired(SPEC.id, instance, "_model_forward")
    check(forward_tokens(args, kwargs), "forward", _engine_of(instance))
    return wrapped(*args, **kwargs)


@wraps(V1_DUMMY_RUN, V2_DUMMY_RUN)
def _dummy_run(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    _runner.fired(SPEC.id, instance, "_dummy_run")
    check(dummy_tokens(args, kwargs), "profile forward" if kwargs.get("is_profile") else "dummy forward",
          _engine_of(instance))
    return wrapped(*args, **kwargs)


def v2_forward_tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """Rows of the forward Model Runner V2 is preparing: ``prepare_inputs(scheduler_output,
    [batch_req_state,] batch_desc, ...)`` pads the batch to ``batch_desc.num_tokens`` (a CUDA graph
    size or the data-parallel maximum); the largest of the counts it is given."""
    counts = []
    for value in (*args, *kwargs.values()):
        for attr in ("total_num_scheduled_tokens", "num_tokens"):
            n = getattr(value, attr, None)
            if isinstance(n, int) and not isinstance(n, bool):
                counts.append(n)
    return max(counts) if counts else None


@wraps(V2_PREPARE_INPUTS)
def _prepare_inputs_v2(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    _runner.fired(SPEC.id, instance, "prepare_inputs")
    check(v2_forward_tokens(args, kwargs), "forward", _engine_of(instance))
    return wrapped(*args, **kwargs)


def capture_sizes(runner: Any) -> list[int]:
    """The token counts Model Runner V2's graph manager captures (none when graphs are off)."""
    cc = getattr(getattr(runner, "vllm_config", None), "compilation_config", None)
    if cc is None or not getattr(cc, "cudagraph_mode", None):
        return []
    return [int(n) for n in (getattr(cc, "cudagraph_capture_sizes", None) or [])]


@wraps(V2_CAPTURE)
def _capture_model_v2(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """V2 captures its graphs without _dummy_run: the largest capture size is checked first."""
    _runner.fired(SPEC.id, instance, "capture_model")
    sizes = capture_sizes(instance)
    if sizes:
        check(max(sizes), "CUDA graph capture", _engine_of(instance))
    return wrapped(*args, **kwargs)


# every real forward passes through V1's _model_forward and V2's prepare_inputs
_worker_execute_model = wraps(WORKER_EXECUTE)(
    _runner.first_forward_check(lambda: SPEC, {"V1": ("_model_forward",), "V2": ("prepare_inputs",)}))


def on_revert() -> None:
    _runner.on_revert(SPEC.id)
    dropped: list[Any] = []  # the buffers die after the lock is released: their finalizer takes it
    with _lock:
        for ref in _layers:
            layer = ref()
            if layer is not None and ATTR in layer.__dict__:
                dropped.append(layer.__dict__.pop(ATTR))
        _layers.clear()
        _pool.clear()
        _sizes.clear()
        for fin in _engines.values():
            fin.detach()
        _engines.clear()
        _unreadable_logged.clear()


def metric_families(reports: list[dict[str, Any]]) -> Any:
    """This patch's series on /metrics (the buffers each process reported): ``_gdn_metrics.py``."""
    return _gdn_metrics.families(reports)


def bucket_edges(reports: list[dict[str, Any]]) -> Any:
    """The buffers' rows, edges of the forward-size histogram on /metrics: ``_gdn_metrics.py``."""
    return _gdn_metrics.bucket_edges(reports)
