"""prometheus-metrics: the overlay's series on vLLM's own /metrics (see vllm_overlay.metrics)."""

from __future__ import annotations

from typing import Any

from vllm_overlay import metrics
from vllm_overlay.logs import LOG
from vllm_overlay.spec import PatchSpec, Proof, Support, Target, wraps

TRIGGER = "prometheus_client"  # imported by every vLLM process, so the patch never stays armed
MULTIPROC_MODULE = "prometheus_client.multiprocess"
MULTIPROC_INIT = "multiprocess.MultiProcessCollector.__init__"  # from TRIGGER; prepare() imports it
VLLM_USES = "from prometheus_client import REGISTRY, CollectorRegistry, multiprocess"

COLLECTOR_INIT = Target(TRIGGER, MULTIPROC_INIT)

SPEC = PatchSpec(
    id="prometheus-metrics",
    hooks=("prepare", "on_revert"),
    title="Overlay series (vllm_overlay_...) on vLLM's own /metrics",
    why=(
        "Operators watch vLLM through /metrics, not through JSON files. vLLM's API server serves "
        "prometheus_client's default registry, or, when PROMETHEUS_MULTIPROC_DIR is set "
        "(api-server-count > 1), a registry built around prometheus_client's "
        "MultiProcessCollector (vLLM's get_prometheus_registry(); the handler that answers "
        "/metrics, prometheus-fastapi-instrumentator's, builds one for every request). This patch "
        "registers one collector on the default registry and on every registry a "
        "MultiProcessCollector is created for. At each scrape it reads the reports of this "
        "server's engine and worker processes (forward-size histogram, largest forward, guard "
        "checks and trips, GDN buffer rows and bytes, each patch's status per process). No second "
        "HTTP server, no change to vLLM's own series; in engine and worker processes the "
        "collector is registered but never scraped."
    ),
    upstream="https://github.com/vllm-project/vllm/blob/v0.20.2/vllm/v1/metrics/prometheus.py",
    # Not a vLLM module: prometheus_client, which vLLM's /metrics serves through. prepare() adds the
    # collector to the default REGISTRY (on_revert() takes it off); the wrap adds it to every
    # registry a MultiProcessCollector is built for.
    targets=(COLLECTOR_INIT,),
    mechanism="wrap",
    support=(
        Support(">=0.20.0,<=0.34.0", "applies",
                "vLLM serves /metrics from prometheus_client (default REGISTRY, or a "
                "MultiProcessCollector registry with PROMETHEUS_MULTIPROC_DIR); the wrapped "
                "MultiProcessCollector.__init__ is prometheus_client's, not vLLM's",
                (Proof("v1/metrics/prometheus.py", VLLM_USES),)),
    ),
    default=True,
    retire_when="vLLM lets plugins add collectors to the /metrics registry itself.",
    settings=("VLLM_OVERLAY_REPORT_DIR", "VLLM_OVERLAY_SERVER_ID"),
    beyond_matrix="carry",
    beyond_matrix_why=("it only adds the overlay's series to the /metrics registry; nothing vLLM computes changes"),
)


def _attach(registry: Any) -> None:
    try:
        metrics.attach(registry)
    except Exception as exc:  # noqa: BLE001 - never break vLLM's own /metrics
        LOG.warning("prometheus-metrics: could not add the overlay's collector to %r: %s: %s",
                    registry, type(exc).__name__, exc)


@wraps(COLLECTOR_INIT)
def _multiproc_init(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    registry = kwargs.get("registry", args[0] if args else None)
    if registry is not None:
        _attach(registry)
    return result


def prepare(module_name: str) -> None:
    """On the import of prometheus_client: import the submodule the wrapped target lives in and
    add the collector to the default REGISTRY (taken off again by on_revert())."""
    import importlib

    importlib.import_module(MULTIPROC_MODULE)
    metrics.attach(importlib.import_module(TRIGGER).REGISTRY)


def on_revert() -> None:
    metrics.detach_all()
