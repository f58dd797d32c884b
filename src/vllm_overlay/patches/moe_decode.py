"""moe-decode: the routed experts of a forward of one to four tokens in two Triton launches (CUDA, opt-in).

At one decode stream a hybrid MoE model's routed experts are the largest share of the step after its
dense projections: on the H200 (vLLM 0.33.0, 35B-A3B geometry, bf16) 0.88 ms of the step against a
weight-read floor of 0.42 ms. vLLM's unquantized Triton path (``fused_experts``: aligning the
(token, expert) pairs into blocks, two grouped GEMMs, SiLU-and-mul, the sum over top_k) runs five
launches whose tensor-core tiles are mostly padding at one to four tokens.

With ``VLLM_OVERLAY_MOE_DECODE=1``, ``UnquantizedFusedMoEMethod.apply`` runs ``kernels/moe_decode.py``
for a forward of 1 to 4 tokens (decode, and MTP verify steps of a few streams) where vLLM chose its
Triton backend for the layer and the layer is plain: bf16 or fp16 weights, SiLU, no bias, no expert
map (expert parallelism), router weights applied after the experts, no LoRA, and a synchronous
prepare/finalize (vLLM runs shared experts inside its kernel only with an asynchronous one). Larger
forwards, and every other layer, keep vLLM's kernel; a layer that does not qualify is said once with
the reason (counter ``moe_decode_stood_aside``). The choice is made when ``apply`` runs (under
torch.compile inside vLLM's opaque ``moe_forward`` op), so one compiled graph serves every size and a
CUDA graph of one to four tokens captures the two launches.

Launch configs come from the kernel's heuristic on the SM count. Outputs are vLLM's values with the
fp32 additions of each dot product in another order: an element can differ by a bf16 rounding step.
Off by default: its speed in a served A/B against stock is not measured yet
(``bench/moe_decode_kernel.py`` measures the kernel alone against ``fused_experts``).
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_overlay import report
from vllm_overlay.logs import LOG
from vllm_overlay.mechanisms.wrap import argument
from vllm_overlay.moe_decode_table import MAX_TOKENS, heuristic
from vllm_overlay.report import STATE
from vllm_overlay.spec import PatchSpec, Proof, Support, Target, why_from, wraps

PATCH_ID = "moe-decode"
MODULE = "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method"
METHOD_PATH = "model_executor/layers/fused_moe/unquantized_fused_moe_method.py"
MK_PATH = "model_executor/layers/fused_moe/modular_kernel.py"
PARAMS = ("layer", "x", "topk_weights", "topk_ids")  # the same four first parameters in every release
APPLY = Target(MODULE, "UnquantizedFusedMoEMethod.apply", params=PARAMS)

# the parameters after topk_ids: shared_experts_input alone (0.20.x), then shared_experts before it
SIGNATURE_020 = ("        topk_ids: torch.Tensor,\n        shared_experts_input: torch.Tensor | None,\n"
                 "    ) -> torch.Tensor:\n        return self.forward(\n")
SIGNATURE = ("        topk_ids: torch.Tensor,\n        shared_experts: SharedExperts | None,\n"
             "        shared_experts_input: torch.Tensor | None,\n    ) -> torch.Tensor:\n        return self.forward(\n")
# what the method runs for the layer without the patch: vLLM's modular kernel on the layer's weights
KERNEL_CALL = ("        return self.moe_kernel.apply(\n            hidden_states=x,\n            w1=layer.w13_weight,\n"
               "            w2=layer.w2_weight,\n            topk_weights=topk_weights,\n            topk_ids=topk_ids,\n"
               "            activation=layer.activation,\n"
               "            apply_router_weight_on_input=layer.apply_router_weight_on_input,\n"
               "            global_num_experts=layer.global_num_experts,\n            expert_map=layer.expert_map,\n")
# vLLM's kernel runs shared experts itself only in the asynchronous branch of its finalize (all-to-all),
# which the patch leaves to vLLM
SYNC_FINALIZE = "        if not self.prepare_finalize.supports_async():\n"
# the backend the patch asks about (it acts on UnquantizedMoeBackend.TRITON only)
BACKEND = "        self.unquantized_backend, self.experts_cls = select_unquantized_moe_backend(\n"
ROW = ("runs vLLM's modular kernel on layer.w13_weight / layer.w2_weight, which runs shared experts itself only with "
       "an asynchronous (all-to-all) prepare/finalize; the patch answers a 1-4 token call of a plain layer on vLLM's "
       "Triton backend with its own kernel and leaves asynchronous kernels to vLLM")

SPEC = PatchSpec(
    id=PATCH_ID,
    title="The routed experts of a 1-4 token forward in two Triton launches (CUDA, opt-in)",
    why=why_from(__doc__),
    upstream="https://github.com/vllm-project/vllm/blob/v0.34.0/vllm/model_executor/layers/fused_moe/fused_moe.py "
             "(fused_experts: the unquantized Triton path at every batch size)",
    targets=(APPLY,),
    mechanism="wrap",
    support=(
        Support("<0.22.0", "applies",
                "UnquantizedFusedMoEMethod.apply(layer, x, topk_weights, topk_ids, shared_experts_input) " + ROW,
                (Proof(METHOD_PATH, SIGNATURE_020), Proof(METHOD_PATH, KERNEL_CALL), Proof(MK_PATH, SYNC_FINALIZE),
                 Proof(METHOD_PATH, BACKEND))),
        Support(">=0.22.0,<=0.34.0", "applies",
                "UnquantizedFusedMoEMethod.apply(layer, x, topk_weights, topk_ids, shared_experts, "
                "shared_experts_input) " + ROW,
                (Proof(METHOD_PATH, SIGNATURE), Proof(METHOD_PATH, KERNEL_CALL), Proof(MK_PATH, SYNC_FINALIZE),
                 Proof(METHOD_PATH, BACKEND))),
    ),
    default=False,
    enabled_by="VLLM_OVERLAY_MOE_DECODE",
    platforms=("cuda",),
    retire_when="vLLM's unquantized MoE path reads a decode step's experts near the memory bandwidth at 1-4 "
                "tokens, measured against this kernel.",
    settings=("VLLM_OVERLAY_MOE_DECODE",),
    shown_by=("moe_decode_calls",),
    idle_by=("moe_decode_stood_aside",),
    beyond_matrix="never",
    beyond_matrix_why="it replaces vLLM's routed-experts kernel for small forwards with the overlay's own; a newer "
                      "release's MoE path must be read before it runs there",
)

DECIDED = "_vllm_overlay_moe_decode"  # on a method: None (the kernel serves small forwards) or why not
INTERPRETED_SMS = 132  # the kernel on CPU tensors (Triton's interpreter, the tests): an H100's SM count
_CONFIGS_SAID: set[int] = set()  # token counts whose launch configs the report holds


def _say(line: str) -> None:
    if line in STATE.events:
        return
    LOG.warning(line)
    STATE.event(line)


def on_cuda(x: Any) -> bool:
    return bool(x.is_cuda)


def refusal(instance: Any, layer: Any, x: Any) -> str | None:
    """Why this layer keeps vLLM's kernel, or None where the overlay's serves its 1-4 token forwards."""
    import torch

    backend = getattr(instance, "unquantized_backend", None)
    name = getattr(backend, "name", str(backend))
    if name != "TRITON":
        return f"vLLM chose its {name} backend for the layer (the kernel replaces the Triton backend only)"
    if not on_cuda(x):
        return "the input is not on a CUDA device"
    w13, w2 = getattr(layer, "w13_weight", None), getattr(layer, "w2_weight", None)
    if not isinstance(w13, torch.Tensor) or not isinstance(w2, torch.Tensor) or w13.dim() != 3 or w2.dim() != 3:
        return "the layer has no [E, 2I, H] / [E, H, I] weights"
    if x.dtype not in (torch.bfloat16, torch.float16) or w13.dtype != x.dtype or w2.dtype != x.dtype:
        return f"weights {w13.dtype} / {w2.dtype} with input {x.dtype} (bf16 or fp16 throughout only)"
    if w13.shape[1] != 2 * w2.shape[2] or w13.shape[2] != w2.shape[1] or w13.stride(-1) != 1 or w2.stride(-1) != 1:
        return f"weight shapes {tuple(w13.shape)} / {tuple(w2.shape)} are not gated [E, 2I, H] / [E, H, I]"
    activation = getattr(layer, "activation", None)
    if str(getattr(activation, "value", activation)).lower() != "silu":
        return f"activation {activation} (SiLU only)"
    if getattr(layer, "expert_map", None) is not None:
        return "an expert map (expert parallelism)"
    if getattr(layer, "apply_router_weight_on_input", False):
        return "router weights applied on the input"
    if getattr(getattr(instance, "moe", None), "has_bias", False):
        return "expert biases"
    if any(getattr(layer, a, None) is not None for a in ("swiglu_alpha", "swiglu_beta", "swiglu_limit")):
        return "SwiGLU gate parameters"
    kernel = getattr(instance, "moe_kernel", None)
    if getattr(getattr(kernel, "fused_experts", None), "_lora_context", None) is not None:
        return "LoRA on the experts"
    finalize = getattr(getattr(kernel, "impl", kernel), "prepare_finalize", None)
    if finalize is not None and finalize.supports_async():
        return "an asynchronous (all-to-all) prepare/finalize, which may run shared experts inside vLLM's kernel"
    return None


@functools.cache
def _sms(device_index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _configs(sms: int, tokens: int, inter: int, hidden: int, top_k: int) -> tuple[Any, Any]:
    """The up and down launches' configs (decided once per shape, not on every call)."""
    return heuristic(inter, hidden, tokens * top_k, sms), heuristic(hidden, inter, tokens, sms)


