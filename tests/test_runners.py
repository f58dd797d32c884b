"""The runner patches on both of vLLM's model runners: V1 and Model Runner V2.

Model Runner V2 cannot run on this CPU build: vLLM 0.32.0 (CPU) refuses it at config time
("Model Runner V2 requires Triton.": its Triton has no CPU backend, so ``HAS_TRITON`` is False),
and its input preparation is Triton kernels. Its classes import fine, though. So these tests
register the overlay against the installed vLLM, take the REAL classes
(``vllm.v1.worker.gpu.model_runner.GPUModelRunner``, the CPU build's V2
``vllm.v1.worker.cpu.model_runner.CPUModelRunner``, ``vllm.v1.worker.gpu_worker.Worker``) with the
overlay's wrappers on them, and replace only the method BODIES below the overlay's wrappers (the
parts that need CUDA, Triton or a loaded model) with stand-ins that call the runner's own methods
in the order vLLM 0.32.0's V2 code does (worker.execute_model -> runner.execute_model ->
prepare_inputs; profile_run -> _dummy_run(is_profile=True); capture_model). The engine tests
(test_engine.py, test_compiled.py) cover the V1 runner on a real engine.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_overlay import budget, core
from vllm_overlay.errors import CapacityError, StrictModeError
from vllm_overlay.mechanisms import wrap
from vllm_overlay.patches import _runner
from vllm_overlay.patches import gdn_output_prealloc as gdn
from vllm_overlay.report import STATE

V2_CPU_MODULE = "vllm.v1.worker.cpu.model_runner"
MODULES = ("vllm.config.vllm", _runner.V1_MODULE, _runner.V2_MODULE, V2_CPU_MODULE, _runner.WORKER_MODULE,
           "vllm.v1.core.sched.scheduler", gdn.MOD_032)
RUNNER_PATCHES = ("forward-telemetry", "gdn-output-prealloc", "profile-run-cap")


@pytest.fixture
def overlay(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("VLLM_OVERLAY_REPORT_DIR", str(tmp_path / "reports"))
    monkeypatch.setenv("VLLM_OVERLAY_PROFILE_RUN_CAP", "512")
    for m in MODULES:  # imported first, so the hooks install at register(), inside the test
        importlib.import_module(m)
    core.revert()
    STATE.reset()
    gdn.on_revert()
    core.register()
    yield
    core.revert()
    STATE.reset()


def classes() -> tuple[type, type, type, type]:
    v1 = importlib.import_module(_runner.V1_MODULE).GPUModelRunner
    v2 = importlib.import_module(_runner.V2_MODULE).GPUModelRunner
    v2_cpu = importlib.import_module(V2_CPU_MODULE).CPUModelRunner
    worker = importlib.import_module(_runner.WORKER_MODULE).Worker
    return v1, v2, v2_cpu, worker


def innermost(cls: type, name: str) -> Any:
    """The overlay wrapper nearest to vLLM's own function for ``cls.name``."""
    obj = next(vars(k)[name] for k in cls.__mro__ if name in vars(k))
    ours = [o for o in wrap.wrapper_chain(obj) if wrap.mark_of(o)]
    assert ours, f"{cls.__name__}.{name} carries no overlay wrapper"
    return ours[-1]


@contextlib.contextmanager
def bodies(cls: type, **stand_ins: Any) -> Iterator[None]:
    """Replace vLLM's bodies of ``cls``'s methods under the overlay's wrappers (restored after)."""
    saved = []
    for name, fn in stand_ins.items():
        inner = innermost(cls, name)
        saved.append((inner, inner.__wrapped__))
        inner.__wrapped__ = fn
    try:
        yield
    finally:
        for inner, original in saved:
            inner.__wrapped__ = original


class Config:
    """The fields of a VllmConfig the overlay's runner wrappers read (weak-referenceable, like it)."""

    def __init__(self, mnbt: int, capture: list[int]) -> None:
        self.scheduler_config = SimpleNamespace(max_num_batched_tokens=mnbt, max_num_seqs=32)
        self.model_config = SimpleNamespace(max_model_len=32768, model="tiny", enforce_eager=False,
                                            dtype=torch.float32)
        self.compilation_config = SimpleNamespace(cudagraph_mode=1 if capture else 0, cudagraph_capture_sizes=capture)
        self.speculative_config = None


