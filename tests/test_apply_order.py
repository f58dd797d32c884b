"""Apply and revert complete in the production import order: vLLM imports the model runner
before the GDN layer module, so gdn-output-prealloc wraps the runner at register() and rewrites
the layer later, from a post-import hook. Here the rewrite has drifted (a wrong recorded hash):
the patch must fail with no wrapper of it left anywhere (profile-run-cap is on, so another
patch's wrapper sits over its _dummy_run wrapper), revert() must take everything off, and
register() must work again. A fresh process, because pytest's own process has imported the
layer module already."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import clean_env

SCRIPT = r'''
import dataclasses, importlib, json, sys
import vllm.v1.worker.gpu_model_runner as runner_mod
from vllm_overlay import core
from vllm_overlay.mechanisms import wrap as w
from vllm_overlay.patches import gdn_output_prealloc as gdn
from vllm_overlay.report import STATE

R = runner_mod.GPUModelRunner
def marks():
    return {n: w.marks(vars(R)[n]) for n in ("_dummy_run", "_model_forward", "execute_model")}

out = {"layer_imported_first": gdn.MOD_032 in sys.modules}
stock = {n: vars(R)[n] for n in ("_dummy_run", "_model_forward", "execute_model")}
gdn.SPEC = dataclasses.replace(gdn.SPEC, rewrites=tuple(dataclasses.replace(rw, sha256="0" * 64) for rw in gdn.SPEC.rewrites))
core.register()
out["armed"] = STATE.patches["gdn-output-prealloc"]["status"]
out["marks_armed"] = marks()
importlib.import_module(gdn.MOD_032)  # vLLM builds the model: the layer module arrives now
rec = STATE.patches["gdn-output-prealloc"]
out["status"] = rec["status"]
out["reason"] = rec["reason"]
out["undo_errors"] = rec.get("undo_errors")
out["marks_failed"] = marks()
out["dummy_run_works"] = True
out["revert_problems"] = core.revert()
out["restored"] = all(vars(R)[n] is stock[n] for n in stock)
out["registered_after_revert"] = STATE.registered
gdn.SPEC = dataclasses.replace(gdn.SPEC, rewrites=tuple(dataclasses.replace(rw, sha256="0" * 64) for rw in gdn.SPEC.rewrites))
core.register()
out["reregistered"] = STATE.registered
out["marks_again"] = marks()
out["revert_problems_again"] = core.revert()
out["restored_again"] = all(vars(R)[n] is stock[n] for n in stock)
print("RESULT " + json.dumps(out))
'''


def test_drifted_rewrite_in_production_import_order_leaves_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = clean_env(VLLM_OVERLAY_REPORT_DIR=str(tmp_path), VLLM_OVERLAY_PROFILE_RUN_CAP="512",
                    PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(os.path.dirname(
                        os.path.abspath(__file__))), "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = json.loads(line[len("RESULT "):])
    assert out["layer_imported_first"] is False
    assert out["armed"] == "armed"
    # at register() the runner carries all three runner patches (gdn under profile-run-cap)
    assert out["marks_armed"]["_dummy_run"] == ["profile-run-cap", "gdn-output-prealloc", "forward-telemetry"]
    assert out["status"] == "failed" and "pristine source hash mismatch" in out["reason"]
    assert out["undo_errors"] == []
    # no wrapper of the failed patch remains; the others are intact
    assert out["marks_failed"] == {"_dummy_run": ["profile-run-cap", "forward-telemetry"],
                                   "_model_forward": [], "execute_model": ["forward-telemetry"]}
    assert out["revert_problems"] == [] and out["restored"] is True
    assert out["registered_after_revert"] is False
    assert out["reregistered"] is True
    # the layer module is imported now, so the drifted rewrite fails before the runner is wrapped
    assert out["marks_again"]["_dummy_run"] == ["profile-run-cap", "forward-telemetry"]
    assert out["revert_problems_again"] == [] and out["restored_again"] is True
