"""hybrid-turboquant: TurboQuant KV cache (k8v4 and the other presets) on hybrid GDN + attention
models in vLLM 0.20.x, where vLLM refuses it.

vLLM 0.20.2 raises "TurboQuant KV cache is not supported for hybrid (attention + Mamba) models"
in ``EngineArgs.create_engine_config``, because its boundary-layer protection (keep the first and
last 2 *model* layers at the model dtype) assumes every layer is an attention layer. Removing the
refusal is not enough: the hybrid page-size planner (``Platform._align_hybrid_block_size``) sizes
an attention page as if TurboQuant stored 2 x head_size bytes per head and token, while the
TurboQuant layers really store their packed slot (key + value + scales, e.g. 388 bytes at head_dim
256 for k8v4 instead of 512); the padded GDN state page then matches no attention page and the KV
cache cannot be unified.

This patch makes two anchored in-memory rewrites of vLLM 0.20.0-0.20.2 (each checked against the pristine
source hash):
- the refusal is replaced by ``boundary_skip_layers``: on a hybrid, TurboQuant goes on the
  full-attention layers (the GDN layers keep their state caches unchanged), and boundary protection
  counts *full-attention* layers: ``VLLM_OVERLAY_TQ_HYBRID_BOUNDARY`` of the first and last ones
  keep the model dtype (default 0: none, the choice vLLM made upstream from 0.22.0, since a hybrid has few
  full-attention layers and n=2 on each side would take 40 % of them from Qwen3.6-35B-A3B's ten);
- the planner's per-token attention page is the TurboQuant packed page, or, when some attention
  layers keep the model dtype (boundary or ``--kv-cache-dtype-skip-layers``), the least common
  multiple of the two pages, so that every attention page divides the padded GDN page exactly.
From vLLM 0.22.0 upstream does the same (vLLM PR 39931): the patch reports upstream-merged there.
"""

from __future__ import annotations

import math
from typing import Any

from vllm_overlay import settings
from vllm_overlay.report import LOG, STATE
from vllm_overlay.spec import Edit, PatchSpec, Proof, Support, Target, per_release, why_from

ARGS_MODULE = "vllm.engine.arg_utils"
PLATFORM_MODULE = "vllm.platforms.interface"
HERE = "vllm_overlay.patches.hybrid_turboquant"

_REFUSAL = Edit(
    anchor=(
        '    if resolved_cache_dtype.startswith("turboquant_"):\n'
        "        if model_config.is_hybrid:\n"
        "            raise NotImplementedError(\n"
        '                "TurboQuant KV cache is not supported for hybrid "\n'
        '                "(attention + Mamba) models. Boundary layer protection "\n'
        '                "requires uniform attention layers."\n'
        "            )\n"
        "        from vllm.model_executor.layers.quantization.turboquant.config import (\n"
        "            TurboQuantConfig,\n"
        "        )\n"
        "\n"
        "        num_layers = model_config.hf_text_config.num_hidden_layers\n"
        "        boundary = TurboQuantConfig.get_boundary_skip_layers(num_layers)\n"
    ),
    replacement=(
        '    if resolved_cache_dtype.startswith("turboquant_"):\n'
        "        # vllm-overlay hybrid-turboquant: on a hybrid, TurboQuant on the full-attention\n"
        "        # layers; boundary protection counts full-attention layers (see the patch).\n"
        f"        from {HERE} import boundary_skip_layers\n"
        "\n"
        "        num_layers = model_config.hf_text_config.num_hidden_layers\n"
        "        boundary = boundary_skip_layers(model_config, num_layers)\n"
    ),
)
_PAGE_IMPORT = Edit(
    anchor="    # Compute attention page size for 1 token\n    if model_config.use_mla:\n",
    replacement=f"    from {HERE} import attention_page_bytes_per_token\n    if model_config.use_mla:\n",
)
_PAGE_FIX = Edit(
    anchor="        ).page_size_bytes\n\n    # Compute mamba page size\n",
    replacement=(
        "        ).page_size_bytes\n"
        "    attn_page_size_1_token = attention_page_bytes_per_token(vllm_config, attn_page_size_1_token)\n"
        "    # Compute mamba page size\n"
    ),
)

REFUSAL_TEXT = "TurboQuant KV cache is not supported for hybrid"
TQ_CONFIG = "model_executor/layers/quantization/turboquant/config.py"

# Pristine sha256 of each rewritten function per release (`vllm-overlay verify --propose` prints them)
REWRITES = (
    *per_release(Target(ARGS_MODULE, "EngineArgs.create_engine_config"), "engine/arg_utils.py", (_REFUSAL,), {
        "0.20.0": "40ba8f24b2b27a856067d67c909392a78e7e872b15d3586175b94efb787eb9fb",
        "0.20.1": "40ba8f24b2b27a856067d67c909392a78e7e872b15d3586175b94efb787eb9fb",
        "0.20.2": "40ba8f24b2b27a856067d67c909392a78e7e872b15d3586175b94efb787eb9fb",
    }),
    *per_release(Target(PLATFORM_MODULE, "Platform._align_hybrid_block_size"), "platforms/interface.py",
                 (_PAGE_IMPORT, _PAGE_FIX), {
        "0.20.0": "67b6d520863c9b898d935f29ec8202ee7318ab9e05206edf032b89541a49fd4e",
        "0.20.1": "67b6d520863c9b898d935f29ec8202ee7318ab9e05206edf032b89541a49fd4e",
        "0.20.2": "67b6d520863c9b898d935f29ec8202ee7318ab9e05206edf032b89541a49fd4e",
    }),
)