def config(mnbt: int = 8192, capture: list[int] | None = None) -> Any:
    return Config(mnbt, capture or [])


def v2_bodies(calls: list[Any]) -> dict[str, Any]:
    """Stand-ins for V2's method bodies, calling what vLLM 0.32.0's V2 code calls."""

    def init(self, vllm_config, device):  # type: ignore[no-untyped-def]
        self.vllm_config = vllm_config
        self.scheduler_config, self.model_config = vllm_config.scheduler_config, vllm_config.model_config
        self.compilation_config = vllm_config.compilation_config
        self.speculative_config = None
        self.max_num_tokens = vllm_config.scheduler_config.max_num_batched_tokens

    def dummy_run(self, num_tokens, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(("dummy", num_tokens, bool(kwargs.get("is_profile"))))
        sched = SimpleNamespace(total_num_scheduled_tokens=num_tokens, num_scheduled_tokens={"_dummy_req_0": num_tokens})
        self.execute_model(sched, None, dummy_run=True, is_profile=kwargs.get("is_profile", False))
        return None, None

    def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False, **kwargs):  # type: ignore[no-untyped-def]
        if not dummy_run and scheduler_output.total_num_scheduled_tokens:
            n = scheduler_output.total_num_scheduled_tokens
            batch_desc = SimpleNamespace(cg_mode=0, num_tokens=getattr(scheduler_output, "padded", n), num_reqs=None)
            self.prepare_inputs(scheduler_output, SimpleNamespace(num_tokens=n), batch_desc, 0)
        calls.append(("execute", scheduler_output.total_num_scheduled_tokens, dummy_run))

    def prepare_inputs(self, scheduler_output, batch_req_state, batch_desc, num_active_loras=0):  # type: ignore[no-untyped-def]
        calls.append(("prepare", batch_desc.num_tokens))

    def capture_model(self, *, profile_only=False):  # type: ignore[no-untyped-def]
        calls.append(("capture", profile_only))
        return 0

    return {"__init__": init, "_dummy_run": dummy_run, "execute_model": execute_model,
            "prepare_inputs": prepare_inputs, "capture_model": capture_model}


class Layer:
    """A GDN layer's geometry (a real one needs a model): the buffer the guard protects."""

    num_v_heads, tp_size, head_v_dim = 2, 1, 4


def worker_body(self, scheduler_output):  # type: ignore[no-untyped-def]
    return self.model_runner.execute_model(scheduler_output)


def step(n: int, warmup: bool = False, padded: int | None = None) -> Any:
    ids = {f"_warmup_{i}_" if warmup else f"req-{i}": 1 for i in range(2)}
    return SimpleNamespace(total_num_scheduled_tokens=n, num_scheduled_tokens=ids, padded=padded or n)


def worker_for(runner: Any) -> Any:
    w = object.__new__(classes()[3])
    w.model_runner = runner
    return w


def test_both_runners_carry_every_runner_patch(overlay) -> None:  # type: ignore[no-untyped-def]
    v1, v2, v2_cpu, worker = classes()
    assert {p: STATE.patches[p]["status"] for p in RUNNER_PATCHES} == dict.fromkeys(RUNNER_PATCHES, "applied")

    def m(cls: type, name: str) -> list[str]:
        return wrap.marks(next(vars(k)[name] for k in cls.__mro__ if name in vars(k)))

    assert m(v1, "_dummy_run") == m(v2, "_dummy_run") == ["profile-run-cap", "gdn-output-prealloc", "forward-telemetry"]
    assert m(v2_cpu, "_dummy_run") == m(v2, "_dummy_run")  # the CPU build's V2 runner inherits them
    assert m(v2, "execute_model") == ["forward-telemetry"] and m(v2, "prepare_inputs") == ["gdn-output-prealloc"]
    assert sorted(m(v2, "capture_model")) == ["gdn-output-prealloc", "profile-run-cap"]
    assert m(v1, "_model_forward") == ["gdn-output-prealloc"]
    assert sorted(m(worker, "execute_model")) == sorted(RUNNER_PATCHES)
    assert _runner.kind(object.__new__(v2_cpu)) == "V2" and _runner.kind(object.__new__(v1)) == "V1"


