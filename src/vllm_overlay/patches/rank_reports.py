"""rank-reports: the engine core gathers every worker rank's report through vLLM's executor.

Each worker writes its report into its own VLLM_OVERLAY_REPORT_DIR, which on a multi-host
deployment (Ray) is a folder on that worker's host, out of the API server's reach. The engine core
asks every rank for its report over the channel vLLM already has to its workers,
``Executor.collective_rpc`` (multiprocessing: vLLM's shared-memory message queues; Ray: actor
calls), and keeps the answers in its own report under ``ranks``, which the /metrics collector and
``vllm-overlay report`` read beside the files. A rank that does not answer, or answers that the
overlay is not there, is listed in ``ranks.missing`` with its rank and why.

When: after EngineCore.__init__ (the executor is up: each rank's patches, buffers and runner are
known) and after a step, at most once a second while the engine steps, plus once after the step
that leaves no request unfinished (its last forwards). The call is made by the engine core's own busy-loop
thread between two steps, the thread that calls ``execute_model``, so it never interleaves with
one on the executor's queues (vLLM's MultiprocExecutor orders it after every pending
non-blocking call). On a worker the function reads that process's report under its lock and
touches nothing else; under Ray compiled graphs, where ``execute_model`` runs on the compiled
graph's thread of the actor, the lock is all it shares with it.

The function is shipped by value (its ``__module__`` is ``__main__``, so cloudpickle serialises its
code): it runs on a rank where vllm_overlay is not installed and says so instead of failing the
call for every rank.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import weakref
from typing import Any

from vllm_overlay import report
from vllm_overlay.report import LOG, STATE
from vllm_overlay.spec import PatchSpec, Proof, Support, Target, wraps

MODULE = "vllm.v1.engine.core"
CORE = "EngineCore"
WORKER_BASE_MODULE = "vllm.v1.worker.worker_base"  # imported by every worker process (and the engine core)
WRAPPER = "WorkerWrapperBase"
# after the plugin loaded there (WorkerWrapperBase.__init__ runs before vLLM loads plugins in a worker)
WRAPPER_METHOD = "initialize_from_config"
GATHER_EVERY_S = 1.0  # while the engine steps: one round trip to the ranks per second at most
GATHER_TIMEOUT_S = 10.0

CORE_INIT = Target(MODULE, f"{CORE}.__init__")
STEP = Target(MODULE, f"{CORE}.step")
STEP_WITH_BATCH_QUEUE = Target(MODULE, f"{CORE}.step_with_batch_queue")
# in a worker (which never imports the engine core's module): the executor rank it answers for
WORKER_READY = Target(WORKER_BASE_MODULE, f"{WRAPPER}.{WRAPPER_METHOD}", params=("kv_cache_configs",))

SPEC = PatchSpec(
    id="rank-reports",
    title="Every worker rank's report gathered by the engine core (no shared report directory needed)",
    why=(
        "The /metrics collector and `vllm-overlay report` read report files. On one host the "
        "workers write them into the API server's directory; on several hosts (vLLM's Ray "
        "executor) each worker's directory is on its own host, so the API server saw no worker: "
        "no forwards, guard checks, buffers or patch statuses, and nothing said a rank was "
        "missing. This patch has the engine core ask each rank for its report through vLLM's "
        "own executor channel (collective_rpc: shared-memory queues with multiprocessing, actor "
        "calls with Ray), between two steps, at most once a second while it steps, and keeps "
        "them in its own report; a rank that does not answer, or has no overlay, is listed as "
        "missing with its rank and why."
    ),
    upstream="https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/executor/abstract.py",
    targets=(CORE_INIT, STEP, STEP_WITH_BATCH_QUEUE, WORKER_READY),
    mechanism="wrap",
    support=(
        Support(">=0.20.0,<=0.34.0", "applies",
                "EngineCore.__init__ builds model_executor, whose collective_rpc(method, timeout, ...) "
                "runs a callable on every worker and returns one answer per rank; the busy loop "
                "calls step or step_with_batch_queue; each worker's WorkerWrapperBase (its "
                "rpc_rank set in __init__) gets initialize_from_config(kv_cache_configs) from the "
                "executor once the KV cache is sized",
                (Proof("v1/engine/core.py", "self.model_executor = executor_class(vllm_config)"),
                 Proof("v1/engine/core.py", "def step_with_batch_queue("),
                 Proof("v1/worker/worker_base.py", "self.rpc_rank: int = rpc_rank"),
                 Proof("v1/worker/worker_base.py", "def initialize_from_config(self, kv_cache_configs"),)),
    ),
    default=True,
    retire_when="vLLM carries plugin state from its workers to the API server itself (a plugin "
                "metrics or stats channel from worker to frontend).",
    settings=("VLLM_OVERLAY_REPORT_DIR",),
    either_modules=((MODULE, WORKER_BASE_MODULE),),
    beyond_matrix="carry",
    beyond_matrix_why=("it only gathers the workers' overlay reports through vLLM's collective_rpc between steps; "
                       "nothing vLLM computes changes"),
)

# ---- the worker side --------------------------------------------------------------------------

_PROBE_SOURCE = '''
def overlay_rank_report(worker):
    import os, socket
    rank = getattr(worker, "rpc_rank", None)
    if rank is None:
        rank = getattr(getattr(worker, "worker", None), "rank", None)
    try:
        from vllm_overlay.patches import rank_reports
    except Exception as exc:
        return {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(),
                "why": "vllm_overlay cannot be imported there (%s: %s): install it on that host"
                       % (type(exc).__name__, exc)}
    return rank_reports.answer(rank)
'''


def probe() -> Any:
    """The function collective_rpc runs on each rank, made in a ``__main__`` namespace so that
    cloudpickle ships its code: it needs nothing of the overlay to run."""
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(_PROBE_SOURCE, "<vllm-overlay rank probe>", "exec"), namespace)  # noqa: S102 - our own source
    return namespace["overlay_rank_report"]


def answer(rank: int | None) -> dict[str, Any]:
    """This rank's report, or why there is none (the plugin did not register in this process)."""
    if not STATE.registered:
        return {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(),
                "why": "the overlay is installed but did not register in this process (vLLM did not "
                       "load its plugin 'overlay' here: VLLM_PLUGINS, or register() raised; that "
                       "process's log says which)"}
    return {"rank": rank, "report": STATE.to_json()}


