"""A report directory that cannot be written (a full filesystem, played by RLIMIT_FSIZE in an
overlay process without an engine: the kernel refuses writes past the limit with EFBIG, as a
full disk refuses them with ENOSPC, after the temporary file was created): one WARNING naming the
variable and the path, no temporary file left, backoff, and a /metrics series that says so."""

from __future__ import annotations

import json
import os
import subprocess

from conftest import PY, clean_env

SCRIPT = r"""
import json, resource, signal, sys, time
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))  # every report is larger
from prometheus_client import REGISTRY, generate_latest
from vllm_overlay import core, flush
from vllm_overlay.report import STATE
from vllm_overlay.telemetry import TELEMETRY
core.register()
for i in range(30):
    TELEMETRY.record(100 + i)
    flush()
time.sleep(2.5)  # the flusher runs too, backing off
text = generate_latest(REGISTRY).decode()
print(json.dumps({"failures": STATE.write_failures, "error": STATE.write_error,
                  "series": [l for l in text.splitlines() if l.startswith("vllm_overlay_report_write_failing")]}))
"""


def test_unwritable_report_dir_fails_loudly_once_and_leaves_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = tmp_path / "reports"
    d.mkdir()
    p = subprocess.run([PY, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                       env=clean_env(VLLM_OVERLAY_REPORT_DIR=str(d), PYTHONDONTWRITEBYTECODE="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.splitlines()[-1])
    assert res["failures"] >= 31 and "File too large" in res["error"][1]
    warnings = [ln for ln in p.stderr.splitlines() if "could not write the report" in ln]
    assert len(warnings) == 1, warnings
    assert f"VLLM_OVERLAY_REPORT_DIR={d}" in warnings[0] and f"to {d}/overlay-" in warnings[0]
    assert os.listdir(d) == [], os.listdir(d)  # no temporary file, no partial report
    (series,) = res["series"]
    assert series.endswith(" 1.0") and f'path="{d}/overlay-' in series


def test_a_patch_entry_without_a_decision_does_not_stop_the_report(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A patch's data recorded where the plugin did not decide that patch (decode-gemv's config lookup
    called directly, as its tests do) leaves the counts alone and the report written: every write of
    such a process once failed with KeyError 'status'."""
    code = """
import json, sys
from vllm_overlay import report
from vllm_overlay.report import STATE
report.patch_put("decode-gemv", "configs", "8x8", {"config": "cublas"})
STATE.set_patch("forward-telemetry", "applied")
path = STATE.write()
data = json.load(open(path))
print(json.dumps({"counts": STATE.counts(), "configs": data["patches"]["decode-gemv"]["configs"],
                  "error": STATE.write_error}))
"""
    env = clean_env()
    env["VLLM_OVERLAY_REPORT_DIR"] = str(tmp_path)
    res = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["counts"]["applied"] == 1 and sum(out["counts"].values()) == 1, out
    assert out["configs"] == {"8x8": {"config": "cublas"}} and out["error"] is None, out
    assert "KeyError" not in res.stderr, res.stderr