def test_v2_boot_and_serve_go_through_guard_telemetry_and_cap(overlay, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    _, v2, _, _ = classes()
    calls: list[Any] = []
    cfg = config(capture=[1, 2, 4, 512])
    monkeypatch.setattr(budget, "current_vllm_config", lambda: cfg)
    monkeypatch.setenv("VLLM_OVERLAY_PREALLOC_TOKEN_BUDGET", "8192")
    with bodies(v2, **v2_bodies(calls)), bodies(classes()[3], execute_model=worker_body), \
            caplog.at_level(logging.WARNING, logger="vllm_overlay"):
        runner = v2(cfg, "cuda:0")
        layer = Layer()
        gdn._attach(layer)  # a GDN layer built for this engine
        runner._dummy_run(8192, skip_attn=True, is_profile=True)  # profile_run's forward
        runner.capture_model(profile_only=True)  # 0.30.0+: graph memory measured while profiling
        runner.capture_model()  # the real capture
        w = worker_for(runner)
        w.execute_model(step(6, warmup=True))  # V2's start-up warm-up
        w.execute_model(step(5000))
        w.execute_model(step(7000))
    # the profiling forward was capped; the full-size forward ran before the real capture only
    assert calls[:3] == [("dummy", 512, True), ("execute", 512, True), ("capture", True)]
    assert calls[3:6] == [("dummy", 8192, False), ("execute", 8192, True), ("capture", False)]
    assert _runner.RUNNER_REPORT.to_json() == {"kind": "V2", "class": "vllm.v1.worker.gpu.model_runner.GPUModelRunner"}
    rep = STATE.to_json()
    fw = rep["telemetry"]["forwards"]
    assert fw["count"] == 2 and fw["sizes"] == {"5000": 1, "7000": 1}  # warm-up is not a served forward
    assert rep["counters"]["warmup_forwards"] == 1 and rep["telemetry"]["profile_forward_tokens"] == [512]
    # guard: profile 512, capture's largest graph 512 (twice), the full-size 8192, warm-up, 2 forwards
    assert rep["counters"]["guard_checks"] == 7 and rep["counters"]["guard_trips"] == 0
    for p in RUNNER_PATCHES:
        assert rep["patches"][p]["runner"]["kind"] == "V2" and rep["patches"][p]["runner"]["missing"] == [], p
    assert not [m for m in caplog.messages if "did not fire" in m]
    assert "runner_hooks_not_fired" not in rep["counters"]


def test_v2_guard_trips_on_the_padded_forward_and_on_capture(overlay, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    _, v2, _, _ = classes()
    calls: list[Any] = []
    cfg = config(capture=[1, 2, 4, 512])
    monkeypatch.setattr(budget, "current_vllm_config", lambda: cfg)
    monkeypatch.setenv("VLLM_OVERLAY_TEST_BUFFER_ROWS", "256")
    monkeypatch.delenv("VLLM_OVERLAY_PROFILE_RUN_CAP")
    with bodies(v2, **v2_bodies(calls)), bodies(classes()[3], execute_model=worker_body):
        runner = v2(cfg, "cuda:0")
        layer = Layer()
        gdn._attach(layer)
        with pytest.raises(CapacityError, match="a CUDA graph capture of 512 tokens exceeds the GDN output buffer of 256 rows"):
            runner.capture_model()
        # 250 scheduled tokens padded to a 260-token batch: the padded count is what the layer slices
        with pytest.raises(CapacityError, match="a forward of 260 tokens exceeds"):
            worker_for(runner).execute_model(step(250, padded=260))
    assert ("capture", False) not in calls and ("prepare", 260) not in calls  # refused before vLLM's code


def test_v1_runner_is_named_v1(overlay) -> None:  # type: ignore[no-untyped-def]
    v1 = classes()[0]
    runner = object.__new__(v1)
    _runner.fired("forward-telemetry", runner, "execute_model")
    assert _runner.RUNNER_REPORT.to_json() == {"kind": "V1", "class": "vllm.v1.worker.gpu_model_runner.GPUModelRunner"}


def test_a_hook_that_did_not_fire_is_a_loud_warning(overlay, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """V2's execute_model body skipping prepare_inputs stands for a release whose forward path
    bypasses the method the guard wraps: the guard checked nothing, and says so."""
    _, v2, _, _ = classes()
    calls: list[Any] = []
    stand_ins = v2_bodies(calls)
    stand_ins["execute_model"] = lambda self, scheduler_output, *a, **k: calls.append("execute")
    cfg = config()
    with bodies(v2, **stand_ins), bodies(classes()[3], execute_model=worker_body), \
            caplog.at_level(logging.WARNING, logger="vllm_overlay"):
        runner = v2(cfg, "cuda:0")
        worker_for(runner).execute_model(step(100))
        worker_for(runner).execute_model(step(100))  # checked once per runner
    (line,) = [m for m in caplog.messages if "did not fire" in m]
    assert line.startswith("gdn-output-prealloc: armed, but on the model runner this worker built (V2: "
                           "vllm.v1.worker.gpu.model_runner.GPUModelRunner)") and "prepare_inputs (not fired)" in line
    assert STATE.counters["runner_hooks_not_fired"] == 1
    assert STATE.patches["gdn-output-prealloc"]["runner"]["missing"] == ["prepare_inputs (not fired)"]


def test_an_unknown_runner_is_refused_under_strict(overlay, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A worker whose runner is neither V1 nor V2 (say a plugin's own): no runner hook can fire."""
    monkeypatch.setenv("VLLM_OVERLAY_STRICT", "1")

    class OtherRunner:
        def execute_model(self, scheduler_output: Any) -> str:
            return "out"

    refusal = r"refuses to serve: .*OtherRunner is neither vLLM's V1 model runner nor Model Runner V2"
    with bodies(classes()[3], execute_model=worker_body), pytest.raises(StrictModeError, match=refusal):
        worker_for(OtherRunner()).execute_model(step(10))


def test_overridden_method_is_named(overlay, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """A runner subclass that overrides a hooked method (without calling it) bypasses the wrapper."""
    _, v2, _, _ = classes()
    calls: list[Any] = []
    sub = type("PluginRunner", (v2,), {"capture_model": lambda self, **k: 0})
    with bodies(v2, **v2_bodies(calls)), bodies(classes()[3], execute_model=worker_body), \
            caplog.at_level(logging.WARNING, logger="vllm_overlay"):
        runner = sub(config(), "cuda:0")
        worker_for(runner).execute_model(step(10))
    lines = [m for m in caplog.messages if "did not fire" in m]
    assert len(lines) == 2 and all("capture_model (not the method PluginRunner calls)" in m for m in lines)
    assert {m.split(":")[0] for m in lines} == {"gdn-output-prealloc", "profile-run-cap"}


WARMUP_IDS = ("_warmup_0_", "_v2_mixed_warmup_prefill_0_", "_v2_mixed_warmup_decode_", "_context_warmup_1_")


@pytest.mark.parametrize("ids,warmup", [
    (WARMUP_IDS[:1], True),
    (WARMUP_IDS[1:3], True),  # vLLM 0.34.0's mixed prefill + decode step (also the KV cache sizing steps)
    (WARMUP_IDS[3:], True),
    (WARMUP_IDS, True),
    ((*WARMUP_IDS, "cmpl-abc-0"), False),  # one real request: traffic
    (("cmpl-abc-0",), False),
    ((), False),  # nothing scheduled (e.g. a warm-up's clean-up step): not a warm-up forward
])
def test_warmup_steps_of_every_prefix(ids: tuple[str, ...], warmup: bool) -> None:
    """The request ids Model Runner V2's warm-up steps use (vllm/v1/worker/gpu/warmup.py, 0.34.0), in any
    mix, make a warm-up step; one ordinary request id, or none, does not (scheduler outputs are stand-ins
    with the one field read)."""
    sched = SimpleNamespace(num_scheduled_tokens=dict.fromkeys(ids, 1))
    assert _runner.is_warmup(sched) is warmup
    assert _runner.is_warmup(SimpleNamespace()) is False
