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

The meters are in _memory_meters.py, the measuring forwards in _memory_measure.py, the runtime
watch in _memory_watch.py; this module holds the spec, the wrappers and the correction.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

from packaging.specifiers import SpecifierSet

from vllm_overlay import headroom, report, settings
from vllm_overlay.errors import OverlayError
from vllm_overlay.patches._memory_measure import is_oom, measure, tensors
from vllm_overlay.patches._memory_meters import MeterUnavailable, RssMeter, meter_for, runner_meter
from vllm_overlay.patches._memory_watch import MARK_FILE, Watch
from vllm_overlay.patches._runner import RUNNER, RUNNER_MODULE, RUNNER_MODULES, V1_RELEASES, V2_MODULE, kind
from vllm_overlay.report import LOG, STATE
from vllm_overlay.spec import PatchSpec, Proof, Support, Target, why_from, wraps

PATCH_ID = "memory-headroom"
WORKER_MODULE = "vllm.v1.worker.gpu_worker"
CPU_WORKER_MODULE = "vllm.v1.worker.cpu_worker"
RUNNER_PATH = "v1/worker/gpu_model_runner.py"
V2_PATH = "v1/worker/gpu/model_runner.py"
V2_UTILS_PATH = "v1/worker/gpu/cudagraph_utils.py"
V2_RELEASES = ">=0.32.0"  # Model Runner V2 measured: its _dummy_run gives GDN layers real metadata
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
    # the spec-decode sampler at the real draft count: the V1 runner's dummy sampler run gives its
    # rejection sampler one draft per request, positionally, and drops what it returns
    Proof(RUNNER_PATH, "draft_token_ids = [[0] for _ in range(num_reqs)]"),
    Proof(RUNNER_PATH, "dummy_spec_decode_metadata = SpecDecodeMetadata.make_dummy("),
    Proof(RUNNER_PATH, "            self.rejection_sampler(\n                dummy_spec_decode_metadata,\n"
                       "                draft_probs,\n                logits,\n"),
    Proof(RUNNER_PATH, "self.rejection_sampler = RejectionSampler("),
    Proof("v1/spec_decode/metadata.py", "num_draft_tokens: list[int]"),
    Proof("v1/spec_decode/metadata.py", "def make_dummy("),
)

# What the measurement calls on Model Runner V2 (vLLM 0.32.0+): vLLM's own profiling KV cache and
# its teardown, and a _dummy_run whose profiling forwards give GDN layers real metadata on
# distinct state slots, with cached context
_V2_PROOFS = (
    Proof(V2_UTILS_PATH, 'def _init_minimal_kv_cache_for_profiling(runner: "GPUModelRunner") -> None:'),
    Proof(V2_UTILS_PATH, 'def _teardown_profiling_state(runner: "GPUModelRunner") -> None:'),
    Proof(V2_UTILS_PATH, "min(runner.max_num_reqs, runner.compilation_config.max_cudagraph_capture_size)"),
    Proof(V2_UTILS_PATH, "runner.initialize_kv_cache(minimal_config, is_profiling=True)"),
    Proof(V2_UTILS_PATH, "runner.cudagraph_manager = None"),
    Proof(V2_PATH, "num_reqs = min(num_tokens, self.max_num_reqs)"),
    Proof(V2_PATH, "valid_dummy_state_slots: bool = False,"),
    Proof(V2_PATH, "if dummy_run and is_profile and not valid_dummy_state_slots:"),
    Proof(V2_PATH, "state_slots = torch.arange(\n                1, input_batch.num_reqs + 1,"),
    Proof(V2_PATH, "context_len: int = 0,"),
    Proof(V2_PATH, "need_eager=is_profile or skip_compiled,"),
    Proof(V2_PATH, "is_padding=not is_profile,"),
    Proof(V2_PATH, "hidden_states, sample_hidden_states = self._dummy_run(\n            self.max_num_tokens,\n"
                   "            skip_attn=True,\n            is_profile=True,"),
)
_V2_NO_STATE_SLOTS = Proof(V2_PATH, "if dummy_run and is_profile and not valid_dummy_state_slots:", present=False)

