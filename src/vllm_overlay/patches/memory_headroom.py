"""memory-headroom: the memory vLLM leaves for activations covers a real forward of
max_num_batched_tokens tokens, measured before the KV cache is sized.

vLLM sizes the KV cache from the peak of one profiling forward. On hybrid models that peak is too
low: the profiling forward carries no attention metadata, so the Gated-DeltaNet layers only warm
their kernels and the full-attention layers return early; the chunked-prefill temporaries of a
real long prefill are never measured (upstream issues 52872 and 54775), and with
VLLM_OVERLAY_PROFILE_RUN_CAP the profiling forward is smaller than max_num_batched_tokens on purpose.

In each worker, after vLLM's determine_available_memory and before the KV cache exists, this patch
builds vLLM's own minimal profiling KV cache (the one it builds for CUDA graph memory profiling),
runs prefill-shaped dummy forwards of max_num_batched_tokens tokens with real attention metadata
(one long prefill, and vLLM's own split into max_num_seqs prefills), measures their peak
(allocator bytes on CUDA, resident set on the CPU build), drops that cache exactly as vLLM does,
and takes the shortfall against what profiling reserved from the KV cache budget: one line and
report fields (profiled peak, measured peak, memory moved, KV blocks and tokens before and after).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

from vllm_overlay import headroom, settings
from vllm_overlay.errors import OverlayError
from vllm_overlay.patches._runner import RUNNER, RUNNER_MODULE
from vllm_overlay.report import LOG, STATE
from vllm_overlay.spec import PatchSpec, Proof, Support, Target

PATCH_ID = "memory-headroom"
WORKER_MODULE = "vllm.v1.worker.gpu_worker"
CPU_WORKER_MODULE = "vllm.v1.worker.cpu_worker"
RUNNER_PATH = "v1/worker/gpu_model_runner.py"
WORKER_PATH = "v1/worker/gpu_worker.py"
CPU_WORKER_PATH = "v1/worker/cpu_worker.py"

# What the measurement calls on the V1 runner, in every release it applies on (the sweep checks
# each text in each release's sources).
_RUNNER_PROOFS = (
    Proof(RUNNER_PATH, "def _init_minimal_kv_cache_for_profiling(self) -> None:"),
    Proof(RUNNER_PATH, "def _cleanup_profiling_kv_cache(self) -> None:"),
    Proof(RUNNER_PATH, "self.initialize_kv_cache(minimal_config, is_profiling=True)"),
    Proof(RUNNER_PATH, "profile_seq_lens: int | None = None,"),
    Proof(RUNNER_PATH, "max_num_reqs = self.scheduler_config.max_num_seqs"),
    Proof(RUNNER_PATH, "if force_attention or cudagraph_runtime_mode == CUDAGraphMode.FULL:"),
    Proof(RUNNER_PATH, "self.cudagraph_dispatcher.keys_initialized = False"),
    Proof(RUNNER_PATH, "self.kv_caches: list[torch.Tensor] = []"),
    Proof(RUNNER_PATH, "self.num_decode_draft_tokens.np[num_reqs:].fill(-1)"),
    Proof(RUNNER_PATH, "self.num_decode_draft_tokens.copy_to_gpu()"),
    Proof(RUNNER_PATH, "self.maybe_remove_all_loras(self.lora_config)"),
    Proof("v1/core/kv_cache_utils.py", "def get_max_concurrency_for_kv_cache_config("),
    Proof(CPU_WORKER_PATH, "requested_memory_for_kv = int(self.requested_cpu_memory - consumed_memory)"),
)

_TORCH_PEAK = Proof(WORKER_PATH, "profile_torch_peak = torch.accelerator.memory_stats(self.device).get(")
_TRANSIENT = Proof("utils/mem_utils.py", "result.transient_peak_headroom = (")
_V2_BY_ARCHITECTURE = Proof("config/vllm.py", "def _is_default_v2_model_runner_model")

SPEC = PatchSpec(
    id=PATCH_ID,
    title="Activation memory measured at max_num_batched_tokens, taken from the KV cache before it is sized",
    why=" ".join(__doc__.split("\n\n")[1:3]).replace("\n", " "),
    upstream="https://github.com/vllm-project/vllm/issues/52872 (fix PR 52935 open), "
             "https://github.com/vllm-project/vllm/issues/54775",
    targets=(
        Target(WORKER_MODULE, "Worker.determine_available_memory", wrapper="_determine_available_memory",
               platform="cuda"),
        Target(CPU_WORKER_MODULE, "CPUWorker.determine_available_memory", wrapper="_determine_available_memory",
               platform="cpu"),
        Target(RUNNER_MODULE, f"{RUNNER}.profile_run", wrapper="_profile_run"),
    ),
    mechanism="wrap",
    support=(
        Support("<=0.20.2", "applies",
                "V1 runner (the default: VLLM_USE_V2_MODEL_RUNNER defaults to 0); vLLM reserves the "
                "allocator peak of its profiling forward (torch peak read right after profile_run); the "
                "minimal profiling KV cache, its cleanup and _dummy_run(force_attention, profile_seq_lens) "
                "that the measurement drives exist",
                (Proof("envs.py", 'int(os.getenv("VLLM_USE_V2_MODEL_RUNNER", "0"))'), _TORCH_PEAK, *_RUNNER_PROOFS)),
        Support(">=0.22.0,<=0.26.0", "applies",
                "as 0.20.x; Model Runner V2 is the default only for a list of architectures without the "
                "hybrid GDN models (under V2 nothing is measured and one WARNING says so)",
                (_V2_BY_ARCHITECTURE, _TORCH_PEAK, *_RUNNER_PROOFS)),
        Support(">=0.27.0,<=0.28.0", "applies",
                "vLLM reserves the memory consumed after its profiling forward plus that forward's "
                "transient allocator peak (transient_peak_headroom): the same absolute peak the patch "
                "compares with; V2 by architecture list as 0.22.0",
                (_V2_BY_ARCHITECTURE, _TRANSIENT, *_RUNNER_PROOFS)),
        Support(">=0.29.0,<=0.33.0", "applies",
                "as 0.27.0, but vLLM runs Model Runner V2 by default on CUDA for every model: there the "
                "patch measures nothing and says so in one WARNING unless VLLM_USE_V2_MODEL_RUNNER=0; the "
                "CPU build (no Triton) runs the V1 runner",
                (Proof("config/vllm.py", "def _is_default_v2_model_runner_model", present=False),
                 _TRANSIENT, *_RUNNER_PROOFS)),
    ),
    default=True,
    disabled_by="VLLM_OVERLAY_MEMORY_HEADROOM",
    retire_when=(
        "vLLM's profiling forward carries attention metadata for GDN layers (issue 54775) and its "
        "measured peak covers a real forward of max_num_batched_tokens (bench/memory_headroom_h200.py "
        "shows nothing moved)."
    ),
    settings=("VLLM_OVERLAY_MEMORY_HEADROOM", "VLLM_OVERLAY_PROFILE_RUN_CAP"),
)


class HeadroomError(OverlayError, RuntimeError):
    """The measured forward leaves no memory for the KV cache, or could not run."""


class MeterUnavailable(RuntimeError):
    """This platform cannot measure a peak here (said once, nothing is corrected)."""


# ---- meters: one number space per platform ----------------------------------------------------


class CudaMeter:
    """The caching allocator's allocated bytes on one device (what vLLM's profiling reads)."""

    name = "torch.cuda allocated bytes"

    def __init__(self, device: Any) -> None:
        self.device = device

    def current(self) -> int:
        import torch

        return int(torch.cuda.memory_allocated(self.device))

    def reset_peak(self) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        import torch

        return int(torch.cuda.max_memory_allocated(self.device))

    def sync(self) -> None:
        import torch

        torch.cuda.synchronize(self.device)

    def non_torch(self) -> int:
        """Device memory in use that the caching allocator does not hold (NCCL, cuBLAS, ...)."""
        import torch

        free, total = torch.cuda.mem_get_info(self.device)
        return int(total - free - torch.cuda.memory_reserved(self.device))


class RssMeter:
    """The process's resident set (what the CPU worker subtracts from its requested memory):
    VmRSS now, VmHWM since the last reset (writing 5 to /proc/self/clear_refs resets it)."""

    name = "resident set (VmRSS / VmHWM)"

    def __init__(self, status: str = "/proc/self/status", clear_refs: str = "/proc/self/clear_refs") -> None:
        self.status, self.clear_refs = status, clear_refs

    def _read(self, key: str) -> int:
        with open(self.status) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        raise MeterUnavailable(f"{self.status} has no {key} line")

    def current(self) -> int:
        return self._read("VmRSS")

    def reset_peak(self) -> None:
        try:
            with open(self.clear_refs, "w") as f:
                f.write("5")
        except OSError as exc:
            raise MeterUnavailable(f"cannot reset the peak resident set ({self.clear_refs}: {exc})") from exc

    def peak(self) -> int:
        return self._read("VmHWM")

    def sync(self) -> None:
        pass

    def non_torch(self) -> int:
        return 0  # the resident set already counts every allocation of the process


def meter_for(worker: Any) -> CudaMeter | RssMeter:
    device = getattr(worker, "device", None)
    if getattr(device, "type", None) == "cpu" or type(worker).__name__ == "CPUWorker":
        return RssMeter()
    return CudaMeter(device)


# ---- the profiling forward: what vLLM reserved --------------------------------------------------

_profiles: weakref.WeakKeyDictionary[Any, dict[str, int]] = weakref.WeakKeyDictionary()  # runner -> numbers
_lock = threading.Lock()
_in_measurement = threading.local()


def _renew_after_fork() -> None:
    global _lock, _in_measurement
    _lock = threading.Lock()
    _in_measurement = threading.local()


os.register_at_fork(after_in_child=_renew_after_fork)


def _runner_meter(runner: Any) -> CudaMeter | RssMeter:
    device = getattr(runner, "device", None)
    return RssMeter() if getattr(device, "type", None) == "cpu" else CudaMeter(device)


def _profile_run(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Record the bytes in use when vLLM's profiling forward starts and its peak when it returns
    (vLLM resets the peak just before; CUDA reads the same allocator statistic vLLM reads)."""
    try:
        meter = _runner_meter(instance)
        baseline = meter.current()
    except Exception:  # noqa: BLE001 - no meter: the correction says so later, profiling goes on
        return wrapped(*args, **kwargs)
    result = wrapped(*args, **kwargs)
    try:
        rec = {"baseline": baseline, "peak": meter.peak(), "after": meter.current()}
    except Exception:  # noqa: BLE001
        return result
    with _lock:
        _profiles[instance] = rec
    return result


