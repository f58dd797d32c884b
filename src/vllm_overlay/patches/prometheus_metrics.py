"""prometheus-metrics: the overlay's series on vLLM's own /metrics (see vllm_overlay.metrics)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from vllm_overlay import metrics
from vllm_overlay.mechanisms.wrap import Installed, wrap
from vllm_overlay.report import LOG
from vllm_overlay.spec import PatchSpec, Target

ROUTER_MODULE = "vllm.entrypoints.serve.instrumentator.metrics"
REGISTRY_MODULE = "vllm.v1.metrics.prometheus"
QUALNAME = "get_prometheus_registry"
MULTIPROC_MODULE = "prometheus_client.multiprocess"
MULTIPROC_INIT = "MultiProcessCollector.__init__"

SPEC = PatchSpec(
    id="prometheus-metrics",
    title="Overlay series (vllm_overlay_...) on vLLM's own /metrics",
    why=(
        "Operators watch vLLM through /metrics, not through JSON files. vLLM's API server builds "
        "the registry its /metrics serves with get_prometheus_registry(): the default registry, "
        "or, when PROMETHEUS_MULTIPROC_DIR is set (api-server-count > 1), a fresh registry with "
        "prometheus_client's MultiProcessCollector; in that mode the handler that answers "
        "/metrics (prometheus-fastapi-instrumentator's) builds such a registry for every request. "
        "This patch registers one more collector on the registry get_prometheus_registry() "
        "returns and on every registry a MultiProcessCollector is created for in the API server "
        "process (the patch applies only where vLLM builds its HTTP app). At each scrape it reads "
        "the reports of this server's engine and worker processes (forward-size histogram, "
        "largest forward, guard checks and trips, GDN buffer rows and bytes, each patch's status "
        "per process). No second HTTP server, no change to vLLM's own series."
    ),
    upstream="https://github.com/vllm-project/vllm/blob/v0.20.2/vllm/entrypoints/serve/instrumentator/metrics.py",
    targets=(Target(REGISTRY_MODULE, QUALNAME), Target(ROUTER_MODULE, QUALNAME),
             Target(MULTIPROC_MODULE, MULTIPROC_INIT)),
    mechanism="wrap",
    vllm=">=0.20.2,<=0.32.0",
    default=True,
    retire_when="vLLM lets plugins add collectors to the /metrics registry itself.",
    settings=("VLLM_OVERLAY_REPORT_DIR", "VLLM_OVERLAY_SERVER_ID"),
)


def MODULES(version: str) -> list[str]:  # noqa: N802 - part of the patch interface
    # the router module imports the registry module; it is imported only where vLLM builds its
    # HTTP app, so the patch stays armed in engine and worker processes (nothing to serve there)
    return [ROUTER_MODULE]


def _registry(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    registry = wrapped(*args, **kwargs)
    _attach(registry)
    return registry


def _attach(registry: Any) -> None:
    try:
        metrics.attach(registry)
    except Exception as exc:  # noqa: BLE001 - never break vLLM's own /metrics
        LOG.warning("prometheus-metrics: could not add the overlay's collector to %r: %s: %s",
                    registry, type(exc).__name__, exc)


def _multiproc_init(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    registry = kwargs.get("registry", args[0] if args else None)
    if registry is not None:
        _attach(registry)
    return result


def install(module_name: str, module: ModuleType) -> list[Installed]:
    # the router module holds its own reference (`from ... import get_prometheus_registry`):
    # wrap both, and do not report each as a copy that bypasses the other
    first = wrap(REGISTRY_MODULE, QUALNAME, _registry)
    second = wrap(ROUTER_MODULE, QUALNAME, _registry)
    covered = {f"{ROUTER_MODULE}.{QUALNAME}", f"{REGISTRY_MODULE}.{QUALNAME}"}
    for inst in (first, second):
        inst.cached_copies = tuple(c for c in inst.cached_copies if c not in covered)
    return [first, second, wrap(MULTIPROC_MODULE, MULTIPROC_INIT, _multiproc_init)]


def on_revert() -> None:
    metrics.detach_all()