SPEC = PatchSpec(
    id="hybrid-turboquant",
    title="TurboQuant KV cache on hybrid GDN + attention models (vLLM 0.20.x)",
    why=why_from(__doc__),
    upstream="https://github.com/vllm-project/vllm/pull/39931",
    targets=(
        Target(ARGS_MODULE, "EngineArgs.create_engine_config", "<0.22.0"),
        Target(PLATFORM_MODULE, "Platform._align_hybrid_block_size", "<0.22.0"),
    ),
    mechanism="rewrite",
    support=(
        Support("<0.22.0", "applies",
                "create_engine_config refuses TurboQuant on hybrids and the hybrid page planner sizes "
                "a TurboQuant page as 2 x head_size bytes per head and token",
                (Proof("engine/arg_utils.py", REFUSAL_TEXT),
                 # what the helpers below call in vLLM
                 Proof(TQ_CONFIG, "def get_boundary_skip_layers(num_layers: int, n: int = 2)"),
                 Proof(TQ_CONFIG, "def from_cache_dtype(cache_dtype: str, head_dim: int)"),
                 Proof(TQ_CONFIG, "def slot_size_aligned(self) -> int:"))),
        Support(">=0.22.0,<=0.34.0", "upstream-merged",
                "vLLM PR 39931 (in 0.22.0): no refusal, no boundary layers on hybrids, and the planner "
                "sizes TurboQuant's packed page (lcm with skipped layers)",
                (Proof("engine/arg_utils.py", REFUSAL_TEXT, present=False),
                 Proof(TQ_CONFIG, "if model_config.is_hybrid:"),
                 Proof("platforms/interface.py", "attn_page_size_1_token = lcm(tq_page, skip_page)"))),
    ),
    default=True,
    retire_when="Users are on a vLLM with PR 39931 (0.22.0 and later): the patch reports upstream-merged there.",
    settings=("VLLM_OVERLAY_TQ_HYBRID_BOUNDARY",),
    platforms=("cuda",),
    rewrites=REWRITES,
    beyond_matrix="never",
    beyond_matrix_why=("it rewrites the hybrid page planner's TurboQuant page size, and a wrong page size corrupts "
                       "the KV cache; upstream-merged since 0.22.0 anyway"),
)


# ---- called from the rewritten vLLM code ---------------------------------------------------------


def full_attention_layers(hf_text_config: Any) -> list[int]:
    """Indices of the full-attention layers of a hybrid config (``layer_types`` or
    ``full_attention_interval``, as Qwen3-Next / Qwen3.5 / Qwen3.6 configs declare them)."""
    n = int(hf_text_config.num_hidden_layers)
    types = getattr(hf_text_config, "layer_types", None)
    if types:
        return [i for i, t in enumerate(types[:n]) if t in ("full_attention", "attention")]
    interval = getattr(hf_text_config, "full_attention_interval", None)
    if interval:
        return [i for i in range(n) if (i + 1) % int(interval) == 0]
    return []


def boundary_skip_layers(model_config: Any, num_layers: int) -> list[str]:
    """Layers that keep the model dtype under a TurboQuant KV cache (vLLM's kv_cache_dtype_skip_layers)."""
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig

    if not model_config.is_hybrid:
        return TurboQuantConfig.get_boundary_skip_layers(num_layers)  # stock behaviour
    attn = full_attention_layers(model_config.hf_text_config)
    if not attn:
        raise ValueError(
            "hybrid-turboquant: --kv-cache-dtype turboquant_* on a hybrid model needs its "
            "full-attention layers, but the model config declares neither layer_types nor "
            f"full_attention_interval (model {model_config.model!r}); use --kv-cache-dtype auto or fp8"
        )
    want = int(settings.value("VLLM_OVERLAY_TQ_HYBRID_BOUNDARY"))
    n = min(want, len(attn) // 4)  # both ends together: at most half of the full-attention layers
    kept = sorted(set(attn[:n] + attn[len(attn) - n:])) if n else []
    msg = (
        f"hybrid-turboquant: TurboQuant KV cache on full-attention layers "
        f"{[i for i in attn if i not in kept]}; model dtype kept on boundary layers {kept} "
        f"(VLLM_OVERLAY_TQ_HYBRID_BOUNDARY={want}"
        + (f", capped to {n} per end: at most half of {len(attn)} full-attention layers" if n < want else "")
        + f"); {num_layers - len(attn)} GDN layers keep their state caches"
    )
    (LOG.warning if n < want else LOG.info)(msg)
    STATE.event(msg)
    return [str(i) for i in kept]


def attention_page_bytes_per_token(vllm_config: Any, stock: int) -> int:
    """Bytes of one token's attention page for the hybrid planner: the TurboQuant packed page, or
    lcm(packed, model dtype) when some attention layers keep the model dtype."""
    cache = vllm_config.cache_config
    model = vllm_config.model_config
    if not str(cache.cache_dtype).startswith("turboquant_") or model.use_mla:
        return stock
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    heads = model.get_num_kv_heads(vllm_config.parallel_config)
    head_size = model.get_head_size()
    slot = TurboQuantConfig.from_cache_dtype(cache.cache_dtype, head_size).slot_size_aligned
    packed = heads * slot  # what vLLM 0.20.2's TQFullAttentionSpec.real_page_size_bytes gives per token
    page = packed
    plain = None
    if cache.kv_cache_dtype_skip_layers:
        plain = FullAttentionSpec(block_size=1, num_kv_heads=heads, head_size=head_size,
                                  dtype=model.dtype).page_size_bytes
        page = math.lcm(packed, plain)
    msg = (
        f"hybrid-turboquant: attention page per token {page} bytes for the hybrid planner "
        f"({cache.cache_dtype} packed {packed}"
        + (f", model-dtype layers {plain}, lcm" if plain else "")
        + f"; stock vLLM 0.20.x would plan {stock})"
    )
    LOG.info(msg)
    STATE.event(msg)
    return page

