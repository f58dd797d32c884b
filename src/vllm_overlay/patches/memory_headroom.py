"""memory-headroom: the memory vLLM leaves for activations covers a real forward of
max_num_batched_tokens tokens, measured before the KV cache is sized.

vLLM sizes the KV cache from the peak of one profiling forward. On hybrid models that peak is too
low: the profiling forward carries no attention metadata, so the Gated-DeltaNet layers only warm
their kernels and the full-attention layers return early; the chunked-prefill temporaries of a
real long prefill are never measured (upstream issues 52872 and 54775), and with
VLLM_OVERLAY_PROFILE_RUN_CAP the profiling forward is smaller than max_num_batched_tokens on purpose.

In each worker, after vLLM's determine_available_memory and before the KV cache exists, this patch
builds vLLM's own minimal profiling KV cache (the one it builds for CUDA graph memory profiling),
runs dummy forwards of max_num_batched_tokens tokens with real attention metadata (the longest
prefill and a short tail chunk at the context of max_model_len, vLLM's own split into max_num_seqs
prefills, and its mixed batch of max_num_seqs - 1 decodes and one prefill: context-sized attention
workspaces, per-request GDN states and chunks at their most),
measures their peak (allocator bytes on CUDA, resident set on the CPU build), drops that cache
exactly as vLLM does, and takes the shortfall against what profiling reserved from the KV cache
budget: one line and report fields (profiled peak, measured peak, memory moved, KV blocks and
tokens before and after). Once the real KV cache exists, a watch compares the runtime peak with
what was reserved (report field runtime; one WARNING if it is exceeded).
"""

from __future__ import annotations

import json
import os
import threading
import time
import weakref
from typing import Any

from vllm_overlay import headroom, report, settings
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
    Proof(RUNNER_PATH, "create_mixed_batch: bool = False,"),
    Proof(RUNNER_PATH, "num_decode_tokens = min(max_num_reqs - 1, num_tokens // 2)"),
    Proof(RUNNER_PATH, "max_num_reqs = self.scheduler_config.max_num_seqs"),
    Proof(RUNNER_PATH, "if force_attention or cudagraph_runtime_mode == CUDAGraphMode.FULL:"),
    Proof(RUNNER_PATH, "self.cudagraph_dispatcher.keys_initialized = False"),
    Proof(RUNNER_PATH, "self.kv_caches: list[torch.Tensor] = []"),
    Proof(RUNNER_PATH, "self.num_decode_draft_tokens.np[num_reqs:].fill(-1)"),
    Proof(RUNNER_PATH, "self.num_decode_draft_tokens.copy_to_gpu()"),
    Proof(RUNNER_PATH, "self.maybe_remove_all_loras(self.lora_config)"),
    Proof("v1/core/kv_cache_utils.py", "def get_max_concurrency_for_kv_cache_config("),
    Proof("v1/attention/backends/turboquant_attn.py", "_CONTINUATION_DECODE_THRESHOLD = 128"),
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
        Target(RUNNER_MODULE, f"{RUNNER}.initialize_kv_cache", wrapper="_initialize_kv_cache",
               params=("kv_cache_config", "is_profiling")),
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
    settings=("VLLM_OVERLAY_MEMORY_HEADROOM", "VLLM_OVERLAY_MEMORY_HEADROOM_DRY_RUN", "VLLM_OVERLAY_PROFILE_RUN_CAP",
              "VLLM_OVERLAY_REPORT_DIR"),
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
_corrections: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()  # runner -> budget
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
    report.patch_note(PATCH_ID, not_corrected=reason)
    STATE.event(text)
    if reason not in _warned:
        _warned.add(reason)
        LOG.warning(text)
    STATE.write()


