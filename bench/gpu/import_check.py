"""Which distributions does a staged vLLM import on its serving path? Run on a CPU machine, in a
Python 3.12 environment laid out like the H200 image (its packages at the versions of
h200-image-packages.txt) plus vLLM and the staged wheels, all installed with --no-deps.

  LD_LIBRARY_PATH=STUB_DIR python bench/gpu/import_check.py \
      --image HOST-PACKAGES.txt --wheels bench/gpu/device-wheels-0.26.0.txt

What cannot run on CPU is stood in for, and only that:
- the CUDA driver: STUB_DIR holds a libcuda.so.1 whose entry points all return
  CUDA_ERROR_NO_DEVICE, so vLLM's kernel libraries load (and register their torch ops) although
  no driver is installed; torch.cuda.is_available() stays False;
- the GPU: vLLM's current platform is set to its CUDA platform class reporting an H200
  (compute capability 9.0, 141 GiB), so every `if current_platform.is_cuda()` branch at import
  time is taken as on the H200;
- Triton's driver: vLLM disables Triton when no GPU driver is active (it imports a placeholder
  instead, and Model Runner V2 then refuses to start), so Triton's NVIDIA driver reports itself
  active, as on the H200, before vLLM looks: vLLM's kernels are defined with the real Triton (0.33.0's
  Mamba SSD kernels read `num_stages` of their autotune configs at import on capability 9.0, which
  the placeholder's configs lack), and the engine-config step sees Triton as present
  (vllm.config.vllm.HAS_TRITON). Nothing is compiled.

It imports the modules a `vllm serve` / `LLM(...)` process loads for the tiny Qwen3-Next hybrid
(CLI, API server, engine core, worker, Model Runner V1 and V2, the model, the FlashAttention and
GDN backends) after loading vLLM's plugins (the overlay, where installed), builds the engine config for that model with VLLM_USE_V2_MODEL_RUNNER=1, and
prints: every third-party distribution imported and whether the image or the wheel list has it;
every module that was looked for and not found (vLLM's optional imports); any import that failed.
Exit status 1 when an imported distribution is in neither list or an import failed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.abc
import importlib.metadata as md
import io
import os
import re
import sys
import sysconfig
import traceback

MODULES = [
    "vllm",
    "vllm.entrypoints.cli.main",
    "vllm.entrypoints.cli.serve",
    "vllm.entrypoints.openai.api_server",
    "vllm.entrypoints.llm",
    "vllm.v1.engine.core",
    "vllm.v1.engine.async_llm",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.worker.gpu.model_runner",
    "vllm.model_executor.models.qwen3_next",
    "vllm.model_executor.models.qwen3_moe",
    "vllm.model_executor.model_loader.dummy_loader",
    "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn",
    "vllm.v1.attention.backends.flash_attn",
    "vllm.v1.attention.backends.gdn_attn",
    "vllm.v1.attention.backends.triton_attn",
    "vllm.vllm_flash_attn.flash_attn_interface",
    "vllm.v1.sample.sampler",
    "vllm.v1.structured_output",
    "vllm.v1.core.sched.scheduler",
    "vllm.compilation.backends",
    "vllm.model_executor.warmup.kernel_warmup",
    "vllm.model_executor.layers.fused_moe",
    "vllm.distributed.device_communicators.cuda_communicator",
    "vllm.v1.spec_decode.eagle",
]


class Missing(importlib.abc.MetaPathFinder):
    """Last on sys.meta_path: records every top-level module no finder could find."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001
        if "." not in name and name not in self.names:
            caller = sys._getframe(1)
            while caller and (caller.f_code.co_filename.startswith("<frozen")
                              or "importlib" in caller.f_code.co_filename):
                caller = caller.f_back
            self.names[name] = f"{caller.f_code.co_filename}:{caller.f_lineno}" if caller else "?"
        return None


def read_list(path: str) -> dict[str, str]:
    out = {}
    for line in open(path):
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, ver = line.partition("==")
            out[re.sub(r"[-_.]+", "-", name).lower()] = ver
    return out


def triton_driver_active() -> None:
    try:
        from triton.backends import backends
    except ImportError:
        return
    nvidia = backends.get("nvidia")
    if nvidia is not None and nvidia.driver is not None:
        nvidia.driver.is_active = staticmethod(lambda: True)


