"""profile-run-cap: bound the token count of vLLM's memory-profiling forward, nothing else."""

from __future__ import annotations

import weakref
from typing import Any

from vllm_overlay import settings
from vllm_overlay.context import UNBOUND, PatchContext
from vllm_overlay.errors import OverlayError
from vllm_overlay.patches import _runner
from vllm_overlay.patches._runner import (
    RUNNER_CLASS,
    RUNNER_MODULES,
    V1_MODULE,
    V1_RELEASES,
    V2_MODULE,
    WORKER,
    WORKER_MODULE,
    dummy_tokens,
)
from vllm_overlay.report import LOG, STATE
from vllm_overlay.spec import PatchSpec, Proof, Support, Target, wraps

V1_DUMMY_RUN = Target(V1_MODULE, f"{RUNNER_CLASS}._dummy_run", V1_RELEASES,
                      params=("num_tokens", "is_profile", "skip_eplb", "remove_lora"))
V1_CAPTURE = Target(V1_MODULE, f"{RUNNER_CLASS}.capture_model", V1_RELEASES)
# Model Runner V2: _dummy_run takes remove_lora in **kwargs (and ignores it)
V2_DUMMY_RUN = Target(V2_MODULE, f"{RUNNER_CLASS}._dummy_run", params=("num_tokens", "is_profile", "skip_eplb"))
V2_CAPTURE = Target(V2_MODULE, f"{RUNNER_CLASS}.capture_model", "<0.30.0")
V2_CAPTURE_PROFILE_ONLY = Target(V2_MODULE, f"{RUNNER_CLASS}.capture_model", ">=0.30.0", params=("profile_only",))
WORKER_EXECUTE = Target(WORKER_MODULE, f"{WORKER}.execute_model", params=("scheduler_output",))

