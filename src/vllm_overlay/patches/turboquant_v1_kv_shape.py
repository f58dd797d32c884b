"""turboquant-v1-kv-shape: TurboQuant KV-cache layers keep their cache dtype when vLLM's V1 model
runner shapes the KV cache (vLLM 0.25.0-0.26.0, CUDA).

``GPUModelRunner._reshape_kv_cache_tensors`` (V1) gives each attention layer's backend the cache
dtype to shape that layer's KV tensor with, and passes ``"auto"`` for every spec whose
``kv_quant_mode`` is ``KVQuantMode.NONE``: its branch for layers left unquantized by
``--kv-cache-dtype-skip-layers``. In 0.25.0-0.26.0 a TurboQuant layer's spec
(``TQFullAttentionSpec``) has ``kv_quant_mode`` NONE too (``get_kv_quant_mode`` knows no
``turboquant_*`` dtype and the attention layer sets none), so the TurboQuant backend is asked for
the shape of an ``"auto"`` cache and raises ``ValueError: Unknown TurboQuant cache dtype: 'auto'``.
Every TurboQuant model on the V1 runner, which 0.26.0 builds by default for hybrid models, dies
at boot, first in the CUDA-graph memory profiling's minimal KV cache, then in the real one. Model
Runner V2's allocator has the exception (``and not isinstance(kv_cache_spec,
TQFullAttentionSpec)``); V1 has none. Upstream: issue 50709 (open); regression from PR 42890,
fixes proposed in PR 48177 (closed) and PR 52745 (open). From 0.27.0 TurboQuant specs carry a
``KVQuantMode`` of their own and V1 passes their real dtype.

The patch wraps two places: ``_reshape_kv_cache_tensors``, to note the runner's configured cache
dtype for the duration of the call, and ``TurboQuantAttentionBackend.get_kv_cache_shape``, which,
inside that call only, is given the configured TurboQuant dtype where V1 passed one it cannot
shape (``"auto"``). A layer whose backend is not TurboQuant's (a layer really skipped) is
untouched; outside V1's reshape (Model Runner V2, vLLM's own callers with a real dtype) nothing
changes. The KV tensors were already sized from ``TQFullAttentionSpec``'s TurboQuant page size:
only the view vLLM makes of them was failing.
"""

from __future__ import annotations

import threading
from typing import Any

from vllm_overlay.mechanisms import wrap
from vllm_overlay.report import LOG, STATE
from vllm_overlay.spec import PatchSpec, Proof, Support, Target, why_from, wraps

RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
RESHAPE = "GPUModelRunner._reshape_kv_cache_tensors"
BACKEND_MODULE = "vllm.v1.attention.backends.turboquant_attn"
SHAPE = "TurboQuantAttentionBackend.get_kv_cache_shape"
RUNNER = "v1/worker/gpu_model_runner.py"
IFACE = "v1/kv_cache_interface.py"
TQ_ATTN = "v1/attention/backends/turboquant_attn.py"
ATTN_LAYER = "model_executor/layers/attention/attention.py"
_SHAPE_ARGS = ("num_blocks", "block_size", "num_kv_heads", "head_size", "cache_dtype_str")
TQ_PREFIX = "turboquant_"

APPLIES = ">=0.25.0,<=0.26.0"
_AUTO_BRANCH = '"auto"\n                        if kv_cache_spec.kv_quant_mode == KVQuantMode.NONE'

RESHAPE_KV = Target(RUNNER_MODULE, RESHAPE, vllm=APPLIES)
KV_CACHE_SHAPE = Target(BACKEND_MODULE, SHAPE, vllm=APPLIES, params=("cache_dtype_str",))

