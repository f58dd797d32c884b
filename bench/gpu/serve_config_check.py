"""The engine configuration each boot of a bench/stack.py series would build on the H200, checked on
a CPU machine against a staged vLLM: the `vllm serve` arguments stack.py gives the label
(bench/stack/server.py's serve_args; --gpu-memory-utilization at stack's default, not the series' share of its
"mem_total", which sizes nothing the config builds), parsed by that vLLM's own `vllm serve` parser
(vllm.entrypoints.cli.serve's), in the label's server environment
(server.py's server_env: its configuration's overlay settings and its --env variables, such as
VLLM_USE_V2_MODEL_RUNNER=1), then vLLM's engine config built from them after vLLM's plugins (the
overlay) loaded, with the API server's usage context (its defaults: max_num_seqs 1024 on an H200),
as in the API server. One process per label.

  LD_LIBRARY_PATH=STUB_DIR PYTHONPATH=SCRATCH/site python bench/gpu/serve_config_check.py \
      [--series v2-bf16|tqspec|release|memory|...] [--labels v2-overlay,...]

(the environment of bench/gpu/README.md's CPU rehearsal: a Python 3.12 like the H200 image's, the
release and its wheels unpacked by device_install.sh with DEVICE_TMP set). What cannot run on CPU is
stood in for as in import_check.py, and only that: the CUDA driver (STUB_DIR's libcuda.so.1), the
GPU (vLLM's platform set to its CUDA class reporting an H200), Triton's driver (reporting itself
active before vLLM looks, and taken as present for the engine config, where Model Runner V2 would
otherwise be refused).

Prints per label: whether the engine config builds, use_v2_model_runner, the model's architecture
and hybrid flag, compilation mode, CUDA graph mode and capture sizes, max_num_batched_tokens,
max_num_seqs, prefix caching, KV cache dtype and the layers it skips, the speculative method and
tokens, the GDN prefill backend, the GDN spec-decode kernel (gdn_spec_decode_kernel), the extensible KV
cache (0.34.0) and gpu_memory_utilization as resolved, and the overlay's patch statuses in that process.
On a vLLM whose config has no use_v2_model_runner (0.34.0: Model Runner V1 removed) V2 is implied, and
the output says so. Exit 1 when a label's config does not build or builds another model runner than
the series expects.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
# the project root first: bench is a package (import_check, next to this script, is found in bench/gpu/,
# which Python puts on sys.path for the script)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from bench.stack import cli, schedule, series, server  # noqa: E402 - bench/stack/


# the GDN layer's QKVZ layout per model class, fixed in the model's code, not in its config (vLLM 0.34.0:
# model_executor/models/qwen3_next.py:530 gqa_interleaved_layout=True; the Qwen3.5 classes False:
# models/qwen3_5/nvidia/model.py:310, model_executor/models/qwen3_5.py:152)
GDN_INTERLEAVED = {"Qwen3NextForCausalLM": True}


def gdn_spec_decode_kernel(cfg: Any) -> dict[str, Any] | str | None:
    """The spec-decode kernel each GDN layer of this config picks on the GPU, by vLLM's own decision:
    QwenGatedDeltaNetAttention._fused_gdn_decode_unsupported_reason (vLLM 0.34.0), a method of the layer,
    called on a stand-in holding what the layer would hold (its layout, head sizes, gate activation, state
    dtypes: all from the config and the model class), since the layer itself needs a CUDA device to build.
    Then as the layer's __init__: kernel "cuda" where there is no reason against it and VLLM_GDN_DECODE_KERNEL
    is "cuda" (the default), and the fused spec-decode path (enable_fused_gdn_spec_decode, the path whose
    per-forward torch.zeros gdn-output-prealloc replaces) only with a speculative config. None for a model
    without GDN layers or a vLLM without the decision."""
    from types import SimpleNamespace

    try:
        from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as gdn
    except ImportError:
        return None
    decide = getattr(gdn.QwenGatedDeltaNetAttention, "_fused_gdn_decode_unsupported_reason", None)
    text = cfg.model_config.hf_text_config
    if decide is None or not hasattr(text, "linear_key_head_dim"):
        return None
    arch = cfg.model_config.architectures[0]
    if arch in GDN_INTERLEAVED:
        interleaved = GDN_INTERLEAVED[arch]
    elif arch.startswith("Qwen3_5"):
        interleaved = False
    else:
        return f"{arch}: its GDN layout is not known to this check"
    from vllm import envs
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator

    states = MambaStateDtypeCalculator.gated_delta_net_state_dtype(
        cfg.model_config.dtype, cfg.cache_config.mamba_cache_dtype, cfg.cache_config.mamba_ssm_cache_dtype)
    gate = getattr(text, "output_gate_type", "silu")
    layer = SimpleNamespace(gqa_interleaved_layout=interleaved, head_k_dim=text.linear_key_head_dim,
                            head_v_dim=text.linear_value_head_dim,
                            norm=SimpleNamespace(activation="silu" if gate == "swish" else gate),
                            get_state_dtype=lambda: states)
    reason = decide(layer, cfg)
    kernel = "cuda" if envs.VLLM_GDN_DECODE_KERNEL.strip().lower() == "cuda" and reason is None else "triton"
    return {"layout": "interleaved" if interleaved else "non-interleaved", "state_dtypes": [str(x) for x in states],
            "kernel": kernel, "fused_spec_decode": kernel == "cuda" and cfg.speculative_config is not None,
            "reason_against_cuda": reason}


def child(model: str, args: list[str]) -> dict[str, Any]:
    import import_check

    import_check.triton_driver_active()  # before vLLM looks (0.33.0's Mamba SSD kernels read their configs at import)
    import_check.fake_h200()
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # the overlay, as in the API server
    import vllm.config.vllm as config_vllm

    config_vllm.HAS_TRITON = True  # Triton has no driver on CPU; on the H200 it has one
    from vllm.engine.arg_utils import AsyncEngineArgs
    import vllm.entrypoints.cli.serve as serve_cli  # `vllm serve`'s own parser, wherever the release keeps it
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if not hasattr(serve_cli, "make_arg_parser"):  # vllm.entrypoints.common.cli_args in 0.33.0, openai's before
        import vllm.entrypoints.openai.cli_args as serve_cli
    ns = serve_cli.make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", model, *args])
    serve_cli.validate_parsed_serve_args(ns)
    from vllm.usage.usage_lib import UsageContext

    # the API server's usage context: its defaults (max_num_seqs 1024 on an H200) are not the bare config's (128)
    cfg = AsyncEngineArgs.from_cli_args(ns).create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import _resolve_gdn_prefill_backend

    cc = cfg.compilation_config
    # 0.34.0 removed Model Runner V1 and with it VllmConfig.use_v2_model_runner: V2 is then the only runner
    v2 = getattr(cfg, "use_v2_model_runner", None)
    out = {"use_v2_model_runner": v2 if v2 is not None else "V2 implied (no such attribute: V1 removed)",
           "architectures": cfg.model_config.architectures,
           "is_hybrid": cfg.model_config.is_hybrid, "compilation_mode": getattr(cc.mode, "name", str(cc.mode)),  # NONE: eager (0.34.0's Qwen3.5 on CUDA)
           "use_breakable_cudagraph": getattr(cc, "use_breakable_cudagraph", None),
           "cudagraph_mode": str(cc.cudagraph_mode), "cudagraph_capture_sizes": cc.cudagraph_capture_sizes,
           "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
           "max_num_seqs": cfg.scheduler_config.max_num_seqs, "max_model_len": cfg.model_config.max_model_len,
           "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
           "enable_extensible_kv_cache": getattr(cfg.cache_config, "enable_extensible_kv_cache", None),
           "gpu_memory_utilization": getattr(cfg.cache_config, "resolved_gpu_memory_utilization",
                                             cfg.cache_config.gpu_memory_utilization),
           "kv_cache_memory_bytes": cfg.cache_config.kv_cache_memory_bytes,
           "kv_cache_dtype": cfg.cache_config.cache_dtype,
           "kv_cache_dtype_skip_layers": list(getattr(cfg.cache_config, "kv_cache_dtype_skip_layers", None) or []),
           "speculative": None if cfg.speculative_config is None else {
               "method": cfg.speculative_config.method,
               "num_speculative_tokens": cfg.speculative_config.num_speculative_tokens,
               "draft_architectures": getattr(cfg.speculative_config.draft_model_config, "architectures", None),
               "draft_n_predict": getattr(getattr(cfg.speculative_config.draft_model_config, "hf_config", None),
                                          "n_predict", None)},
           "gdn_prefill_backend": list(_resolve_gdn_prefill_backend(cfg)),
           "gdn_spec_decode_kernel": gdn_spec_decode_kernel(cfg),
           "VLLM_USE_V2_MODEL_RUNNER": os.environ.get("VLLM_USE_V2_MODEL_RUNNER")}
    try:
        import vllm_overlay

        path = vllm_overlay.flush()
        rep = json.load(open(path)) if path else {}
        out["overlay"] = {k: v.get("status") for k, v in sorted(rep.get("patches", {}).items())}
    except ImportError:
        out["overlay"] = None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--series", default="v2-bf16", choices=tuple(series.SERIES))
    ap.add_argument("--labels", default="", help="labels of the series (default: all)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    spec = series.SERIES[a.series]
    items = schedule.series_items(spec)
    if a.child:
        model, args = json.loads(a.child)
        try:
            res = {"ok": True, **child(model, args)}
        except BaseException as exc:  # noqa: BLE001 - the error is the result
            res = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:1500],
                   "traceback": traceback.format_exc(limit=-6)[-3000:]}
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    labels = [x for x in a.labels.split(",") if x] or [x for x, _, _ in items]
    expect = spec.get("expect_runner")
    bad = 0
    for label, boot, _ in items:
        if label not in labels:
            continue
        b = cli.build_parser().parse_args(["boot", label, *shlex.split(spec["boot"]), *shlex.split(boot)])
        model = server.model_folder(b.model, b.mtp, b.spec_method)
        args = server.serve_args(b)
        with tempfile.TemporaryDirectory() as reports:
            env = server.server_env(b.config, b.overlay_env, b.env, None, reports)
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--series", a.series,
                                "--child", json.dumps([model, args])], env=env, capture_output=True, text=True,
                               timeout=600)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
        res = json.loads(line[7:]) if line else {"ok": False, "error": f"exit {p.returncode}: {p.stderr[-1500:]}"}
        runner = "V2" if res.get("use_v2_model_runner") else "V1"  # True, or the line saying V2 is implied
        good = res.get("ok") and (expect is None or runner == expect)
        bad += not good
        implied = isinstance(res.get("use_v2_model_runner"), str)
        print(f"{label}: {'ok' if good else 'FAILED'}"
              + (f" (model runner {runner}{', implied: this vLLM has only V2' if implied else ''})" if res.get("ok") else "")
              + f": vllm serve {model} {' '.join(args)}")
        print("  " + json.dumps({k: v for k, v in res.items() if k != "traceback"}))
        if not res.get("ok"):
            print(res.get("traceback", ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
