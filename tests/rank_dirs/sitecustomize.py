"""Test-only: each vLLM worker process writes its overlay report into a folder of its own, as on
a host of its own (no shared filesystem). Put this folder on PYTHONPATH; every interpreter then
imports this module at start. A multiprocessing child named ``VllmWorker-N`` (vLLM's
MultiprocExecutor names its rank-N worker so) sets VLLM_OVERLAY_REPORT_DIR to ``DIR/rank-N``
before its target runs, so before vLLM loads the overlay's plugin there; with
OVERLAY_TEST_NO_PLUGIN_RANK=N, rank N also gets VLLM_PLUGINS=none (vLLM then loads no plugin
there: the overlay never registers in that worker). The parent processes are left as they are."""

import multiprocessing.process
import os

_bootstrap = multiprocessing.process.BaseProcess._bootstrap


def _per_rank(self, *args, **kwargs):  # type: ignore[no-untyped-def]
    name = self.name or ""
    if name.startswith("VllmWorker-") and os.environ.get("VLLM_OVERLAY_REPORT_DIR"):
        rank = name.rsplit("-", 1)[1]
        os.environ["VLLM_OVERLAY_REPORT_DIR"] = os.path.join(os.environ["VLLM_OVERLAY_REPORT_DIR"], f"rank-{rank}")
        if os.environ.pop("OVERLAY_TEST_NO_PLUGIN_RANK", None) == rank:
            os.environ["VLLM_PLUGINS"] = "none"
    return _bootstrap(self, *args, **kwargs)


multiprocessing.process.BaseProcess._bootstrap = _per_rank