SPEC = PatchSpec(
    id="turboquant-v1-kv-shape",
    hooks=("on_revert",),
    title="TurboQuant KV caches keep their dtype in the V1 runner's KV-cache reshape (TurboQuant boots on V1)",
    why=why_from(__doc__),
    upstream="https://github.com/vllm-project/vllm/issues/50709",
    targets=(RESHAPE_KV, KV_CACHE_SHAPE),
    mechanism="wrap",
    support=(
        Support(">=0.20.0,<=0.24.0", "not-needed",
                "V1's KV-cache reshape passes the configured cache dtype to every attention "
                "backend (no branch for skipped layers)",
                (Proof(RUNNER, "cache_dtype_str=self.cache_config.cache_dtype,"),
                 Proof(RUNNER, _AUTO_BRANCH, present=False))),
        Support(APPLIES, "applies",
                "V1's reshape passes 'auto' for specs with kv_quant_mode NONE, and TurboQuant specs "
                "have NONE (get_kv_quant_mode knows no turboquant_ dtype; the attention layer sets "
                "none): the TurboQuant backend raises 'Unknown TurboQuant cache dtype' at boot (upstream "
                "issue 50709); V1's other "
                "KV-layout calls (block dim, hybrid layout) pass the configured dtype",
                (Proof(RUNNER, _AUTO_BRANCH),
                 Proof(RUNNER, "cache_dtype_str=self.cache_config.cache_dtype,"),
                 Proof(RUNNER, "def _reshape_kv_cache_tensors("),
                 Proof(IFACE, 'startswith("turboquant_")', present=False),
                 Proof(ATTN_LAYER, "tq_slot_size=tq_config.slot_size_aligned,"),
                 Proof(TQ_ATTN, "tq_config = TurboQuantConfig.from_cache_dtype(cache_dtype_str, head_size)"))),
        Support(">=0.27.0,<=0.27.1", "upstream-merged",
                "TurboQuant specs carry KVQuantMode.TURBOQUANT (set by the attention layer), so "
                "V1's reshape passes their real dtype",
                (Proof(IFACE, 'startswith("turboquant_"):\n        return KVQuantMode.TURBOQUANT'),
                 Proof(ATTN_LAYER, "kv_quant_mode=quant_mode,\n                tq_slot_size=tq_config.slot_size_aligned,"))),
        Support(">=0.28.0,<=0.33.0", "upstream-merged",
                "each turboquant_ dtype has a KVQuantMode of its own, which the attention layer's spec "
                "carries, so V1 shapes TurboQuant layers with their real dtype (from 0.29.0 with the "
                "allocator Model Runner V2 uses)",
                (Proof(IFACE, 'startswith("turboquant_"):\n        return KVQuantMode[kv_cache_dtype.upper()]'),
                 Proof(ATTN_LAYER, "kv_quant_mode=quant_mode,"))),
        Support("==0.34.0", "not-needed",
                "retired: vLLM 0.34.0 removed the V1 model runner whose KV-cache reshape this patch fixes "
                "(v1/worker/gpu_model_runner.py is gone; VLLM_USE_V2_MODEL_RUNNER other than 1 is refused)",
                (Proof("platforms/interface.py", "Model Runner V1 has been removed"),)),
    ),
    default=True,
    retire_when="the oldest supported release is 0.27.0 or later (TurboQuant specs carry their own "
                "KVQuantMode there)",
    shown_by=("tq_v1_kv_shape_fixed",),
    platforms=("cuda",),
    beyond_matrix="never",
    beyond_matrix_why=("it changes the dtype the V1 runner shapes TurboQuant KV caches with, and a wrong shape "
                       "corrupts the KV cache; upstream-merged since 0.27.0 anyway"),
)

_SCOPE = threading.local()  # the configured cache dtype while V1's reshape runs in this thread
_FIRST = threading.Event()


@wraps(RESHAPE_KV)
def _reshape(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    cache_config = getattr(instance, "cache_config", None)
    dtype = getattr(cache_config, "cache_dtype", None)
    before = getattr(_SCOPE, "dtype", None)
    _SCOPE.dtype = dtype if isinstance(dtype, str) and dtype.startswith(TQ_PREFIX) else None
    try:
        return wrapped(*args, **kwargs)
    finally:
        _SCOPE.dtype = before


def substitute(passed: Any, configured: str | None) -> str | None:
    """The dtype to shape with instead of ``passed``, or None to keep it: only a non-TurboQuant
    dtype (V1's ``"auto"``) while the runner is configured with a TurboQuant one."""
    if configured is None or (isinstance(passed, str) and passed.startswith(TQ_PREFIX)):
        return None
    return configured


@wraps(KV_CACHE_SHAPE)
def _kv_cache_shape(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # not passed: vLLM's default ("turboquant_4bit_nc"), never what V1's reshape sends
    passed = wrap.argument(_SHAPE_ARGS, "cache_dtype_str", args, kwargs)
    new = substitute(passed, getattr(_SCOPE, "dtype", None))
    if new is None:
        return wrapped(*args, **kwargs)
    args, kwargs = wrap.with_argument(_SHAPE_ARGS, "cache_dtype_str", new, args, kwargs)
    STATE.count("tq_v1_kv_shape_fixed")
    if not _FIRST.is_set():
        _FIRST.set()
        msg = (f"turboquant-v1-kv-shape: V1's KV-cache reshape asked the TurboQuant backend for a "
               f"{passed!r} cache; shaped as the configured {new} (upstream issue 50709; counted in "
               "tq_v1_kv_shape_fixed, one per layer and KV-cache initialisation)")
        LOG.info(msg)
        STATE.event(msg)
    return wrapped(*args, **kwargs)


def on_revert() -> None:
    _FIRST.clear()