_TORCH_PEAK = Proof(WORKER_PATH, "profile_torch_peak = torch.accelerator.memory_stats(self.device).get(")
_TRANSIENT = Proof("utils/mem_utils.py", "result.transient_peak_headroom = (")
_V2_BY_ARCHITECTURE = Proof("config/vllm.py", "def _is_default_v2_model_runner_model")

AVAILABLE = Target(WORKER_MODULE, "Worker.determine_available_memory", platform="cuda")
CPU_AVAILABLE = Target(CPU_WORKER_MODULE, "CPUWorker.determine_available_memory", platform="cpu")
V1_PROFILE_RUN = Target(RUNNER_MODULE, f"{RUNNER}.profile_run", V1_RELEASES)
V1_INIT_KV_CACHE = Target(RUNNER_MODULE, f"{RUNNER}.initialize_kv_cache", V1_RELEASES,
                          params=("kv_cache_config", "is_profiling"))
# Model Runner V2 (its CPU build's class inherits these)
V2_PROFILE_RUN = Target(V2_MODULE, f"{RUNNER}.profile_run", V2_RELEASES)
V2_INIT_KV_CACHE = Target(V2_MODULE, f"{RUNNER}.initialize_kv_cache", V2_RELEASES,
                          params=("kv_cache_config", "is_profiling"))

SPEC = PatchSpec(
    id=PATCH_ID,
    hooks=("on_revert",),
    idle_by=("headroom_not_corrected",),  # applied, but it measured and moved nothing in that process
    title="Activation memory measured at max_num_batched_tokens, taken from the KV cache before it is sized",
    why=why_from(__doc__),
    upstream="https://github.com/vllm-project/vllm/issues/52872 (fix PR 52935 open), "
             "https://github.com/vllm-project/vllm/issues/54775",
    targets=(AVAILABLE, CPU_AVAILABLE, V1_PROFILE_RUN, V1_INIT_KV_CACHE, V2_PROFILE_RUN, V2_INIT_KV_CACHE),
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
        Support(">=0.29.0,<=0.31.0", "applies",
                "as 0.27.0, but vLLM runs Model Runner V2 by default on CUDA for every model, and V2's "
                "profiling forwards of these releases give GDN layers no metadata (is_profile drops the "
                "Mamba groups; valid_dummy_state_slots does not exist or does not override it): under V2 "
                "the patch measures nothing and says so in one WARNING unless VLLM_USE_V2_MODEL_RUNNER=0; "
                "the CPU build (no Triton) runs the V1 runner",
                (Proof("config/vllm.py", "def _is_default_v2_model_runner_model", present=False),
                 _V2_NO_STATE_SLOTS, _TRANSIENT, *_RUNNER_PROOFS)),
        Support(">=0.32.0,<=0.33.0", "applies",
                "as 0.29.0 on the V1 runner; on Model Runner V2 (vLLM's default on CUDA) the same correction: "
                "profile_run recorded, vLLM's own V2 profiling KV cache (_init_minimal_kv_cache_for_profiling) "
                "and teardown (_teardown_profiling_state), dummy forwards _dummy_run(is_profile=True, "
                "valid_dummy_state_slots=True, context_len) that give GDN layers real metadata (no mixed "
                "batch: V2 has none; the split one request short of max_num_seqs: V2's state slots start at "
                "1); V2's profiling runs no rejection sampler, so the spec-decode sampler is not measured "
                "there (the line says so). Model Runner V2 does not run on the CPU build (it needs Triton): "
                "the V2 path is checked in source and driven with vLLM's V2 classes and stand-in bodies only",
                (Proof("config/vllm.py", "def _is_default_v2_model_runner_model", present=False),
                 _TRANSIENT, *_RUNNER_PROOFS, *_V2_PROOFS)),
        Support("==0.34.0", "applies",
                "Model Runner V2 only (V1 removed). vLLM's extensible KV cache, its default on CUDA from 0.34.0 "
                "(unless kv_cache_memory_bytes is set), sizes the cache after warm-up steps of real "
                "execute_model at max_num_batched_tokens and keeps their measured peak plus max(1 GiB, 0.75 x "
                "peak) free: profiling no longer sizes it, so there the patch measures and moves nothing and "
                "says so once (headroom_not_corrected). With the extensible KV cache off "
                "(--no-enable-extensible-kv-cache) vLLM sizes the cache from profiling as on 0.33.0 and the V2 "
                "correction of 0.32.0-0.33.0 applies",
                (Proof("config/cache.py", "enable_extensible_kv_cache: bool = Field(default=None)"),
                 Proof(WORKER_PATH, "run_kv_cache_sizing_warmup(\n"),
                 Proof(WORKER_PATH, "if self.cache_config.enable_extensible_kv_cache:\n"
                                    "            kv_cache = self.model_runner.extensible_kv_cache"),
                 Proof("platforms/interface.py", "Model Runner V1 has been removed"),
                 _TRANSIENT, *_V2_PROOFS)),
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
    either_modules=(RUNNER_MODULES,),
    v2_releases=V2_RELEASES,
    beyond_matrix="carry",
    beyond_matrix_why=("it only takes memory from the KV cache, never adds any, so a misfit costs KV capacity (said "
                       "in its report line), not memory safety; its proofs pin the profiling internals it measures"),
)