# ---- the correction ---------------------------------------------------------------------------


def _determine_available_memory(wrapped: Any, instance: Any, args: tuple[Any, ...],
                                kwargs: dict[str, Any]) -> Any:
    available = wrapped(*args, **kwargs)
    if getattr(_in_measurement, "on", False):  # a subclass calling its base: correct once
        return available
    _in_measurement.on = True
    try:
        return correct(instance, int(available))
    finally:
        _in_measurement.on = False


def _why_not(worker: Any, runner: Any, cpu: bool) -> str | None:
    """Why this worker's KV budget is not corrected, or None."""
    cache_config = getattr(worker, "cache_config", None)
    if getattr(cache_config, "kv_cache_memory_bytes", None):
        return ("kv_cache_memory_bytes is set (on the CPU build also by VLLM_CPU_KVCACHE_SPACE): the KV cache "
                "size is the user's, vLLM does not size it from profiling, and nothing is measured or moved")
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except Exception as exc:  # noqa: BLE001
        return f"the V1 model runner cannot be imported ({type(exc).__name__}: {exc})"
    if not isinstance(runner, GPUModelRunner):
        return (f"the worker runs {type(runner).__module__}.{type(runner).__name__} (Model Runner V2: vLLM's "
                "default on CUDA from 0.29.0; VLLM_USE_V2_MODEL_RUNNER=0 selects the V1 runner this patch "
                "measures), so the KV cache is sized from vLLM's profiled peak alone")
    if cpu and not hasattr(worker, "requested_cpu_memory"):
        return "the CPU worker has no requested_cpu_memory to read what it reserved"
    return None


