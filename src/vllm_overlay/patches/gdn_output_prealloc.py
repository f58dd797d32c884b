"""gdn-output-prealloc: one persistent GDN output buffer, sized by construction, guarded outside
compiled code.

Stock vLLM allocates ``core_attn_out = torch.zeros((num_tokens, heads, head_dim))`` in every GDN
layer on every forward. The reference patch tree replaced it with a buffer of a guessed size
(4096 rows) sliced ``[:num_tokens]``; with max_num_batched_tokens 8192 that crashes at boot
(profiling forward) or at runtime (band traffic), and its shape guard inside the compiled forward
is decided once at trace time, so it protects nothing.

Here the buffer has the rows the token-budget resolver gives (never fewer than the largest
schedulable forward), is allocated when the layer is built (before vLLM's memory profiling, so
it is counted), is shared by all GDN layers with the same (device, dtype, heads, head_dim), and
is zeroed slice by slice like stock's ``torch.zeros``. The capacity guard runs in the model
runner, in plain Python before the compiled model is entered, for real and dummy forwards alike:
a forward larger than the buffer raises ``CapacityError`` naming both sizes and the budget's
source, and is counted in the report; it never reaches a slice.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any

from vllm_overlay import budget, settings
from vllm_overlay.errors import CapacityError
from vllm_overlay.patches._runner import RUNNER, RUNNER_MODULE, dummy_tokens, forward_tokens
from vllm_overlay.report import LOG, STATE
from vllm_overlay.spec import Edit, PatchSpec, Proof, Support, Target, per_release

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
_SLICE = f"core_attn_out = self.{ATTR}[:num_tokens]\n{{i}}core_attn_out.zero_()\n"


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

SPEC = PatchSpec(
    id="gdn-output-prealloc",
    title="GDN output buffer sized by the token-budget resolver, guarded outside compiled code",
    why=__doc__.split("\n\n")[1] + " " + __doc__.split("\n\n")[2],
    upstream="https://github.com/vllm-project/vllm/pull/28182 (why the buffer must be zeroed)",
    targets=(
        Target(MOD_020, f"{CLS_020}.__init__", "<0.22.0", wrapper="_init"),
        Target(MOD_020, f"{CLS_020}.forward_cuda", "<0.22.0"),
        Target(MOD_QWEN, f"{CLS_QWEN}.__init__", ">=0.22.0", wrapper="_init"),
        Target(MOD_QWEN, f"{CLS_QWEN}.forward_cuda", ">=0.22.0"),
        Target(MOD_QWEN, f"{CLS_QWEN}.forward_cpu", ">=0.22.0"),
        Target(RUNNER_MODULE, f"{RUNNER}._model_forward", wrapper="_model_forward",
               params=("input_ids", "positions", "intermediate_tensors", "inputs_embeds")),
        Target(RUNNER_MODULE, f"{RUNNER}._dummy_run", wrapper="_dummy_run", params=("num_tokens", "is_profile")),
    ),
    mechanism="wrap+rewrite",
    support=(
        Support("<0.22.0", "applies",
                f"{CLS_020}.forward_cuda allocates core_attn_out = torch.zeros((num_tokens, ...)) on "
                "every forward (no forward_cpu in 0.20.x)",
                (Proof(PATH_020, "core_attn_out = torch.zeros("),)),
        Support(">=0.22.0,<=0.33.0", "applies",
                f"the layer moved to {CLS_QWEN} (mamba/gdn/); its forward_cuda and forward_cpu allocate "
                "core_attn_out = torch.zeros((num_tokens, ...)) on every forward",
                (Proof(PATH_QWEN, "core_attn_out = torch.zeros("),)),
    ),
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


# ---- the buffer pool -----------------------------------------------------------------------

_lock = threading.Lock()
_pool: dict[tuple[str, str, int, int], Any] = {}
_layers: list[weakref.ref[Any]] = []
_sizes: dict[tuple[str, str, int, int], dict[str, Any]] = {}


def capacity() -> int | None:
    """Rows of the smallest live buffer, or None when no GDN layer was built in this process."""
    with _lock:
        return min((int(t.shape[0]) for t in _pool.values()), default=None)


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


def _attach(layer: Any) -> None:
    import torch

    heads = int(layer.num_v_heads // layer.tp_size)
    dim = int(layer.head_v_dim)
    cfg = budget.current_vllm_config()
    dtype = cfg.model_config.dtype if cfg is not None else torch.get_default_dtype()
    device = torch.get_default_device()
    key = (str(device), str(dtype), heads, dim)
    with _lock:
        buf = _pool.get(key)
        if buf is None:
            rows, source = _rows()
            buf = torch.zeros((rows, heads, dim), dtype=dtype, device=device)
            _pool[key] = buf
            info = {"key": list(key), "rows": rows, "source": source,
                    "bytes": buf.numel() * buf.element_size(), "layers": 0}
            _sizes[key] = info
            STATE.buffers.append(info)
            LOG.info("GDN output buffer %s: %d rows (%s), %.1f MiB shared by every GDN layer",
                     key, rows, source, info["bytes"] / 2**20)
        _sizes[key]["layers"] += 1
        STATE.dirty = True
        _layers.append(weakref.ref(layer))
    object.__setattr__(layer, ATTR, buf)


def _init(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    _attach(instance)
    return result


def check(num_tokens: int | None, where: str) -> None:
    """The capacity guard: plain Python, before any compiled code sees the forward."""
    if num_tokens is None or not settings.value("VLLM_OVERLAY_TEST_GUARD"):
        return
    cap = capacity()
    if cap is None:
        return
    STATE.counters["guard_checks"] += 1
    if num_tokens > cap:
        STATE.count("guard_trips")
        info = next(iter(_sizes.values()))
        STATE.event(f"guard trip: {where} of {num_tokens} tokens > buffer {cap} rows")
        STATE.write()
        raise CapacityError(
            f"vllm-overlay: a {where} of {num_tokens} tokens exceeds the GDN output buffer of "
            f"{cap} rows (size from {info['source']}); refusing to run it rather than slice past "
            f"the buffer. Set VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET >= {num_tokens} or unset "
            "VLLM_OVERLAY_TEST_BUFFER_ROWS."
        )


def _model_forward(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    check(forward_tokens(args, kwargs), "forward")
    return wrapped(*args, **kwargs)


def _dummy_run(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    check(dummy_tokens(args, kwargs), "profile forward" if kwargs.get("is_profile") else "dummy forward")
    return wrapped(*args, **kwargs)


def on_revert() -> None:
    with _lock:
        for ref in _layers:
            layer = ref()
            if layer is not None and ATTR in layer.__dict__:
                del layer.__dict__[ATTR]
        _layers.clear()
        _pool.clear()
        _sizes.clear()
