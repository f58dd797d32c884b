"""hybrid-turboquant (vLLM 0.20.x): the pieces that run here.

The patch's targets exist only in vLLM 0.20.2 (CUDA build; checked textually in test_anchors.py
and booted on the H200, bench/results/tq-*). Here: the rewrite mechanism on a classmethod and a
staticmethod (a real module written to a temp dir), and the two functions the rewritten vLLM code
calls, fed with real vLLM 0.32 config objects built from our model configs.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
import textwrap
from types import SimpleNamespace

import pytest

from vllm_overlay.errors import AnchorError
from vllm_overlay.mechanisms import rewrite
from vllm_overlay.patches import hybrid_turboquant as htq
from vllm_overlay.spec import Edit, Rewrite, Target

BENCH_MODELS = os.path.join(os.path.dirname(__file__), "..", "bench", "models")

SOURCE = textwrap.dedent('''
    class Planner:
        @classmethod
        def page(cls, n):
            base = 2 * n
            return base

        @staticmethod
        def twice(n):
            return 2 * n
''')


@pytest.fixture()
def planner_module(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    (tmp_path / "vo_planner_mod.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("vo_planner_mod", None)
    mod = importlib.import_module("vo_planner_mod")
    yield mod
    sys.modules.pop("vo_planner_mod", None)


def _rw(qualname: str, edit: Edit, text: str) -> Rewrite:
    located = rewrite.locate(text, qualname, qualname)
    return Rewrite(Target("vo_planner_mod", qualname), "test", "vo_planner_mod.py",
                   rewrite.sha256(located.source), (edit,))


def test_rewrite_keeps_classmethod_and_staticmethod(planner_module) -> None:  # type: ignore[no-untyped-def]
    text = SOURCE
    cm = _rw("Planner.page", Edit("    return base\n", "    return base + 1\n"), text)
    sm = _rw("Planner.twice", Edit("    return 2 * n\n", "    return 3 * n\n"), text)
    undo = [rewrite.apply(cm, "t"), rewrite.apply(sm, "t")]
    P = planner_module.Planner
    assert isinstance(P.__dict__["page"], classmethod) and isinstance(P.__dict__["twice"], staticmethod)
    assert P.page(5) == 11 and P().page(5) == 11 and P.twice(5) == 15
    for u in reversed(undo):
        u.undo()
    assert P.page(5) == 10 and P.twice(5) == 10


def test_rewrite_refuses_other_decorators() -> None:
    text = "import functools\n@functools.cache\ndef f():\n    return 1\n"
    with pytest.raises(AnchorError, match="decorators other than"):
        rewrite.locate(text, "f", "f")


def _model_config(name: str, tmp_path) -> object:  # type: ignore[no-untyped-def]
    from vllm.config import ModelConfig

    if name == "tiny":
        from vllm_overlay.tools.models import tiny_hybrid_dir

        path = tiny_hybrid_dir()
    else:
        path = tmp_path / name
        path.mkdir()
        with open(os.path.join(BENCH_MODELS, f"{name}.json")) as f:
            (path / "config.json").write_text(f.read())
    return ModelConfig(model=str(path), dtype="bfloat16", skip_tokenizer_init=True)


@pytest.mark.parametrize(
    ("model", "boundary", "kept"),
    [
        ("tiny", None, []),
        ("tiny", "2", []),  # one full-attention layer: nothing can be kept without losing TurboQuant
        ("qwen36-35b-a3b-geometry", None, []),
        ("qwen36-35b-a3b-geometry", "1", ["3", "39"]),
        ("qwen36-35b-a3b-geometry", "2", ["3", "7", "35", "39"]),
        ("qwen36-35b-a3b-geometry", "5", ["3", "7", "35", "39"]),  # capped: at most half of 10
    ],
)
def test_boundary_counts_full_attention_layers(model, boundary, kept, tmp_path, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    if boundary is not None:
        monkeypatch.setenv("VLLM_OVERLAY_TQ_HYBRID_BOUNDARY", boundary)
    mc = _model_config(model, tmp_path)
    assert mc.is_hybrid
    layers = mc.hf_text_config.num_hidden_layers
    with caplog.at_level("INFO", logger="vllm_overlay"):
        assert htq.boundary_skip_layers(mc, layers) == kept
    line = next(r.getMessage() for r in caplog.records if "hybrid-turboquant" in r.getMessage())
    assert f"boundary layers {[int(k) for k in kept]}" in line and "GDN layers keep their state caches" in line
    if boundary == "5":
        assert "capped to 2 per end" in line


def test_boundary_without_layer_types_is_one_clear_error() -> None:
    # a config that names no full-attention layer (attribute bag: no real hybrid config lacks both)
    mc = SimpleNamespace(is_hybrid=True, model="some/hybrid",
                         hf_text_config=SimpleNamespace(num_hidden_layers=8))
    with pytest.raises(ValueError, match="layer_types nor full_attention_interval.*some/hybrid"):
        htq.boundary_skip_layers(mc, 8)


def test_interval_configs_are_understood() -> None:
    cfg = SimpleNamespace(num_hidden_layers=8, full_attention_interval=4)
    assert htq.full_attention_layers(cfg) == [3, 7]


@pytest.mark.parametrize("preset", ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"])
def test_attention_page_is_the_packed_turboquant_page(preset, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from vllm.config import CacheConfig, ParallelConfig
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig

    mc = _model_config("qwen36-35b-a3b-geometry", tmp_path)
    heads, head = 2, 256  # Qwen3.6-35B-A3B: 2 KV heads of 256 at TP=1
    slot = TurboQuantConfig.from_cache_dtype(preset, head).slot_size_aligned
    stock = 2 * heads * head  # what vLLM 0.20.2 plans for a uint8 cache dtype
    cfg = SimpleNamespace(model_config=mc, parallel_config=ParallelConfig(),
                          cache_config=CacheConfig(cache_dtype=preset))
    assert htq.attention_page_bytes_per_token(cfg, stock) == heads * slot
    assert heads * slot < stock
    cfg.cache_config.kv_cache_dtype_skip_layers = ["3"]
    bf16 = 2 * heads * head * 2
    page = htq.attention_page_bytes_per_token(cfg, stock)
    assert page == math.lcm(heads * slot, bf16) and page % (heads * slot) == 0 and page % bf16 == 0
    # other cache dtypes: the stock planner's number, untouched
    cfg.cache_config = CacheConfig(cache_dtype="auto")
    assert htq.attention_page_bytes_per_token(cfg, 1234) == 1234


def test_settings_doc_and_validation(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from vllm_overlay import settings
    from vllm_overlay.errors import SettingError

    monkeypatch.setenv("VLLM_OVERLAY_TQ_HYBRID_BOUNDARY", "-1")
    with pytest.raises(SettingError, match="VLLM_OVERLAY_TQ_HYBRID_BOUNDARY.*-1.*an integer in \\[0, 64\\]"):
        settings.value("VLLM_OVERLAY_TQ_HYBRID_BOUNDARY")
    assert "hybrid-turboquant" in json.dumps([s.help for s in settings.SETTINGS])