SPEC = PatchSpec(
    id="profile-run-cap",
    hooks=("on_revert", "bind"),
    title="Cap the memory-profiling dummy forward (never a buffer size)",
    why=(
        "vLLM profiles activation memory with one dummy forward of max_num_batched_tokens tokens. "
        "The reference patch tree capped it to survive a boot crash that its own undersized GDN "
        "buffer caused; with this overlay's buffer sizing that crash does not happen, so the cap "
        "is NOT needed for it. It remains useful only to shorten or shrink profiling on purpose. "
        "It caps the profiling forward alone: every buffer still follows the token-budget "
        "resolver, and before CUDA graph capture (after which vLLM locks its workspaces, e.g. the "
        "fused-MoE one) one un-profiled dummy forward of the full size sizes those workspaces for "
        "max_num_batched_tokens, not the cap (measured on the H200 with vLLM 0.20.2: without it the "
        "first forward above the cap dies with 'Workspace is locked but allocation from "
        "modular_kernel.py ... requires 16.00 MB, current size is 8.00 MB'). When it fires it says "
        "that activations above the cap were not profiled, so the KV cache may be sized larger than "
        "the largest forward leaves room for; that full-size forward then fails at boot, not later. "
        "On Model Runner V2 the same two hooks apply (its profile_run calls _dummy_run(is_profile=True)); "
        "its capture_model(profile_only=True), which only measures graph memory, gets no forward."
    ),
    upstream="https://github.com/vllm-project/vllm/blob/v0.20.2/vllm/v1/worker/gpu_model_runner.py (profile_run)",
    targets=(V1_DUMMY_RUN, V1_CAPTURE, V2_DUMMY_RUN, V2_CAPTURE, V2_CAPTURE_PROFILE_ONLY, WORKER_EXECUTE),
    mechanism="wrap",
    support=(
        Support("<0.30.0", "applies",
                "V1 runner: the profiling forward (_dummy_run(is_profile=True)) and capture_model exist "
                "with the parameters it uses. Model Runner V2: profile_run calls _dummy_run(max_num_tokens, "
                "is_profile=True), which it wraps the same way; capture_model() takes no argument and V2 "
                "does not lock the workspace after capture on these releases, so the full-size forward "
                "before capture only moves a failure to boot (0.29.0 calls capture_model() twice, first to "
                "measure graph memory: the forward runs before that first call)",
                (Proof("v1/worker/gpu/model_runner.py", "lock_workspace()", present=False),)),
        Support(">=0.30.0,<=0.33.0", "applies",
                "V1 runner as before. Model Runner V2: _dummy_run(is_profile=True) as before; "
                "capture_model(profile_only=True) measures graph memory during profiling and is passed "
                "through; the full-size forward runs before the real capture_model(), after which V2 "
                "locks the workspace",
                (Proof("v1/worker/gpu/model_runner.py", "lock_workspace()"),
                 Proof("v1/worker/gpu/cudagraph_utils.py", "capture_model(profile_only=True)"))),
        Support("==0.34.0", "applies",
                "Model Runner V2 only (V1 removed), the same two hooks as on 0.30.0-0.33.0. With the extensible "
                "KV cache (vLLM's default on CUDA) the capped profile forward sets only the activation reserve "
                "kept free during warm-up: vLLM then sizes the KV cache from real warm-up steps of "
                "max_num_batched_tokens tokens before capture, so the cap cannot leave the KV cache too large "
                "there; with the extensible KV cache off it works as on 0.33.0",
                (Proof("v1/worker/gpu/model_runner.py", "lock_workspace()"),
                 Proof("v1/worker/gpu/cudagraph_utils.py", "capture_model(profile_only=True)"),
                 Proof("v1/worker/gpu/model_runner.py", "hidden_states, sample_hidden_states = self._dummy_run(\n"
                                                        "            self.max_num_tokens,\n"),
                 Proof("v1/worker/gpu_worker.py", "run_kv_cache_sizing_warmup(\n"),
                 Proof("platforms/interface.py", "Model Runner V1 has been removed"))),
    ),
    default=False,
    enabled_by="VLLM_OVERLAY_PROFILE_RUN_CAP",
    retire_when="Never needed for the GDN crash; retire once no user sets the cap.",
    settings=("VLLM_OVERLAY_PROFILE_RUN_CAP", "VLLM_OVERLAY_STRICT"),
    either_modules=(RUNNER_MODULES,),
    # _dummy_run (and capture_model, Worker.execute_model): outermost, so that the patches inside
    # see the capped profiling forward that really runs (GDN's buffer check, telemetry's count) and
    # its full-size forward before capture passes through them too
    wraps_outside=("forward-telemetry", "gdn-output-prealloc"),
    beyond_matrix="never",
    beyond_matrix_why=("it changes what vLLM's memory profiling measures; on a release whose profiling changed, the "
                       "KV cache could be sized over memory that a forward needs"),
)


_capped: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # runner -> uncapped tokens