_warned: set[str] = set()


def _not_corrected(reason: str) -> None:
    STATE.count("headroom_not_corrected")
    text = f"memory-headroom: KV cache NOT corrected: {reason}"
    with STATE.lock:
        STATE.patches.setdefault(PATCH_ID, {})["not_corrected"] = reason
        STATE.dirty = True
    STATE.event(text)
    if reason not in _warned:
        _warned.add(reason)
        LOG.warning(text)
    STATE.write()


def correct(worker: Any, available: int) -> int:
    """The KV budget after the correction (``available`` when nothing is measured or moved)."""
    runner = getattr(worker, "model_runner", None)
    meter = meter_for(worker)
    cpu = isinstance(meter, RssMeter)
    why = _why_not(worker, runner, cpu)
    if why:
        _not_corrected(why)
        return available
    with _lock:
        prof = _profiles.get(runner)
    if cpu:
        # the CPU worker subtracts the resident set after its warm-up (a profiling forward only
        # under torch.compile) from the memory it requested: that resident set is what it reserved
        reserved = int(worker.requested_cpu_memory) - available
        baseline = prof["baseline"] if prof else reserved
    elif prof is None:
        _not_corrected("vLLM's profiling forward (GPUModelRunner.profile_run) did not run in this worker "
                       "before the KV cache was sized, so there is no profiled peak to compare with")
        return available
    else:
        reserved, baseline = prof["peak"], prof["baseline"]
    tokens = int(runner.max_num_tokens)
    try:
        m = measure(runner, meter, tokens)
    except MeterUnavailable as exc:
        _not_corrected(f"{meter.name}: {exc}")
        return available
    except OverlayError:
        raise
    except Exception as exc:
        oom = type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc).lower()
        raise HeadroomError(
            f"vllm-overlay memory-headroom: the measuring forward of {tokens} tokens (max_num_batched_tokens) "
            f"failed before the KV cache was allocated: {type(exc).__name__}: {exc}"
            + ("; it does not fit even without a KV cache: lower max_num_batched_tokens" if oom else
               "; set VLLM_OVERLAY_MEMORY_HEADROOM=0 to boot without the measurement (unsafe: the KV cache "
               "is then sized from vLLM's profiling forward alone)")
        ) from exc
    if not m["shapes"]:
        _not_corrected(f"no forward of {tokens} tokens could be measured: {'; '.join(m['left_out'])}")
        return available
    p = headroom.plan(tokens=tokens, baseline=baseline, reserved=reserved, measured=m["measured"],
                      available_before=available, bytes_per_block=m["bytes_per_block"],
                      blocks_per_request=m["blocks_per_request"],
                      max_model_len=int(runner.model_config.max_model_len))
    record = {**p.to_json(), "meter": meter.name, "shapes": m["shapes"], "left_out": m["left_out"],
              "kv_temp_bytes": m["kv_temp_bytes"],
              "kv_temp_blocks": m["kv_temp_blocks"], "non_torch_growth": m["non_torch_growth"],
              "profile": prof, "profile_run_cap": int(settings.value("VLLM_OVERLAY_PROFILE_RUN_CAP"))}
    with STATE.lock:
        STATE.patches.setdefault(PATCH_ID, {}).setdefault("headroom", []).append(record)
        STATE.dirty = True
    cap = record["profile_run_cap"]
    line = (p.line() + f" ({meter.name}; forwards measured: {', '.join(s['name'] for s in m['shapes'])}"
            + (f"; vLLM profiled {cap} tokens: VLLM_OVERLAY_PROFILE_RUN_CAP" if 0 < cap < tokens and prof else "")
            + ")")
    STATE.event(line)
    (LOG.warning if p.moved else LOG.info)(line)
    STATE.write()
    if p.blocks_after < 1:
        raise HeadroomError(
            f"vllm-overlay memory-headroom: a forward of {tokens} tokens (max_num_batched_tokens) peaks "
            f"{p.moved / headroom.GIB:.3f} GiB above what vLLM's profiling reserved, and taking that from "
            f"the KV cache ({p.available_before / headroom.GIB:.3f} GiB) leaves no KV block "
            f"({p.bytes_per_block} bytes each); lower max_num_batched_tokens or raise "
            "gpu_memory_utilization (VLLM_OVERLAY_MEMORY_HEADROOM=0 boots anyway: unsafe, that forward "
            "then runs out of memory under traffic)")
    if p.moved:
        if hasattr(worker, "available_kv_cache_memory_bytes"):
            worker.available_kv_cache_memory_bytes = p.available_after
        if hasattr(worker, "peak_activation_memory"):  # vLLM's own --kv-cache-memory hint then counts it
            worker.peak_activation_memory += p.moved
    return p.available_after


