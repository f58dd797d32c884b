"""The one-row projection shapes decode-gemv takes for a model: N x K per weight as one tensor parallel
rank holds it, from a Hugging Face config.json of a Qwen3-Next model (``qwen3_next``).

The patch takes every ``UnquantizedLinearMethod`` vLLM builds with its CUDA GEMM, so the shapes are
those of vLLM's Qwen3-Next layers (``models/qwen3_next.py``, ``layers/mamba/gdn/qwen_gdn_linear_attn.py``):

- per GDN layer: ``in_proj_qkvz`` and ``in_proj_ba`` (column parallel: N / tp), ``out_proj`` (row
  parallel: K / tp);
- per full-attention layer: ``qkv_proj`` (column parallel; a gated query, so 2 x heads / tp query
  heads, and KV heads / tp, at least one: KV heads are replicated where tp exceeds them) and ``o_proj``
  (row parallel);
- per MoE layer: the router ``gate`` (``GateLinear``, replicated; vLLM 0.33.0 runs it with this linear
  method where its own router kernels do not serve), the shared expert's ``gate_up_proj`` (column
  parallel) and ``down_proj`` (row parallel), and ``shared_expert_gate`` (replicated);
- per dense-MLP layer (``mlp_only_layers``, or no experts): ``gate_up_proj`` and ``down_proj`` of
  ``intermediate_size``.

The fused experts (FusedMoE), the embedding and the LM head are not linear methods: not listed.
Two projections of one shape are one entry (the table is keyed by shape), their counts added.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

MODEL_TYPES = ("qwen3_next",)
REQUIRED = ("hidden_size", "num_hidden_layers", "layer_types", "linear_num_key_heads", "linear_num_value_heads",
            "linear_key_head_dim", "linear_value_head_dim", "num_attention_heads", "num_key_value_heads")


class ShapeError(ValueError):
    """A config.json, a --shapes list or a tensor parallel size the shapes cannot come from."""


@dataclass(frozen=True)
class GemvShape:
    n: int
    k: int
    names: str = "given"  # the projections of this shape
    per_step: int = 0  # how many calls one decode step makes (0: not known, --shapes)

    @property
    def key(self) -> str:
        return f"{self.n}x{self.k}"


def read_config(path: str) -> tuple[dict[str, Any], str]:
    """A model's config.json from a folder holding one or a file; (config, the file read)."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ShapeError(f"--model {path!r}: no config.json there; expected a model folder holding config.json "
                         "or a config.json file")
    try:
        with open(file) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ShapeError(f"--model {path!r}: {file} is not readable JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ShapeError(f"--model {path!r}: {file} holds {type(cfg).__name__}, expected a JSON object")
    cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    return cfg, file


def _int(cfg: dict[str, Any], name: str, where: str, default: int | None = None) -> int:
    v = cfg.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ShapeError(f"{where}: {name}={v!r}: expected a whole number >= 0 (a Qwen3-Next config.json)")
    return v


def _split(total: int, tp: int, what: str, where: str) -> int:
    if total % tp:
        raise ShapeError(f"--tensor-parallel-size {tp}: {where}: {what} {total} is not divisible by it; "
                         "expected a size that divides it (as vLLM requires)")
    return total // tp


def from_config(cfg: dict[str, Any], tp: int = 1, where: str = "config.json") -> list[GemvShape]:
    """The shapes one rank of ``tp`` holds (see the module docstring), in a stable order."""
    model_type = cfg.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ShapeError(f"{where}: model_type {model_type!r}: expected one of {', '.join(MODEL_TYPES)} (the hybrid "
                         "GDN models whose layers this command knows); give the shapes with --shapes NxK,...")
    missing = [name for name in REQUIRED if name not in cfg]
    if missing:
        raise ShapeError(f"{where}: {', '.join(missing)} missing; expected a Qwen3-Next config.json")
    h = _int(cfg, "hidden_size", where)
    layers = _int(cfg, "num_hidden_layers", where)
    kinds = cfg["layer_types"]
    if not isinstance(kinds, list) or len(kinds) != layers:
        raise ShapeError(f"{where}: layer_types: expected a list of num_hidden_layers ({layers}) entries")
    gdn = sum(1 for t in kinds if t == "linear_attention")
    attn = sum(1 for t in kinds if t == "full_attention")
    nk, nv = _int(cfg, "linear_num_key_heads", where), _int(cfg, "linear_num_value_heads", where)
    dk, dv = _int(cfg, "linear_key_head_dim", where), _int(cfg, "linear_value_head_dim", where)
    nh, nkv = _int(cfg, "num_attention_heads", where), _int(cfg, "num_key_value_heads", where)
    hd = _int(cfg, "head_dim", where, h // nh if nh else 0)
    experts = _int(cfg, "num_experts", where, 0)
    shared = _int(cfg, "shared_expert_intermediate_size", where, 0)
    dense = _int(cfg, "intermediate_size", where, 0)
    mlp_only = cfg.get("mlp_only_layers") or []
    step = _int(cfg, "decoder_sparse_step", where, 1) or 1
    moe_layers = 0 if not experts else sum(
        1 for i in range(layers) if i not in mlp_only and (i + 1) % step == 0)
    dense_layers = layers - moe_layers
    gated = bool(cfg.get("attn_output_gate", True))
    if tp < 1:
        raise ShapeError(f"--tensor-parallel-size {tp}: expected a whole number >= 1")
    if nkv and nkv < tp and tp % nkv:
        raise ShapeError(f"--tensor-parallel-size {tp}: {where}: num_key_value_heads {nkv} neither divides it nor "
                         "is divisible by it; expected a size vLLM can shard the KV heads over")
    kv_local = max(1, nkv // tp) if nkv else 0
    out: list[tuple[str, int, int, int]] = []
    if gdn:
        qkvz = _split(2 * nk * dk + 2 * nv * dv, tp, "in_proj_qkvz's output", where)
        out += [("in_proj_qkvz", qkvz, h, gdn), ("in_proj_ba", _split(2 * nv, tp, "in_proj_ba's output", where), h, gdn),
                ("out_proj (GDN)", h, _split(nv * dv, tp, "out_proj's input", where), gdn)]
    if attn:
        q = _split(nh * (2 if gated else 1), tp, "the query heads", where) * hd
        out += [("qkv_proj", q + 2 * kv_local * hd, h, attn),
                ("o_proj", h, _split(nh, tp, "num_attention_heads", where) * hd, attn)]
    if moe_layers:
        out.append(("router gate", experts, h, moe_layers))
        if shared:
            out += [("shared_expert gate_up_proj", _split(2 * shared, tp, "the shared expert's gate_up", where), h,
                     moe_layers),
                    ("shared_expert down_proj", h, _split(shared, tp, "shared_expert_intermediate_size", where),
                     moe_layers),
                    ("shared_expert_gate", 1, h, moe_layers)]
    if dense_layers and dense:
        out += [("mlp gate_up_proj", _split(2 * dense, tp, "the MLP's gate_up", where), h, dense_layers),
                ("mlp down_proj", h, _split(dense, tp, "intermediate_size", where), dense_layers)]
    merged: dict[tuple[int, int], list[Any]] = {}
    for name, n, k, count in out:
        if n <= 0 or k <= 0 or count <= 0:
            continue
        if (n, k) in merged:
            merged[(n, k)][0] += " + " + name
            merged[(n, k)][1] += count
        else:
            merged[(n, k)] = [name, count]
    return [GemvShape(n, k, name, count) for (n, k), (name, count) in merged.items()]


def parse_shapes(text: str) -> list[GemvShape]:
    """``--shapes 2048x4096,64x2048``: each N x K once."""
    parts = [p.strip() for p in str(text).split(",")]
    shapes: list[GemvShape] = []
    for p in parts:
        n, sep, k = p.lower().partition("x")
        if not (sep and n.isascii() and k.isascii() and n.isdigit() and k.isdigit() and 0 < int(n) <= 2**20
                and 0 < int(k) <= 2**20):
            raise ShapeError(f"--shapes {text!r}: {p!r} is not NxK; expected comma-separated NxK with N and K whole "
                             "numbers in [1, 1048576], e.g. 2048x4096,64x2048 (N: output features, K: input)")
        shape = GemvShape(int(n), int(k))
        if shape in shapes:
            raise ShapeError(f"--shapes {text!r}: {shape.key} is given twice; expected each shape once")
        shapes.append(shape)
    return shapes
