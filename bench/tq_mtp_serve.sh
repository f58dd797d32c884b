#!/usr/bin/env bash
# TurboQuant k8v4 + MTP (3 speculative tokens) on the Qwen3.6-35B-A3B geometry through `vllm serve`
# with vllm-overlay, default CUDA graphs (vLLM 0.20.2 on one H200), then the band stress.
#
#   OUT=/some/dir bench/tq_mtp_serve.sh [TOTAL_SECONDS (default 480)]
#
# Run from the project root with vLLM 0.20.2 importable or staged in /tmp/site (bench/gpu/README.md); this
# working tree's src/ goes first on PYTHONPATH. Writes under $OUT, whatever happens:
#   serve.log            the server's log (stdout + stderr)
#   metrics-before.txt   /metrics spec-decode and request lines after boot, metrics-after.txt after the stress
#   stress/stress.json   `python3 -m vllm_overlay stress` result (band forwards, failed requests)
#   stress.log, reports/ the overlay's per-process reports (verify batches counted as
#                        tq_verify_as_decode_batches), summary.json (what passed, read from the rest)
# The whole run stays under TOTAL_SECONDS: the stress gets what the boot left, less a margin.
set -u
total=${1:-480}
start=$SECONDS
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:?set OUT to a results directory}
mkdir -p "$out/reports" "$out/stress"
export PYTHONPATH="$root/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_OVERLAY_REPORT_DIR="$out/reports"
export VLLM_OVERLAY_PROFILE_RUN_CAP=4096
export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}
port=${PORT:-8011}
url="http://127.0.0.1:$port"

# one fixed model folder: vLLM's compile cache is keyed by its path (warm boots reuse it)
model=/tmp/vllm-overlay-model-qwen36-35b-a3b-geometry-mtp
mkdir -p "$model"
python3 - "$root/bench/models/qwen36-35b-a3b-geometry.json" "$model/config.json" <<'EOF'
import json, sys
cfg = json.load(open(sys.argv[1]))
cfg["num_nextn_predict_layers"] = 1  # one MTP layer: qwen3_next_mtp drafts from it
json.dump(cfg, open(sys.argv[2], "w"), indent=1)
EOF