def _is_oom(exc: BaseException) -> bool:
    return type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc).lower()


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
        oom = _is_oom(exc)
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
    dry = bool(settings.value("VLLM_OVERLAY_MEMORY_HEADROOM_DRY_RUN"))
    record = {**p.to_json(), "meter": meter.name, "shapes": m["shapes"], "left_out": m["left_out"],
              "kv_temp_bytes": m["kv_temp_bytes"], "left_allocated": m["left_allocated"],
              "kv_temp_blocks": m["kv_temp_blocks"], "non_torch_growth": m["non_torch_growth"],
              "profile": prof, "profile_run_cap": int(settings.value("VLLM_OVERLAY_PROFILE_RUN_CAP")),
              "dry_run": dry}
    report.patch_append(PATCH_ID, "headroom", record)
    with _lock:  # what the runtime watch compares with once the KV cache exists
        _corrections[runner] = {"baseline": baseline, "reserved": reserved, "moved": 0 if dry else p.moved,
                                "cpu": cpu}
    cap = record["profile_run_cap"]
    line = (p.line(dry_run=dry) + f" ({meter.name}; forwards measured: {', '.join(s['name'] for s in m['shapes'])}"
            + (f"; vLLM profiled {cap} tokens: VLLM_OVERLAY_PROFILE_RUN_CAP" if 0 < cap < tokens and prof else "")
            + (f"; left out: {'; '.join(m['left_out'])}" if m["left_out"] else "")
            + ")")
    STATE.event(line)
    (LOG.warning if p.moved or m["left_out"] else LOG.info)(line)
    STATE.write()
    if dry:
        return available
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


def _init_temp_kv(runner: Any, rows: int) -> None:
    """vLLM's minimal profiling KV cache (the one it builds to profile CUDA graph memory: one block
    per CUDA graph batch size). Its helper reads max_cudagraph_capture_size for the block count,
    set for the call where it must change: the CPU build leaves it None, and its C++ causal-conv
    kernel wants a conv-state row per request of the forward (``rows``: the most requests of a
    measured shape). On CUDA the Triton kernels index the state rows per request, and the dummy
    forwards' block-table rows are zero, so requests share block 0 of vLLM's own cache."""
    from vllm.config import set_current_vllm_config

    cc = runner.compilation_config
    saved = cc.max_cudagraph_capture_size
    cpu = getattr(getattr(runner, "device", None), "type", None) == "cpu"
    if cpu:
        cc.max_cudagraph_capture_size = max(saved or 0, rows)
    elif saved is None:
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
    """One eager dummy forward with attention metadata: ``shape.num_reqs`` requests as vLLM's
    _dummy_run splits ``shape.tokens`` over scheduler_config.max_num_seqs (set for the call), or its
    mixed batch (one-token decodes and one prefill), each request at ``shape.seq_len`` tokens of
    context (profile_seq_lens). With speculative decoding the GDN metadata reads each request's
    draft count from the runner's num_decode_draft_tokens; -1 marks a request without drafts, as
    the runner writes it for every real step, so the decodes of a mixed batch take the chunked
    path with the prefill, as requests without drafts do; the previous contents are put back."""
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
                                skip_eplb=True, create_mixed_batch=shape.mixed, profile_seq_lens=shape.seq_len)
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
    start = meter.current()
    out: dict[str, Any] = {"shapes": []}
    with torch.inference_mode():
        shapes, out["left_out"] = headroom.forward_shapes(
            tokens, int(runner.scheduler_config.max_num_seqs), int(runner.model_config.max_model_len))
        try:
            _init_temp_kv(runner, max((s.num_reqs for s in shapes), default=1))
            kv_bytes, kv_blocks, per_request = _kv_facts(runner)
            peak = 0
            for shape in shapes:
                meter.reset_peak()
                before = meter.current()
                try:
                    _forward(runner, shape)
                    meter.sync()
                except Exception as exc:
                    if _is_oom(exc) or isinstance(exc, OverlayError):  # the overlay's own guard speaks
                        raise
                    # a check in a kernel that refuses this shape (not a fault: the device is
                    # synchronised next, and a fault raises there): the others are measured, and
                    # the line names the one left out
                    meter.sync()
                    out["left_out"].append(f"{shape.name}: the forward failed ({type(exc).__name__}: "
                                           f"{str(exc)[:300]})")
                    continue
                p = meter.peak()
                peak = max(peak, p)
                out["shapes"].append({"name": shape.name, "num_reqs": shape.num_reqs, "seq_len": shape.seq_len,
                                      "mixed": shape.mixed, "before": before, "peak": p,
                                      "peak_without_kv": p - kv_bytes})
        finally:
            _drop_temp_kv(runner, keys, keys_initialized)
    meter.sync()
    growth = max(0, meter.non_torch() - non_torch_before)
    # what the forwards left allocated once the temporary cache is gone (e.g. attention workspaces a
    # layer keeps): in the measured peak; with a dry run it sits on top of vLLM's own sizing
    out.update(measured=peak - kv_bytes + growth, kv_temp_bytes=kv_bytes, kv_temp_blocks=kv_blocks,
               bytes_per_block=headroom.cdiv(kv_bytes, kv_blocks), blocks_per_request=per_request,
               non_torch_growth=growth, left_allocated=meter.current() - start)
    return out


