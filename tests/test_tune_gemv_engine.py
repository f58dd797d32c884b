"""tune-gemv's shapes against the layers a real vLLM engine builds: the tiny hybrid booted by vLLM's CPU
build (dummy weights), every weight an UnquantizedLinearMethod (what decode-gemv takes on CUDA) loads,
with its shape as it loads (the CPU build may repack it afterwards), compared with what tune-gemv derives
from the same config.json. Nothing is stood in for: the CPU build builds the same Qwen3-Next layers as the CUDA one
(its GEMM differs, which the shapes do not depend on)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import clean_env
from vllm_overlay.tools.tune import gemv_shapes

pytestmark = pytest.mark.engine

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(os.path.dirname(HERE), "src", "vllm_overlay", "tools", "models", "tiny-hybrid")

SCRIPT = textwrap.dedent("""
    import collections, json, sys
    from vllm import LLM
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    # each weight's shape as it loads: after loading, vLLM's CPU build may repack a weight for its own
    # GEMM (oneDNN, on some CPUs) and leave layer.weight empty
    SHAPES = collections.Counter()
    after_loading = UnquantizedLinearMethod.process_weights_after_loading

    def record(self, layer):
        if layer.weight.dim() == 2:
            SHAPES[f"{layer.weight.shape[0]}x{layer.weight.shape[1]}"] += 1
        return after_loading(self, layer)

    UnquantizedLinearMethod.process_weights_after_loading = record
    llm = LLM(model=sys.argv[1], load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
              max_model_len=1024, max_num_batched_tokens=1024, max_num_seqs=4, gpu_memory_utilization=0.1, seed=0)
    print("SHAPES " + json.dumps(dict(SHAPES)), flush=True)
""")


def test_the_shapes_are_the_layers_vllm_builds(tmp_path) -> None:
    env = clean_env(VLLM_OVERLAY_REPORT_DIR=str(tmp_path / "reports"), VLLM_ENABLE_V1_MULTIPROCESSING="0",
                    VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    p = subprocess.run([sys.executable, "-c", SCRIPT, TINY], capture_output=True, text=True, env=env, timeout=900)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("SHAPES ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-5000:]
    built = json.loads(lines[-1][len("SHAPES "):])
    cfg, where = gemv_shapes.read_config(TINY)
    derived = {s.key: s.per_step for s in gemv_shapes.from_config(cfg, 1, where)}
    assert built == derived, (built, derived)