summary() {
  python3 - "$out" "$((SECONDS - start))" "$1" <<'EOF'
import glob, json, os, re, sys
out, elapsed, phase = sys.argv[1], int(sys.argv[2]), sys.argv[3]
s = {"phase_reached": phase, "elapsed_s": elapsed}
def metrics(name):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        return None
    vals = {}
    for line in open(path):
        m = re.match(r"^(vllm:spec_decode_[a-z_]+(?:_total)?)(\{[^}]*\})? ([0-9.e+-]+)$", line.strip())
        if m and "per_pos" not in m.group(1) and not m.group(1).endswith("_created"):
            vals[m.group(1)] = vals.get(m.group(1), 0.0) + float(m.group(3))
    return vals
s["spec_decode_before"], s["spec_decode_after"] = metrics("metrics-before.txt"), metrics("metrics-after.txt")
log = os.path.join(out, "serve.log")
if os.path.exists(log):
    text = open(log, errors="replace").read()
    s["overlay_lines"] = [l[-300:] for l in text.splitlines() if "turboquant-spec-decode" in l or "hybrid-turboquant:" in l][:12]
    s["errors"] = [l[-400:] for l in text.splitlines() if re.search(r"Error|Traceback|CUDA graph capture", l)][:20]
    for pat, key in ((r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+)", "init_engine_s"),
                     (r"KV cache size: ([0-9,]+) tokens", "kv_cache_tokens")):
        m = re.search(pat, text)
        if m:
            s[key] = float(m.group(1).replace(",", ""))
counters, events = {}, []
for path in glob.glob(os.path.join(out, "reports", "overlay-*.json")):
    try:
        r = json.load(open(path))
    except Exception:
        continue
    for k, v in r.get("counters", {}).items():
        counters[k] = counters.get(k, 0) + v
    events += [e for e in r.get("events", []) if "turboquant-spec-decode" in e]
    st = r.get("patches", {}).get("turboquant-spec-decode")
    if st:
        s.setdefault("patch_status", {})[r.get("role", "?")] = st.get("status")
s["overlay_counters"] = counters
s["overlay_events"] = events[:10]
sp = os.path.join(out, "stress", "stress.json")
if os.path.exists(sp):
    st = json.load(open(sp))
    s["stress"] = {k: st.get(k) for k in ("verdict", "why", "band_forwards", "min_band_forwards", "forwards",
                                         "requests_ok", "requests_failed", "max_forward", "wall_s", "tokens_per_s")}
b, a = s.get("spec_decode_before") or {}, s.get("spec_decode_after") or {}
drafts = [k for k in a if k.startswith("vllm:spec_decode_num_drafts")]
s["verify_steps_during_stress"] = (a[drafts[0]] - b.get(drafts[0], 0.0)) if drafts else None
json.dump(s, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(json.dumps(s, indent=1)[:4000])
EOF
}

# no curl assumed on the GPU image: plain Python for HTTP
http_ok() { python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)" "$1" >/dev/null 2>&1; }
scrape_metrics() {
  python3 - "$url/metrics" "$1" <<'EOF'
import re, sys, urllib.request
try:
    text = urllib.request.urlopen(sys.argv[1], timeout=20).read().decode()
except Exception as exc:
    text = f"# scrape failed: {exc}\n"
keep = [l for l in text.splitlines() if l.startswith("# scrape failed") or re.match(r"^vllm:(spec_decode|request_success|num_requests)", l)]
open(sys.argv[2], "w").write("\n".join(keep) + "\n")
EOF
}

server_pid=
cleanup() {
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
    kill -TERM -- "-$server_pid" 2>/dev/null || kill -TERM "$server_pid" 2>/dev/null
    sleep 5
    kill -KILL -- "-$server_pid" 2>/dev/null
  fi
}
trap cleanup EXIT

echo "tq_mtp_serve: $(date -u +%FT%TZ) booting vllm serve (turboquant_k8v4, MTP 3) on port $port"
setsid python3 -m vllm.entrypoints.cli.main serve "$model" \
  --load-format dummy --skip-tokenizer-init \
  --additional-config '{"gdn_prefill_backend":"triton"}' \
  --kv-cache-dtype turboquant_k8v4 \
  --speculative-config '{"method":"qwen3_next_mtp","num_speculative_tokens":3}' \
  --max-num-batched-tokens 8192 --max-model-len 262144 --gpu-memory-utilization 0.82 \
  --port "$port" >"$out/serve.log" 2>&1 &
server_pid=$!

phase=boot
while :; do
  if ! kill -0 "$server_pid" 2>/dev/null; then
    echo "tq_mtp_serve: the server exited during boot"; phase=boot-died; break
  fi
  if http_ok "$url/health"; then phase=healthy; break; fi
  if [ $((SECONDS - start)) -gt $((total - 90)) ]; then
    echo "tq_mtp_serve: not healthy after $((SECONDS - start)) s"; phase=boot-timeout; break
  fi
  sleep 3
done
echo "tq_mtp_serve: $phase after $((SECONDS - start)) s"
if [ "$phase" != healthy ]; then
  tail -n 60 "$out/serve.log"
  summary "$phase"
  exit 1
fi

scrape_metrics "$out/metrics-before.txt"
left=$((total - (SECONDS - start) - 45))
[ $left -gt 20 ] || left=20
echo "tq_mtp_serve: stress for at most $left s"
timeout $((left + 30)) python3 -m vllm_overlay stress --url "$url" --report-dir "$out/reports" \
  --out "$out/stress" --min-band-forwards 1000 --duration "$left" >"$out/stress.log" 2>&1
rc=$?
echo "tq_mtp_serve: stress exit $rc"
tail -n 25 "$out/stress.log"
scrape_metrics "$out/metrics-after.txt"
summary "stress-exit-$rc"
exit $rc