class HeadroomError(OverlayError, RuntimeError):
    """The measured forward leaves no memory for the KV cache, or could not run."""


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


@wraps(V1_PROFILE_RUN, V2_PROFILE_RUN)
def _profile_run(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Record the bytes in use when vLLM's profiling forward starts and its peak when it returns
    (vLLM resets the peak just before; CUDA reads the same allocator statistic vLLM reads)."""
    try:
        meter = runner_meter(instance)
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


@wraps(AVAILABLE, CPU_AVAILABLE)
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
    if getattr(cache_config, "enable_extensible_kv_cache", None):
        return ("vLLM's extensible KV cache is on (vLLM 0.34.0's default on CUDA): vLLM sizes the KV cache after "
                "warm-up steps of max_num_batched_tokens tokens, keeping their measured peak plus a margin free, "
                "not from profiling; nothing is measured or moved (--no-enable-extensible-kv-cache gives "
                "profiling-based sizing back, which this patch corrects)")
    k = kind(runner)
    name = f"{type(runner).__module__}.{type(runner).__name__}"
    if k is None:
        return f"the worker runs {name}, neither vLLM's V1 model runner nor Model Runner V2"
    version = STATE.vllm_version or ""
    if k == "V2" and not (version and SpecifierSet(V2_RELEASES).contains(version)):
        return (f"the worker runs {name} (Model Runner V2) on vLLM {version or '(unknown)'}, whose V2 profiling "
                f"forwards give GDN layers no metadata (the patch measures V2 on vLLM {V2_RELEASES}); "
                "VLLM_USE_V2_MODEL_RUNNER=0 selects the V1 runner this patch measures, else the KV cache is "
                "sized from vLLM's profiled peak alone")
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
        _not_corrected(f"vLLM's profiling forward ({kind(runner)} GPUModelRunner.profile_run) did not run in this worker "
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
        oom = is_oom(exc)
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


_watches: weakref.WeakKeyDictionary[Any, Watch] = weakref.WeakKeyDictionary()  # runner -> its watch


@wraps(V1_INIT_KV_CACHE, V2_INIT_KV_CACHE)
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
                        for t in tensors(instance.kv_caches)}.values())
        w = Watch(runner_meter(instance), kv_bytes, c["baseline"], c["reserved"] + c["moved"],
                  os.path.join(settings.value("VLLM_OVERLAY_REPORT_DIR"), MARK_FILE), warn=not c["cpu"],
                  patch_id=PATCH_ID)
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