# ---- after the KV cache exists: the runtime peak against what was reserved ---------------------

MARK_FILE = "memory-window.json"  # in VLLM_OVERLAY_REPORT_DIR: {"seq": N, "name": "..."} opens a window
WATCH_EVERY_S = 0.5
WINDOWS_KEPT = 64


class Watch:
    """The meter's peak from the moment the real KV cache exists (CUDA graph capture, warm-up and
    every step after it included), against the budget the correction left: vLLM's reserved peak
    plus what was moved out of the KV cache (nothing in a dry run). Read every WATCH_EVERY_S by a
    daemon thread (allocator statistics only: no device call, no per-step cost); the peak is never
    reset unless a harness writes VLLM_OVERLAY_REPORT_DIR/memory-window.json ({"seq": N, "name":
    "..."}, a new seq each time): then the window open until then is closed with its own peak, the
    peak statistic is reset and a window of that name opens (the harness waits until the report
    shows it). Report field ``patches.memory-headroom.runtime``; the first time the peak exceeds
    the budget, one WARNING (CUDA only: the CPU build's resident set counts more than tensors)."""

    def __init__(self, meter: Any, kv_bytes: int, baseline: int, budget: int, mark_path: str,
                 warn: bool) -> None:
        self.meter, self.kv_bytes, self.baseline, self.budget = meter, kv_bytes, baseline, budget
        self.mark_path, self.warn = mark_path, warn
        self.peak = 0
        self.window: dict[str, Any] | None = None
        self.mark_stat: tuple[int, int] | None = None
        self.warned = False
        self.stop = threading.Event()
        self.record: dict[str, Any] = {
            "kv_bytes": kv_bytes, "baseline": baseline, "budget": budget, "meter": meter.name,
            "mark_file": mark_path, "every_s": WATCH_EVERY_S, "started": time.time(), "windows": []}

    def numbers(self, peak: int) -> dict[str, int]:
        return headroom.runtime(peak=peak, kv_bytes=self.kv_bytes, baseline=self.baseline, budget=self.budget)

    def start(self) -> None:
        self.meter.reset_peak()
        self.peak = self.meter.current()
        self.publish()
        threading.Thread(target=self.loop, name="vllm-overlay-memory-watch", daemon=True).start()

    def loop(self) -> None:
        while not self.stop.wait(WATCH_EVERY_S):
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 - the watch must never disturb serving
                with STATE.lock:
                    self.record["error"] = f"{type(exc).__name__}: {exc}"[:300]
                self.publish()
                return

    def read_mark(self) -> tuple[int, str] | str | None:
        """The mark file's (seq, name) when it changed since the last read, an error text when it
        cannot be read as one, else None."""
        try:
            st = os.stat(self.mark_path)
        except OSError:
            return None
        key = (st.st_mtime_ns, st.st_size)
        if key == self.mark_stat:
            return None
        self.mark_stat = key
        try:
            with open(self.mark_path) as f:
                mark = json.load(f)
            return int(mark["seq"]), str(mark["name"])[:100]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return (f"{self.mark_path}: {type(exc).__name__}: {exc}; expected "
                    '{"seq": N, "name": "..."}')[:300]

    def tick(self) -> None:
        """One read: the peak since the last reset, and a new window if the mark file asks for one.
        The record is changed under the report's lock (the flusher serialises it meanwhile)."""
        now = time.time()
        p = self.meter.peak()
        mark = self.read_mark()
        with STATE.lock:
            changed = False
            if p > self.peak:
                self.peak, changed = p, True
                self.record["peak_at"] = now
            if self.window is not None and p > self.window["peak"]:
                self.window["peak"], changed = p, True
            if isinstance(mark, str):
                self.record["mark_error"], changed = mark, True
            elif mark is not None and (self.window is None or mark[0] != self.window["seq"]):
                if self.window is not None:
                    self.window["end"] = now
                self.meter.reset_peak()
                idle = self.meter.current()
                self.window = {"seq": mark[0], "name": mark[1], "start": now, "end": None, "idle": idle,
                               "peak": idle}
                self.record["windows"] = (self.record["windows"] + [self.window])[-WINDOWS_KEPT:]
                changed = True
            if changed:
                self.publish()

    def publish(self) -> None:
        with STATE.lock:
            self.record.update(self.numbers(self.peak))
            for w in self.record["windows"]:
                w.update(self.numbers(w["peak"]), above_idle=w["peak"] - w["idle"])
            report.patch_note(PATCH_ID, runtime=self.record)  # the watch changes it in place, under STATE.lock
        over = self.record["over_budget"]
        if self.warn and over > 0 and not self.warned:
            self.warned = True
            text = (f"memory-headroom: after the KV cache was allocated the allocator peaked "
                    f"{self.record['runtime_peak'] / headroom.GIB:.3f} GiB above the pre-profiling baseline "
                    f"(the KV cache left out), {over / headroom.GIB:.3f} GiB ({over} bytes) more than was "
                    f"reserved ({(self.budget - self.baseline) / headroom.GIB:.3f} GiB); the memory outside "
                    "gpu_memory_utilization absorbed it, or the next such step runs out of memory")
            STATE.event(text)
            LOG.warning(text)


