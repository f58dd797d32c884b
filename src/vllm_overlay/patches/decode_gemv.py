"""decode-gemv: a one-row GEMV for the unquantized linear layers of a decode step (CUDA).

At one decode stream a hybrid MoE model's step is GPU-bound and its dense projections are the
largest share: on the H200 (vLLM 0.33.0, 35B-A3B geometry, bf16) they took 1.92 ms of a 4.10 ms
step against a weight-read floor of 0.54 ms, because cuBLAS runs these one-row products as
tensor-core GEMM tiles, some with a split-K reduction kernel after them. vLLM calls
``torch.nn.functional.linear`` for every unquantized layer on CUDA (``default_unquantized_gemm``;
ROCm has a skinny-GEMM path for this, CUDA none).

This patch gives each ``UnquantizedLinearMethod`` that vLLM built with ``default_unquantized_gemm``
(from vLLM 0.34.0 ``cuda_unquantized_gemm``, which is F.linear outside its few skinny-GEMM plans)
the overlay's GEMM instead: one custom op, ``vllm_overlay::decode_gemv``, that runs the Triton
GEMV of ``kernels/decode_gemv.py`` when the input is exactly one row and the weight is a plain
bf16/fp16 matrix, and ``torch.nn.functional.linear`` otherwise (prefills, batches of two or more,
other dtypes). The choice is made when the op runs, not when it is traced, so one compiled graph
serves every batch size and a CUDA graph of one row captures the GEMV. Each weight's kernel is
compiled after the weights load, before any CUDA graph is captured. The kernel's tile sizes come
from a table per device, in this order: the file named by ``VLLM_OVERLAY_DECODE_GEMV_CONFIGS``, the
table ``vllm-overlay tune-gemv`` measured on this device for this vLLM release (in the user's cache,
``~/.cache/vllm-overlay/decode-gemv/``), the table that ships (``data/decode_gemv_configs.json``); a
table measured on another release is said and not used. A table's "cublas" entry keeps vLLM's GEMM for
that shape, where cuBLAS was the faster. Shapes no table lists get a heuristic config on the SM count.
By default (``VLLM_OVERLAY_DECODE_GEMV=auto``) the patch acts only where a table was measured: the
user's own, a tune-gemv table of this device and release (a shape it does not list keeps cuBLAS), or
the shipped table on a device and release where a served A/B against stock measured it (its "proven"
entry), and with CUDA graphs on; elsewhere those layers keep cuBLAS, said once per process with the
command that measures a table. The tuning is a command, not a step of vLLM's start-up: it times every
shape on an idle GPU for minutes, which inside a serving process would stall each boot and time the
kernels against the model's own warm-up.

Outputs are the same sums as cuBLAS's, added in another order in fp32 and rounded once: they can
differ from stock by one bf16 rounding step in some elements, so greedy outputs and logprobs are
compared against stock in the benchmark that measures the speed.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from dataclasses import dataclass
from typing import Any

from vllm_overlay import report, settings
from vllm_overlay.gemv_table import CUBLAS, load_table, read_table
from vllm_overlay.logs import LOG
from vllm_overlay.mechanisms.wrap import argument
from vllm_overlay.patches import _gemv_cache
from vllm_overlay.report import STATE
from vllm_overlay.spec import PatchSpec, Proof, Support, Target, why_from, wraps

PATCH_ID = "decode-gemv"
LINEAR = "vllm.model_executor.layers.linear"
LIN_PATH = "model_executor/layers/linear.py"
UTILS_PATH = "model_executor/layers/utils.py"
SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                       "decode_gemv_configs.json")
OP = "vllm_overlay::decode_gemv"

# the CUDA branch of dispatch_unquantized_gemm without a FlashInfer linear backend: what a patched
# UnquantizedLinearMethod starts from (the proof that the patch acts, not only installs)
CUDA_DISPATCH = ("    backend_spec = _FLASHINFER_BF16_BACKENDS.get(linear_backend)\n"
                 "    if backend_spec is None:\n        return {impl}\n")
# what vLLM's CUDA dispatch may return for an unquantized layer that the patch takes over
ADOPTABLE = ("default_unquantized_gemm", "cuda_unquantized_gemm")

LEGACY = ("UnquantizedLinearMethod.apply calls dispatch_unquantized_gemm() on every call; after a layer's weights "
          "load, where that returns default_unquantized_gemm, the method's apply is replaced on the instance by one "
          "calling the overlay's op")

INIT = Target(LINEAR, "UnquantizedLinearMethod.__init__", vllm=">=0.29.0")
AFTER_LOADING = Target(LINEAR, "UnquantizedLinearMethod.process_weights_after_loading", params=("layer",))

SPEC = PatchSpec(
    id=PATCH_ID,
    title="A one-row GEMV for unquantized linear layers at decode (CUDA; by default where a table measured it: "
          "vllm-overlay tune-gemv)",
    why=why_from(__doc__),
    upstream="https://github.com/vllm-project/vllm/blob/v0.33.0/vllm/model_executor/layers/utils.py "
             "(default_unquantized_gemm: torch.nn.functional.linear for every unquantized layer on CUDA)",
    targets=(INIT, AFTER_LOADING),
    mechanism="wrap",
    support=(
        Support("<0.22.0", "applies", LEGACY + " (as in 0.22.0-0.28.0; this row's source is not in the sweep's "
                "proofs)"),
        Support(">=0.22.0,<0.29.0", "applies", LEGACY,
                (Proof(LIN_PATH, "return dispatch_unquantized_gemm()(layer, x, layer.weight, bias)"),)),
        Support(">=0.29.0,<=0.33.0", "applies",
                "UnquantizedLinearMethod.__init__ stores dispatch_unquantized_gemm(linear_backend) as "
                "self._gemm_impl and apply() calls it; on CUDA without a FlashInfer linear backend that is "
                "default_unquantized_gemm (torch.nn.functional.linear), which the patch replaces per instance",
                (Proof(LIN_PATH, "self._gemm_impl = dispatch_unquantized_gemm(linear_backend)"),
                 Proof(LIN_PATH, "return self._gemm_impl(layer, x, layer.weight, bias)"),
                 Proof(UTILS_PATH, CUDA_DISPATCH.format(impl="default_unquantized_gemm")),
                 Proof(UTILS_PATH, "def default_unquantized_gemm(\n    layer: torch.nn.Module,\n"
                                   "    x: torch.Tensor,\n    weight: torch.Tensor,\n"
                                   "    bias: torch.Tensor | None = None,\n):\n"
                                   "    return torch.nn.functional.linear(x, weight, bias)"))),
        Support("==0.34.0", "applies",
                "on CUDA dispatch_unquantized_gemm now returns cuda_unquantized_gemm: "
                "torch.nn.functional.linear, except for a layer that process_weights_after_loading marked "
                "use_skinny_gemm (vLLM's CuTe skinny GEMM, planned for a few shapes on SM 12.1 only). The patch "
                "replaces cuda_unquantized_gemm per instance and, after loading, asks vLLM's own "
                "maybe_use_skinny_gemm: a layer vLLM would run on its skinny GEMM keeps vLLM's GEMM (counter "
                "decode_gemv_weights_kept_skinny). Where the GEMV takes in_proj_ba, the ba/qkvz stream overlap "
                "the eager Qwen3.5 CUDA model may opt into (it requires vLLM's own GEMM there) stays off",
                (Proof(LIN_PATH, "self._gemm_impl = dispatch_unquantized_gemm(linear_backend)"),
                 Proof(LIN_PATH, "return self._gemm_impl(layer, x, layer.weight, bias)"),
                 Proof(LIN_PATH, "elif self._gemm_impl is cuda_unquantized_gemm:\n"
                                 "            maybe_use_skinny_gemm(layer)"),
                 Proof(UTILS_PATH, CUDA_DISPATCH.format(impl="cuda_unquantized_gemm")),
                 Proof(UTILS_PATH, "        and getattr(layer, \"use_skinny_gemm\", False)\n"),
                 Proof(UTILS_PATH, "        return torch.ops.vllm.cuda_skinny_unquantized_gemm(x, weight)\n"
                                   "    return torch.nn.functional.linear(x, weight, bias)"),
                 Proof(UTILS_PATH, "        layer.use_skinny_gemm = True"))),
    ),
    default=True,
    disabled_by="VLLM_OVERLAY_DECODE_GEMV",
    platforms=("cuda",),
    changes_traced_code=True,
    retire_when="vLLM's unquantized GEMM on CUDA reads one-row weights at the memory bandwidth (a skinny-GEMM "
                "path like ROCm's), measured on the devices the table covers.",
    settings=("VLLM_OVERLAY_DECODE_GEMV", "VLLM_OVERLAY_DECODE_GEMV_CONFIGS"),
    shown_by=("decode_gemv_calls",),
    idle_by=("decode_gemv_stood_aside",),
    beyond_matrix="never",
    beyond_matrix_why=("it replaces vLLM's GEMM for one-row forwards with the overlay's kernel, and by default acts "
                       "only where a served A/B measured it; no release beyond the matrix was measured"),
)

_LOCK = threading.Lock()
_REGISTERED: list[Any] = []  # the torch.library.Library holding the op (kept alive; inherited on fork)
_CONFIGS: dict[tuple[int, int, int], Any] = {}  # (N, K, device index) -> gemv_table.Config
_TABLES: dict[str, Any] = {}  # device name -> Chosen
_NOTED: set[str] = set()


# ---- the config table -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Chosen:
    """The table a device's configs come from: {"NxK": Config or CUBLAS}, where it was read, what kind
    of table it is ("user": VLLM_OVERLAY_DECODE_GEMV_CONFIGS, "tuned": a table `vllm-overlay tune-gemv`
    measured for this device and release, "shipped", or "heuristic": none) and where it was measured."""

    table: dict[str, Any]
    source: str
    kind: str
    measured: dict[str, Any] | None = None

    def where(self) -> str:
        m = self.measured or {}
        if not m:
            return self.source
        return f"{self.source} (measured on vLLM {m.get('vllm')}, {m.get('date_utc', 'no date')})"


def _say(line: str) -> None:
    """A WARNING and a report event, once per process."""
    if line in _NOTED:
        return
    _NOTED.add(line)
    LOG.warning(line)
    STATE.event(line)


def _other_release(measured: dict[str, Any] | None, version: str | None) -> str | None:
    """The release a device's table was measured on where it is not this process's, else None."""
    if measured and version and measured.get("vllm") != version:
        return str(measured.get("vllm"))
    return None


def _user_table(device_name: str, version: str | None) -> Chosen | None:
    user = settings.value("VLLM_OVERLAY_DECODE_GEMV_CONFIGS")
    if not user:
        return None
    tables, measured = read_table(str(user), "VLLM_OVERLAY_DECODE_GEMV_CONFIGS")
    found = tables.get(device_name)
    if not found:  # a table for other devices: said once per device, never silently replaced
        _say(f"decode-gemv: VLLM_OVERLAY_DECODE_GEMV_CONFIGS={user} names the devices "
             f"{', '.join(repr(d) for d in sorted(tables)) or 'none'}, not this process's {device_name!r} "
             "(the name torch.cuda.get_device_properties gives); it is not used for this device")
        return None
    other = _other_release(measured.get(device_name), version)
    if other:
        _say(f"decode-gemv: VLLM_OVERLAY_DECODE_GEMV_CONFIGS={user}: its table for {device_name} was measured on "
             f"vLLM {other}, this process runs {version}; it is not used (vllm-overlay tune-gemv measures one for "
             "this release)")
        return None
    return Chosen(found, str(user), "tuned" if device_name in measured else "user", measured.get(device_name))


def _cached_table(device_name: str, version: str | None) -> Chosen | None:
    if not version:
        return None
    path = _gemv_cache.cache_file(device_name, version)
    why = _gemv_cache.problem(path)
    if why == "does not exist":
        return None
    if why:
        _say(f"decode-gemv: the cached table {path} {why}; it is not used")
        return None
    try:
        tables, measured = read_table(path, "decode-gemv cached table")
    except ValueError as exc:
        _say(f"decode-gemv: {exc}; it is not used (vllm-overlay tune-gemv writes it again)")
        return None
    m = measured.get(device_name)
    if device_name not in tables or not m or _other_release(m, version):
        _say(f"decode-gemv: the cached table {path} holds no table measured for {device_name} on vLLM {version} "
             f"(devices {sorted(tables)}, measured {({d: v.get('vllm') for d, v in measured.items()})}); it is not "
             "used")
        return None
    return Chosen(tables[device_name], path, "tuned", m)


def chosen(device_name: str) -> Chosen:
    """The table this device's configs come from, in order: VLLM_OVERLAY_DECODE_GEMV_CONFIGS, the cached
    table `vllm-overlay tune-gemv` measured for this device and vLLM release, the shipped table; a table
    measured on another release is said and not used (cached per process)."""
    with _LOCK:
        if device_name in _TABLES:
            return _TABLES[device_name]
    version = STATE.vllm_version
    found = _user_table(device_name, version) or _cached_table(device_name, version)
    if found is None and os.path.exists(SHIPPED):
        table = load_table(SHIPPED, "decode-gemv shipped table").get(device_name)
        if table:
            found = Chosen(table, SHIPPED, "shipped")
    found = found or Chosen({}, "heuristic (no tuned table for this device)", "heuristic")
    with _LOCK:
        _TABLES[device_name] = found
    return found


def table_for(device_name: str) -> tuple[dict[str, Any], str]:
    """The tuned configs for this device and where they come from."""
    c = chosen(device_name)
    return c.table, c.source


@functools.lru_cache(maxsize=1)
def shipped_proven() -> dict[str, list[str]]:
    """{device name: [vLLM releases]} where the shipped table was measured against stock in a served
    A/B (the table's "proven" entry): where VLLM_OVERLAY_DECODE_GEMV=auto turns the GEMV on."""
    try:
        with open(SHIPPED) as f:
            proven = json.load(f).get("proven") or {}
    except (OSError, json.JSONDecodeError, AttributeError):
        return {}
    return {str(k): [str(v) for v in vs] for k, vs in proven.items() if isinstance(vs, list)}


TUNE = "vllm-overlay tune-gemv"


def auto_refusal(device_name: str, version: str | None) -> str | None:
    """Why VLLM_OVERLAY_DECODE_GEMV=auto keeps cuBLAS on this device and release, or None: auto acts with
    the user's table, a table tune-gemv measured for this device and release, or the shipped table where
    a served A/B measured it (its "proven" entry)."""
    found = chosen(device_name)
    if found.kind in ("user", "tuned"):
        return None
    proven = shipped_proven()
    if found.kind == "shipped" and version in proven.get(device_name, []):
        return None
    covered = "; ".join(f"{d} on vLLM {', '.join(v)}" for d, v in sorted(proven.items())) or "nothing"
    cache = _gemv_cache.cache_file(device_name, version or "VERSION")
    return (f"VLLM_OVERLAY_DECODE_GEMV=auto and no GEMV table was measured for {device_name} on vLLM {version} "
            f"(the shipped table covers {covered}; no table in {cache}); {TUNE} --model MODEL_DIR measures one "
            "there, in a few minutes on this GPU, for the next start; VLLM_OVERLAY_DECODE_GEMV=1 runs the GEMV with "
            "heuristic configs")


def config_for(n: int, k: int, device: Any) -> Any:
    """The kernel config for an N x K weight on ``device``, or None where the table keeps cuBLAS for
    that shape (cached per process). Under VLLM_OVERLAY_DECODE_GEMV=auto a shape that a tuned table
    (measured by tune-gemv) does not list keeps cuBLAS too: it was not measured there."""
    import torch

    from vllm_overlay.gemv_table import heuristic

    index = device.index if device.type == "cuda" else -1
    key = (n, k, index)
    if key in _CONFIGS:
        return _CONFIGS[key]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name, sms = props.name, props.multi_processor_count
    else:  # the Triton interpreter (tests): an H200-sized SM count
        name, sms = "cpu (Triton interpreter)", 132
    found = chosen(name)
    cfg = found.table.get(f"{n}x{k}")
    source = found.where()
    if cfg is None and found.kind == "tuned" and settings.value("VLLM_OVERLAY_DECODE_GEMV") == "auto":
        cfg, source = CUBLAS, f"not in {found.source}: keeps cuBLAS"
        _say(f"decode-gemv: the shape {n}x{k} is not in the table measured for {name} ({found.where()}); it keeps "
             f"cuBLAS under VLLM_OVERLAY_DECODE_GEMV=auto ({TUNE} --shapes {n}x{k} measures it)")
    elif cfg is None:
        cfg, source = heuristic(n, k, sms), f"heuristic ({sms} SMs)"
    if cfg == CUBLAS:
        cfg = None
    _CONFIGS[key] = cfg
    report.patch_put(PATCH_ID, "configs", f"{n}x{k}", {"config": cfg.as_list() if cfg else CUBLAS, "device": name,
                                                       "source": source})
    return cfg


# ---- the op -----------------------------------------------------------------------------------------


def eligible(x: Any, weight: Any, bias: Any) -> bool:
    """One input row and a plain half-precision weight of the same dtype (else F.linear)."""
    import torch

    k = x.shape[-1]
    return (x.numel() == k and k > 0 and weight.dim() == 2 and weight.shape[1] == k and weight.stride(1) == 1
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and (bias is None or (bias.dtype == x.dtype and bias.dim() == 1 and bias.stride(0) == 1))
            and weight.device == x.device)


def _op_impl(x: Any, weight: Any, bias: Any) -> Any:
    import torch

    cfg = config_for(weight.shape[0], x.shape[-1], x.device) if eligible(x, weight, bias) else None
    if cfg is None:
        return torch.nn.functional.linear(x, weight, bias)
    from vllm_overlay.kernels.decode_gemv import gemv

    STATE.count("decode_gemv_calls")  # eager calls and CUDA graph captures; replays run no Python
    return gemv(x, weight, bias, cfg)


def _op_fake(x: Any, weight: Any, bias: Any) -> Any:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def ensure_op() -> Any:
    """Register ``vllm_overlay::decode_gemv`` once per process (a forked child inherits it)."""
    import torch

    with _LOCK:
        if not _REGISTERED:
            lib = torch.library.Library("vllm_overlay", "FRAGMENT")
            lib.define("decode_gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
            for key in ("CUDA", "CPU"):  # CPU: the Triton interpreter in tests (TRITON_INTERPRET=1)
                lib.impl("decode_gemv", _op_impl, key)
            torch.library.register_fake(OP, _op_fake, lib=lib)
            _REGISTERED.append(lib)
    return torch.ops.vllm_overlay.decode_gemv


def overlay_gemm(layer: Any, x: Any, weight: Any, bias: Any = None) -> Any:
    """What ``UnquantizedLinearMethod.apply`` calls instead of default_unquantized_gemm (traced by
    torch.compile: a plain function calling one custom op)."""
    import torch

    return torch.ops.vllm_overlay.decode_gemv(x, weight, bias)


# ---- the wrappers -----------------------------------------------------------------------------------


def _stand_aside(why: str) -> None:
    STATE.count("decode_gemv_stood_aside")
    if why in _NOTED:
        return
    _NOTED.add(why)
    line = f"decode-gemv: stands aside: {why}; those layers keep vLLM's GEMM (counter decode_gemv_stood_aside)"
    LOG.warning(line)
    STATE.event(line)


def _adopt(impl: Any) -> bool:
    """Whether the overlay's GEMM may replace ``impl``, vLLM's choice for an unquantized layer (said once
    per reason where not)."""
    from vllm.model_executor.layers import utils

    if not any(impl is getattr(utils, name, None) for name in ADOPTABLE):
        name = getattr(impl, "__name__", None) or getattr(getattr(impl, "func", None), "__name__", repr(impl))
        _stand_aside(f"vLLM chose {name} for unquantized linear layers (the patch replaces only "
                     f"{' or '.join(ADOPTABLE)})")
        return False
    import vllm.envs as envs

    if getattr(envs, "VLLM_BATCH_INVARIANT", False):
        _stand_aside("VLLM_BATCH_INVARIANT is set (vLLM's batch-invariant linear runs instead of any GEMM impl)")
        return False
    if settings.value("VLLM_OVERLAY_DECODE_GEMV") == "auto":
        eager = graphs_off()
        if eager:
            _stand_aside(f"VLLM_OVERLAY_DECODE_GEMV=auto and {eager}: without CUDA graphs every call pays the GEMV's "
                         "launch on the host, where the measured gain was with graphs (VLLM_OVERLAY_DECODE_GEMV=1 "
                         "runs it anyway)")
            return False
        import torch

        name = torch.cuda.get_device_properties(torch.cuda.current_device()).name if torch.cuda.is_available() \
            else "no CUDA device"
        why = auto_refusal(name, STATE.vllm_version)
        if why:
            _stand_aside(why)
            return False
    ensure_op()
    STATE.count("decode_gemv_methods")
    return True


def graphs_off() -> str | None:
    """Why the engine being built runs without CUDA graphs (enforce_eager, cudagraph_mode NONE), or None."""
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:  # older releases: only get_current_vllm_config
        return None
    cfg = get_current_vllm_config_or_none()
    if cfg is None:
        return None
    if getattr(getattr(cfg, "model_config", None), "enforce_eager", False):
        return "enforce_eager is set"
    mode = getattr(getattr(cfg, "compilation_config", None), "cudagraph_mode", None)
    if mode is not None and getattr(mode, "name", str(mode)) == "NONE":
        return "cudagraph_mode is NONE"
    return None


def _legacy_apply(self: Any, layer: Any, x: Any, bias: Any = None) -> Any:
    """UnquantizedLinearMethod.apply on vLLM < 0.29 for a method the patch adopted."""
    import torch

    return torch.ops.vllm_overlay.decode_gemv(x, layer.weight, bias)


VLLM_GEMM = "_vllm_overlay_vllm_gemm"  # on an adopted method: the GEMM vLLM chose (given back for skinny plans)


@wraps(INIT)
def _init(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    if hasattr(instance, "_gemm_impl") and _adopt(instance._gemm_impl):  # vLLM >= 0.29
        setattr(instance, VLLM_GEMM, instance._gemm_impl)
        instance._gemm_impl = overlay_gemm
    return result


def _keeps_skinny(instance: Any, layer: Any) -> bool:
    """vLLM >= 0.34: where vLLM chose cuda_unquantized_gemm and its own after-loading step would mark this
    layer for its skinny GEMM (a plan for the weight's shape), give the layer back to vLLM's GEMM."""
    from vllm.model_executor.layers import utils

    vllm_gemm = getattr(instance, VLLM_GEMM, None)
    cuda_gemm = getattr(utils, "cuda_unquantized_gemm", None)
    mark = getattr(utils, "maybe_use_skinny_gemm", None)
    if cuda_gemm is None or vllm_gemm is not cuda_gemm or mark is None:
        return False
    mark(layer)
    if not getattr(layer, "use_skinny_gemm", False):
        return False
    instance._gemm_impl = vllm_gemm
    STATE.count("decode_gemv_weights_kept_skinny")
    return True


def adopted(instance: Any) -> bool:
    """Whether this method runs the overlay's GEMM; on vLLM < 0.29 (no _gemm_impl: apply() asks
    dispatch_unquantized_gemm() on every call) decided here, once per method, after its weights load."""
    if hasattr(instance, "_gemm_impl"):
        return instance._gemm_impl is overlay_gemm
    if "apply" in vars(instance):
        return getattr(vars(instance)["apply"], "__func__", None) is _legacy_apply
    from vllm.model_executor.layers import linear

    if not _adopt(linear.dispatch_unquantized_gemm()):
        return False
    import types

    instance.apply = types.MethodType(_legacy_apply, instance)
    return True


@wraps(AFTER_LOADING)
def _after_loading(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    if not adopted(instance):
        return result
    import torch

    layer = argument(SPEC.targets[1].params, "layer", args, kwargs)
    if _keeps_skinny(instance, layer):
        return result
    w = getattr(layer, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.stride(1) != 1 or w.dtype not in (torch.bfloat16,
                                                                                             torch.float16):
        STATE.count("decode_gemv_weights_not_eligible")
        return result
    from vllm_overlay.kernels.decode_gemv import gemv

    # compile this shape's kernel now, outside any CUDA graph capture, and check it runs
    cfg = config_for(w.shape[0], w.shape[1], w.device)
    if cfg is None:
        STATE.count("decode_gemv_weights_kept_cublas")
        return result
    with torch.no_grad():
        gemv(torch.zeros((1, w.shape[1]), dtype=w.dtype, device=w.device), w, None, cfg)
    STATE.count("decode_gemv_weights_warmed")
    return result