def _device_sms(x: Any) -> int:
    if x.device.type != "cuda":
        return INTERPRETED_SMS
    if x.device.index is not None:
        return _sms(x.device.index)
    import torch

    return _sms(torch.cuda.current_device())


@wraps(APPLY)
def _apply(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = argument(PARAMS, "x", args, kwargs)
    if x is None or x.dim() != 2 or not 1 <= x.shape[0] <= MAX_TOKENS:
        return wrapped(*args, **kwargs)
    layer = argument(PARAMS, "layer", args, kwargs)
    decided = getattr(instance, DECIDED, "")
    if decided == "":
        decided = refusal(instance, layer, x)
        setattr(instance, DECIDED, decided)
        if decided is None:
            STATE.count("moe_decode_layers")
        else:
            STATE.count("moe_decode_stood_aside")
            _say(f"moe-decode: stands aside: {decided}; those layers keep vLLM's fused experts "
                 "(counter moe_decode_stood_aside)")
    if decided is not None:
        return wrapped(*args, **kwargs)
    from vllm_overlay.kernels.moe_decode import routed_experts

    w13, w2 = layer.w13_weight, layer.w2_weight
    topk_ids = argument(PARAMS, "topk_ids", args, kwargs)
    up, down = _configs(_device_sms(x), x.shape[0], w2.shape[2], w2.shape[1], topk_ids.shape[1])
    STATE.count("moe_decode_calls")  # eager calls and CUDA graph captures; replays run no Python
    if x.shape[0] not in _CONFIGS_SAID:
        _CONFIGS_SAID.add(x.shape[0])
        report.patch_put(PATCH_ID, "configs", f"{x.shape[0]} tokens", {"up": up.as_list(), "down": down.as_list()})
    return routed_experts(x, w13, w2, argument(PARAMS, "topk_weights", args, kwargs), topk_ids, up, down)