@wraps(WORKER_READY)
def _wrapper_ready(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Note the executor rank (rpc_rank) of each worker wrapper of this process once vLLM hands it
    its KV-cache config: the rank this report answers the engine core's gather for."""
    from vllm_overlay.report import patch_append

    result = wrapped(*args, **kwargs)
    rank = getattr(instance, "rpc_rank", None)
    patch_append(SPEC.id, "rpc_ranks", rank if isinstance(rank, int) else None)
    return result


# ---- the engine core side -----------------------------------------------------------------------


class Ranks(report.Section):
    """The engine core's report's ``ranks``: the reports its worker ranks sent at the last gather,
    the ranks that sent none, and whether a step ran since (left out until a gather ran)."""

    def reset(self) -> None:
        self.ranks: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any] | None:
        return self.ranks

    def gathered(self, world_size: int, reports: list[dict[str, Any]], missing: list[dict[str, Any]]) -> None:
        with self.changing():
            self.ranks = {"world_size": world_size, "gathered": time.time(), "stepped_since": False,
                          "reports": reports, "missing": missing}

    def stepped(self) -> None:
        """A step ran since the last gather: the gathered reports are as of the gather, not of now
        (written within a second, once per gather)."""
        if self.ranks is not None and not self.ranks["stepped_since"]:
            with self.changing():
                self.ranks["stepped_since"] = True  # gathers and steps run on one thread: none since the test


RANKS = report.section("ranks", Ranks)


class _Gather:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.last = 0.0  # time.monotonic() of the last gather


_cores: weakref.WeakKeyDictionary[Any, _Gather] = weakref.WeakKeyDictionary()
_cores_lock = threading.Lock()


def _state_of(core: Any) -> _Gather:
    with _cores_lock:
        g = _cores.get(core)
        if g is None:
            g = _cores[core] = _Gather()
        return g


def world_size(core: Any) -> int:
    pc = getattr(getattr(core, "vllm_config", None), "parallel_config", None)
    return int(getattr(pc, "world_size", 1) or 1)


def gather(core: Any) -> None:
    """Ask every rank of ``core``'s executor for its report; keep them (and the missing ranks)."""
    g = _state_of(core)
    if not g.lock.acquire(blocking=False):
        return  # another gather of this engine is under way
    try:
        expected = world_size(core)
        g.last = time.monotonic()
        executor = getattr(core, "model_executor", None)
        reports: list[dict[str, Any]] = []
        missing: dict[int, str] = {}
        error = None
        try:
            if executor is None:
                raise RuntimeError("the engine core has no model_executor")
            answers = executor.collective_rpc(probe(), timeout=GATHER_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - never break the engine for telemetry
            answers, error = [], f"no answer to the engine core's gather ({type(exc).__name__}: {exc})"
        for i, ans in enumerate(answers if isinstance(answers, list) else []):
            rank = ans.get("rank") if isinstance(ans, dict) and isinstance(ans.get("rank"), int) else i
            if isinstance(ans, dict) and isinstance(ans.get("report"), dict):
                rep = ans["report"]
                if rep.get("instance") != STATE.instance:  # the in-process worker: this very report
                    reports.append(rep)
            else:
                where = f" (host {ans.get('host')}, pid {ans.get('pid')})" if isinstance(ans, dict) else ""
                missing[rank] = (ans.get("why") if isinstance(ans, dict) else None) or \
                    f"answered {type(ans).__name__}, not a report"
                missing[rank] += where
        answered = {(a.get("rank") if isinstance(a, dict) and isinstance(a.get("rank"), int) else i)
                    for i, a in enumerate(answers if isinstance(answers, list) else [])}
        for rank in range(expected):
            if rank not in answered:
                missing[rank] = error or "no answer from this rank to the engine core's gather"
        RANKS.gathered(expected, reports, [{"rank": r, "why": w} for r, w in sorted(missing.items())])
        if missing:
            _warn_missing(missing)
    finally:
        g.lock.release()


_warned: dict[int, str] = {}


def _warn_missing(missing: dict[int, str]) -> None:
    """One WARNING per rank and reason."""
    new = {r: w for r, w in missing.items() if _warned.get(r) != w}
    if new:
        _warned.update(new)
        LOG.warning("rank-reports: %d rank(s) of this engine sent no overlay report: %s (/metrics: "
                    "vllm_overlay_rank_missing_info)", len(new),
                    "; ".join(f"rank {r}: {w}" for r, w in sorted(new.items())))


@wraps(CORE_INIT)
def _init(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    gather(instance)
    return result


@wraps(STEP, STEP_WITH_BATCH_QUEUE)
def _step(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    g = _state_of(instance)
    RANKS.stepped()
    try:  # no request left unfinished: this step ran the last forwards before the engine idles
        idle = instance.scheduler.get_num_unfinished_requests() == 0
    except Exception:  # noqa: BLE001 - a scheduler without the count: gather on the timer only
        idle = False
    if idle or time.monotonic() - g.last >= GATHER_EVERY_S:
        gather(instance)
    return result