@wraps(V1_DUMMY_RUN, V2_DUMMY_RUN)
def _dummy_run(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    _runner.fired(SPEC.id, instance, "_dummy_run")
    if not kwargs.get("is_profile") or _runner.in_measurement():  # memory-headroom's forwards run whole
        return wrapped(*args, **kwargs)
    cap = int(settings.value("VLLM_OVERLAY_PROFILE_RUN_CAP"))
    n = dummy_tokens(args, kwargs)
    if cap <= 0 or n <= cap:
        return wrapped(*args, **kwargs)
    msg = (
        f"profile-run-cap: profiling forward capped from {n} to {cap} tokens "
        f"(VLLM_OVERLAY_PROFILE_RUN_CAP); activations of forwards in ({cap}, {n}] were NOT "
        "profiled and may not fit in the memory left after the KV cache"
        + ("; memory-headroom measures a forward of them before the KV cache is sized"
           if _headroom_live() else "")
    )
    LOG.warning(msg)
    STATE.event(msg)
    never = never_captures(instance)
    if never:
        _no_capture(n, cap, never)
    else:
        _capped[instance] = n
    if "num_tokens" in kwargs:
        kwargs = {**kwargs, "num_tokens": cap}
    else:
        args = (cap, *args[1:])
    return wrapped(*args, **kwargs)


_context: list[PatchContext] = [UNBOUND]  # what core binds before the first target is installed


def bind(context: PatchContext) -> None:
    _context[0] = context


def _headroom_live() -> bool:
    return "memory-headroom" in _context[0].applied_ids()


def never_captures(runner: Any) -> str | None:
    """Why vLLM will never call ``capture_model`` on this runner (so the full-size forward that
    runs before capture never runs), or None."""
    if any(k.__name__ == "CPUModelRunner" for k in type(runner).__mro__):
        return "the CPU worker never captures CUDA graphs"
    model_config = getattr(runner, "model_config", None)
    if model_config is not None and getattr(model_config, "enforce_eager", False):
        return "enforce_eager: vLLM never captures CUDA graphs"
    return None


_no_capture_warned = False


def _no_capture(n: int, cap: int, why: str) -> None:
    """The promised full-size forward cannot run: say so loudly once, count it every time."""
    global _no_capture_warned
    STATE.count("precapture_forward_skipped")
    if _no_capture_warned:
        return
    _no_capture_warned = True
    instead = (f"memory-headroom's measuring forward of {n} tokens, before the KV cache is sized, sizes "
               "them instead (unless its own line says it stood aside)" if _headroom_live() else
               f"the first forward above the cap ({cap}) sizes them under traffic instead")
    msg = (f"profile-run-cap: {why}, so the un-profiled forward of {n} tokens that sizes the "
           f"workspaces before capture will NOT run; {instead} (counter precapture_forward_skipped)")
    LOG.warning(msg)
    STATE.event(msg)


@wraps(V1_CAPTURE, V2_CAPTURE, V2_CAPTURE_PROFILE_ONLY)
def _capture_model(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    _runner.fired(SPEC.id, instance, "capture_model")
    if kwargs.get("profile_only"):  # Model Runner V2 0.30.0+: graph memory measured during profiling
        return wrapped(*args, **kwargs)
    n = _capped.pop(instance, None)
    if n:
        msg = (
            f"profile-run-cap: one un-profiled dummy forward of {n} tokens before CUDA graph capture, "
            "so that the workspaces vLLM locks after capture are sized for max_num_batched_tokens, "
            "not for the cap"
        )
        LOG.warning(msg)
        STATE.event(msg)
        try:
            instance._dummy_run(n, skip_eplb=True, remove_lora=False)
        except OverlayError:
            raise  # already one clear error naming its variable (e.g. a buffer below this forward)
        except Exception as exc:
            raise RuntimeError(_failure_text(n, exc)) from exc
    return wrapped(*args, **kwargs)


# no runner hook of the cap is on every forward's path: each must be the method the runner calls
_worker_execute_model = wraps(WORKER_EXECUTE)(_runner.first_forward_check(lambda: SPEC, {}))


def on_revert() -> None:
    _runner.on_revert(SPEC.id)
    _capped.clear()


def _failure_text(n: int, exc: BaseException) -> str:
    """Blame the cap only for what the cap can cause: memory the profile did not see."""
    cap = settings.value("VLLM_OVERLAY_PROFILE_RUN_CAP")
    head = (f"vllm-overlay profile-run-cap: the forward of {n} tokens (max_num_batched_tokens) that runs "
            f"before CUDA graph capture failed (VLLM_OVERLAY_PROFILE_RUN_CAP={cap}): {exc}.")
    if type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc).lower():
        return (f"{head} The cap left activations above {cap} tokens unprofiled and the KV cache took that "
                "memory; unset the cap or lower gpu_memory_utilization.")
    return (f"{head} This is the first forward of that size in this process, so any buffer sized below "
            f"{n} tokens fails here at boot instead of under traffic; the cap does not size buffers.")