# ---- the measurement ----------------------------------------------------------------------------


def _tensors(obj: Any) -> list[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return []


def _kv_facts(runner: Any) -> tuple[int, int, int]:
    """(bytes, blocks, blocks per request) of the KV cache the runner holds now. Bytes are the
    distinct allocations behind its KV tensors (hybrid groups share them); blocks per request
    come from vLLM's own concurrency (num_blocks / blocks per request of max_model_len), so the
    KV tokens reported are the ones vLLM prints."""
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    cfg = runner.kv_cache_config
    storages: dict[int, int] = {}
    for t in _tensors(runner.kv_caches):
        s = t.untyped_storage()
        storages[s.data_ptr()] = int(s.nbytes())
    concurrency = get_max_concurrency_for_kv_cache_config(runner.vllm_config, cfg)
    return sum(storages.values()), int(cfg.num_blocks), max(1, round(int(cfg.num_blocks) / concurrency))


def _init_temp_kv(runner: Any) -> None:
    """vLLM's minimal profiling KV cache. Its helper was written for CUDA graph profiling and reads
    max_cudagraph_capture_size, which the CPU build leaves None: 0 for the call (one block)."""
    from vllm.config import set_current_vllm_config

    cc = runner.compilation_config
    saved = cc.max_cudagraph_capture_size
    if saved is None:
        cc.max_cudagraph_capture_size = 0
    try:
        with set_current_vllm_config(runner.vllm_config):
            runner._init_minimal_kv_cache_for_profiling()
    finally:
        cc.max_cudagraph_capture_size = saved


def _drop_temp_kv(runner: Any, keys: dict[Any, set[Any]], keys_initialized: bool) -> None:
    """Undo _init_temp_kv as vLLM undoes it after CUDA graph profiling, and put the graph
    dispatcher's keys back as they were (the real initialize_kv_cache sets them again)."""
    dispatcher = runner.cudagraph_dispatcher
    for mode, key_set in dispatcher.cudagraph_keys.items():
        key_set.clear()
        key_set.update(keys.get(mode, ()))
    dispatcher.keys_initialized = keys_initialized
    runner.maybe_remove_all_loras(runner.lora_config)
    runner._cleanup_profiling_kv_cache()


def _forward(runner: Any, shape: headroom.Shape) -> None:
    """One eager dummy forward with attention metadata: ``shape.num_reqs`` prefills (vLLM's
    _dummy_run splits tokens over scheduler_config.max_num_seqs requests; set for the call).
    With speculative decoding the GDN metadata reads each request's draft count from the runner's
    num_decode_draft_tokens; -1 marks a request without drafts (a prefill), as the runner writes
    it for every real step; the previous contents are put back after the forward."""
    from vllm.config import CUDAGraphMode

    sched = runner.scheduler_config
    saved = sched.max_num_seqs
    drafts = getattr(runner, "num_decode_draft_tokens", None) if runner.speculative_config else None
    saved_drafts = drafts.np.copy() if drafts is not None else None
    sched.max_num_seqs = shape.num_reqs
    try:
        if drafts is not None:
            drafts.np.fill(-1)
            drafts.copy_to_gpu()
        out = runner._dummy_run(shape.tokens, cudagraph_runtime_mode=CUDAGraphMode.NONE, force_attention=True,
                                skip_eplb=True, profile_seq_lens=shape.seq_len)
    finally:
        sched.max_num_seqs = saved
        if drafts is not None:
            drafts.np[:] = saved_drafts
            drafts.copy_to_gpu()
    del out


def measure(runner: Any, meter: CudaMeter | RssMeter, tokens: int) -> dict[str, Any]:
    """The absolute peak of prefill-shaped forwards of ``tokens`` tokens (headroom.forward_shapes),
    without the temporary KV cache they ran on, plus any non-torch memory they left behind."""
    import torch

    dispatcher = runner.cudagraph_dispatcher
    keys = {mode: set(s) for mode, s in dispatcher.cudagraph_keys.items()}
    keys_initialized = dispatcher.keys_initialized
    meter.reset_peak()  # a meter that cannot measure here says so before any work
    meter.sync()
    non_torch_before = meter.non_torch()
    out: dict[str, Any] = {"shapes": []}
    with torch.inference_mode():
        try:
            _init_temp_kv(runner)
            kv_bytes, kv_blocks, per_request = _kv_facts(runner)
            shapes, out["left_out"] = headroom.forward_shapes(
                tokens, int(runner.scheduler_config.max_num_seqs), int(runner.model_config.max_model_len),
                kv_blocks)
            peak = 0
            for shape in shapes:
                meter.reset_peak()
                before = meter.current()
                _forward(runner, shape)
                meter.sync()
                p = meter.peak()
                peak = max(peak, p)
                out["shapes"].append({"name": shape.name, "num_reqs": shape.num_reqs, "seq_len": shape.seq_len,
                                      "before": before, "peak": p, "peak_without_kv": p - kv_bytes})
        finally:
            _drop_temp_kv(runner, keys, keys_initialized)
    meter.sync()
    growth = max(0, meter.non_torch() - non_torch_before)
    out.update(measured=peak - kv_bytes + growth, kv_temp_bytes=kv_bytes, kv_temp_blocks=kv_blocks,
               bytes_per_block=headroom.cdiv(kv_bytes, kv_blocks), blocks_per_request=per_request,
               non_torch_growth=growth)
    return out


def on_revert() -> None:
    with _lock:
        _profiles.clear()
    _warned.clear()