_watches: weakref.WeakKeyDictionary[Any, Watch] = weakref.WeakKeyDictionary()  # runner -> its watch


def _initialize_kv_cache(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """After the real KV cache is allocated (not vLLM's temporary profiling one), start the watch
    of a runner whose KV budget was measured."""
    result = wrapped(*args, **kwargs)
    profiling = kwargs.get("is_profiling", args[1] if len(args) > 1 else False)
    if profiling:
        return result
    with _lock:
        c = _corrections.get(instance)
        old = _watches.pop(instance, None)
    if old is not None:
        old.stop.set()
    if c is None:
        return result
    try:
        kv_bytes = sum({t.untyped_storage().data_ptr(): int(t.untyped_storage().nbytes())
                        for t in _tensors(instance.kv_caches)}.values())
        w = Watch(_runner_meter(instance), kv_bytes, c["baseline"], c["reserved"] + c["moved"],
                  os.path.join(settings.value("VLLM_OVERLAY_REPORT_DIR"), MARK_FILE), warn=not c["cpu"])
        w.start()
    except Exception as exc:  # noqa: BLE001 - serving goes on without the watch, and says so
        text = f"memory-headroom: the runtime memory watch did not start ({type(exc).__name__}: {exc})"
        STATE.event(text)
        LOG.warning(text)
        return result
    with _lock:
        _watches[instance] = w
    return result


def on_revert() -> None:
    with _lock:
        _profiles.clear()
        _corrections.clear()
        for w in list(_watches.values()):
            w.stop.set()
        _watches.clear()
    _warned.clear()