def fake_h200() -> None:
    import vllm.platforms as platforms
    from vllm.platforms.cuda import NonNvmlCudaPlatform
    from vllm.platforms.interface import DeviceCapability

    class H200(NonNvmlCudaPlatform):
        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(major=9, minor=0)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "NVIDIA H200"

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return 141 * 2**30

    platforms._current_platform = H200()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--image", required=True)
    ap.add_argument("--wheels", required=True)
    ap.add_argument("--model-dir", default="", help="config.json folder (default: the overlay's tiny hybrid)")
    ap.add_argument("--also", default="", metavar="MODULES",
                    help="more modules to import, comma-separated (e.g. what a release imports lazily at warm-up)")
    args = ap.parse_args()
    also = [m.strip() for m in args.also.split(",") if m.strip()]
    image, wheels = read_list(args.image), read_list(args.wheels)
    missing = Missing()
    sys.meta_path.append(missing)
    failures: dict[str, str] = {}

    triton_driver_active()
    fake_h200()
    from vllm.platforms import current_platform

    print(f"platform: {type(current_platform).__name__} is_cuda={current_platform.is_cuda()} "
          f"capability={current_platform.get_device_capability()}")
    # vLLM's plugins (the overlay, where installed) load before the model code, as in a worker
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    absent = []  # modules of the list that this release does not have (0.34.0 removed Model Runner V1's)
    for mod in [*MODULES, *also]:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name and (mod == exc.name or mod.startswith(exc.name + ".")) and exc.name.startswith("vllm."):
                absent.append(mod)
            else:
                failures[mod] = traceback.format_exc(limit=-4)
        except BaseException:  # noqa: BLE001 - reported
            failures[mod] = traceback.format_exc(limit=-4)
    if absent:
        print(f"not in this release ({len(absent)}): {', '.join(absent)}")

    # the CLI parser of `vllm serve` (builds every argument group)
    from vllm.entrypoints.cli import main as cli_main

    old = sys.argv
    sys.argv = ["vllm", "serve", "--help"]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            cli_main.main()
    except SystemExit as exc:
        if exc.code not in (0, None):
            failures["vllm serve --help"] = f"exit {exc.code}"
    except BaseException:  # noqa: BLE001
        failures["vllm serve --help"] = traceback.format_exc(limit=-4)
    finally:
        sys.argv = old

    # the engine config of the run on the H200: tiny hybrid, V2 forced, Triton GDN prefill
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    try:
        import vllm.config.vllm as config_vllm

        config_vllm.HAS_TRITON = True  # Triton has no driver on CPU; on the H200 it has one
        from vllm.engine.arg_utils import EngineArgs

        model = args.model_dir
        if not model:
            from vllm_overlay.tools.models import tiny_hybrid_dir

            model = tiny_hybrid_dir()
        cfg = EngineArgs(model=model, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                         max_num_batched_tokens=8192, max_model_len=32768, max_num_seqs=32,
                         enable_prefix_caching=False,
                         additional_config={"gdn_prefill_backend": "triton"}).create_engine_config()
        print(f"engine config: use_v2_model_runner={getattr(cfg, 'use_v2_model_runner', 'gone (V2 only)')} "
              f"hybrid={cfg.model_config.is_hybrid} attention_backend={cfg.attention_config.backend}")
        from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import _resolve_gdn_prefill_backend

        print(f"GDN prefill backend on the H200: {_resolve_gdn_prefill_backend(cfg)}")
        from vllm.model_executor.models import ModelRegistry

        cls, arch = ModelRegistry.resolve_model_cls(cfg.model_config.architectures, cfg.model_config)
        print(f"model class: {cls.__module__}.{cls.__name__}")
    except BaseException:  # noqa: BLE001
        failures["engine config"] = traceback.format_exc(limit=-6)

    try:
        import json

        import vllm_overlay

        path = vllm_overlay.flush()
        rep = json.load(open(path)) if path else {}
        print("overlay patches: " + ", ".join(f"{k}={v.get('status')}" for k, v in sorted(rep.get("patches", {}).items())))
    except ImportError:
        print("overlay: not installed in this environment")

    # every loaded module's file, attributed to the installed distribution whose RECORD lists it
    owner: dict[str, str] = {}
    for dist in md.distributions():
        for f in dist.files or ():
            if f.suffix in (".py", ".so", ".pyd"):
                owner[os.path.realpath(dist.locate_file(f))] = dist.metadata["Name"]
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    used: dict[str, str] = {}
    unowned: dict[str, str] = {}
    for name, mod in list(sys.modules.items()):
        path = getattr(mod, "__file__", None)
        if not path or not os.path.isabs(path) or name == "__main__":
            continue
        path = os.path.realpath(path)
        dist = owner.get(path)
        if dist:
            used.setdefault(re.sub(r"[-_.]+", "-", dist).lower(), name)
        elif not path.startswith(stdlib + os.sep) or "site-packages" in path:
            unowned.setdefault(os.path.dirname(path), name)
    bad = []
    print("\nthird-party distributions imported (first module seen):")
    for key in sorted(used):
        if key == "vllm":
            continue
        vendored = "_vendor" in str(md.distribution(key).locate_file(""))
        where = ("image" if key in image else "wheels" if key in wheels
                 else "vendored inside an image package" if vendored
                 else "the project" if key == "vllm-overlay" else None)
        if where is None:
            bad.append(key)
        print(f"  {key:40s} {where or 'NOT IN IMAGE OR WHEEL LIST'}  ({used[key]})")
    for folder, name in sorted(unowned.items()):
        print(f"  {name} and others from {folder} (no installed distribution lists them)")
    seen = used
    print("\nmodules looked for and not found (optional imports; first place asked):")
    for name, where in sorted(missing.names.items()):
        if not name.startswith("_"):
            where = re.sub(r".*/site-packages/", "", where)
            print(f"  {name:28s} {where}")
    print("\nimport failures:" if failures else "\nimport failures: none")
    for mod, tb in failures.items():
        print(f"--- {mod}\n{tb}")
    print(f"\n{len(seen)} distributions imported, {len(bad)} outside image+wheels, {len(failures)} failures")
    return 1 if bad or failures else 0


if __name__ == "__main__":
    sys.exit(main())
