#!/usr/bin/env bash
# decode-gemv under its default (VLLM_OVERLAY_DECODE_GEMV=auto) on a GPU the shipped table does not
# cover, served against stock vLLM. First `vllm-overlay tune-gemv` (as the user runs it,
# docs/patches/decode-gemv.md) measures the table of this device and vLLM release into the cache
# (XDG_CACHE_HOME=OUT_DIR/cache, so the run reads no older table; vLLM's own cache stays in
# VLLM_CACHE_ROOT, default ~/.cache/vllm) and OUT_DIR/gemv-table.json. Then
# `bench/stack.py boot` starts stock vLLM (label stock, VLLM_OVERLAY=0) and the overlay with its defaults
# (label overlay: auto reads that cache) side by side on one GPU, STAGGER s apart, and `bench/pair.py`
# times their decode steps in alternation (A B, B A, ...: ratio_abba is the figure to quote); then
# `stack.py logprobs` on each in turn and `stack.py compare` of the two (greedy tokens and top-20
# logprobs against stock). Last, the overlay's worker report says whether decode-gemv acted
# (decode_gemv_calls) and where each shape's config came from; the servers are stopped.
#
#   bash bench/decode_gemv_auto.sh [OUT_DIR]
#
# Settings (environment): MODEL (a bench/models name or tiny; default qwen36-35b-a3b-slice8: the 35B
# geometry's shapes in 8 layers, so two servers fit one GPU), BUDGET (300: tune-gemv's --budget-s),
# TUNE (1; 0 skips tune-gemv: the overlay reads whatever table OUT_DIR/cache holds, none on a first run),
# STREAMS (1,16), CONTEXTS (2048), TOKENS (128), REPS (8: pairs per point), PROMPTS (8), LENGTHS
# (16,512,2048,4000: logprob prompt lengths), LP_TOKENS (16 greedy tokens a prompt), STAGGER (60), WAIT (900 s for
# a server to serve), PORT0 (8071; stock's, the overlay's PORT0+1), BOOT_EXTRA (stack.py boot's options,
# default "--kv auto --mtp 0 --max-capture 128 --max-num-seqs 512 --mem 0.05 --kv-bytes 2684354560": the
# side-by-side recipe of bench/README.md). A bad one stops it before anything runs, naming it.
# Writes OUT_DIR/tune-gemv.log, OUT_DIR/gemv-table.json, OUT_DIR/pair-stock-overlay.json, OUT_DIR/compare.json,
# OUT_DIR/acted.json (decode-gemv's counters and configs in the overlay's worker report) and the servers'
# state folders under OUT_DIR/stack. Exit 0 when the pair ran and decode-gemv acted; 1 otherwise.
set -u -o pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
out=${1:-${OUT:-/tmp/decode-gemv-auto}}
model=${MODEL:-qwen36-35b-a3b-slice8}
budget=${BUDGET:-300}
tune=${TUNE:-1}
streams=${STREAMS:-1,16}
contexts=${CONTEXTS:-2048}
tokens=${TOKENS:-128}
reps=${REPS:-8}
stagger=${STAGGER:-60}
prompts=${PROMPTS:-8}
lengths=${LENGTHS:-16,512,2048,4000}
lp_tokens=${LP_TOKENS:-16}
wait_s=${WAIT:-900}
port0=${PORT0:-8071}
boot_extra=${BOOT_EXTRA:---kv auto --mtp 0 --max-capture 128 --max-num-seqs 512 --mem 0.05 --kv-bytes 2684354560}
py=${PYTHON:-python3}

fail() { echo "decode_gemv_auto: $1 '$2': expected $3" >&2; exit 2; }
for v in BUDGET:$budget TOKENS:$tokens REPS:$reps WAIT:$wait_s PORT0:$port0 PROMPTS:$prompts LP_TOKENS:$lp_tokens; do
  [[ "${v#*:}" =~ ^[1-9][0-9]*$ ]] || fail "${v%%:*}" "${v#*:}" "a whole number > 0"
done
[[ "$stagger" =~ ^[0-9]+$ ]] || fail STAGGER "$stagger" "whole seconds >= 0"
[[ "$tune" == 0 || "$tune" == 1 ]] || fail TUNE "$tune" "0 or 1"
[[ "$streams" =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || fail STREAMS "$streams" "stream counts such as 1,16"
[[ "$contexts" =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || fail CONTEXTS "$contexts" "prompt lengths such as 2048"
[[ "$lengths" =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || fail LENGTHS "$lengths" "prompt lengths such as 16,512"
if [[ "$model" == tiny ]]; then
  config="$root/src/vllm_overlay/tools/models/tiny-hybrid"
elif [[ -f "$here/models/$model.json" ]]; then
  config="$here/models/$model.json"
else
  fail MODEL "$model" "a name of bench/models/*.json or tiny"
fi

mkdir -p "$out"
out=$(cd "$out" && pwd)
export STACK_STATE_DIR="$out/stack" OUT="$out"
# vLLM's own caches (compiled graphs, model info) stay where they are; the overlay's go under OUT_DIR/cache:
# tune-gemv writes the table there and the overlay server reads it there (stack.py passes the variables on)
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm}"
export XDG_CACHE_HOME="$out/cache"
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
t0=$SECONDS
say() { echo "decode_gemv_auto: $(date -u +%H:%M:%S) (+$((SECONDS - t0)) s) $*"; }

if [[ "$tune" == 1 ]]; then
  say "vllm-overlay tune-gemv --model $config --budget-s $budget --out $out/gemv-table.json"
  "$py" -m vllm_overlay tune-gemv --model "$config" --budget-s "$budget" --out "$out/gemv-table.json" \
    2>&1 | tee "$out/tune-gemv.log"
  rc=${PIPESTATUS[0]}
  case "$rc" in
    0) ;;
    3) say "tune-gemv's budget ended before some shapes ($out/tune-gemv.log): under auto they keep cuBLAS" ;;
    *) say "tune-gemv failed (exit $rc, $out/tune-gemv.log); no boot"; exit 1 ;;
  esac
fi

# shellcheck disable=SC2086 # BOOT_EXTRA is a list of options
boot() {  # $1 label, $2 config, $3 port
  say "boot $1 (config $2, port $3)"
  "$py" "$here/stack.py" boot "$1" --config "$2" --model "$model" $boot_extra --port "$3" >> "$out/boot-$1.log" 2>&1
}
rc=0
boot stock stock "$port0" || say "the boot of stock did not start ($out/boot-stock.log)"
sleep "$stagger"
boot overlay overlay "$((port0 + 1))" || say "the boot of overlay did not start ($out/boot-overlay.log)"
for l in stock overlay; do
  left=$(( wait_s - (SECONDS - t0) )); (( left < 60 )) && left=60
  if "$py" "$here/stack.py" wait "$l" --wait "$left" >> "$out/boot-$l.log" 2>&1; then
    say "$l serves"
  else
    say "$l does not serve ($out/boot-$l.log)"; rc=1
  fi
done
if [[ "$rc" == 0 ]]; then
  say "pair.py stock overlay (streams $streams, contexts $contexts, $tokens tokens, $reps pairs)"
  "$py" "$here/pair.py" stock overlay --streams "$streams" --contexts "$contexts" --tokens "$tokens" --reps "$reps" \
    --out "$out/pair-stock-overlay.json" 2>&1 | tee "$out/pair.log" || rc=1
  for l in stock overlay; do  # one at a time: greedy tokens and top-20 logprobs of fixed prompts
    say "logprobs of $l ($prompts prompts, lengths $lengths, $lp_tokens tokens)"
    "$py" "$here/stack.py" logprobs "$l" --prompts "$prompts" --lengths "$lengths" --max-tokens "$lp_tokens" \
      2>&1 | tee -a "$out/logprobs.log" || rc=1
  done
  "$py" "$here/stack.py" compare "$STACK_STATE_DIR/overlay/logprobs.json" "$STACK_STATE_DIR/stock/logprobs.json" \
    --out "$out/compare.json" 2>&1 | tee "$out/compare.log" || rc=1
fi
"$py" - "$STACK_STATE_DIR/overlay/reports" "$out/acted.json" <<'EOF' || rc=1
import json, sys
from vllm_overlay.reports import load

reports = [r for r in load(sys.argv[1]) if "worker" in r.get("role", "")]
patch = {}
counters = {}
for r in reports:
    patch.update((r.get("patches") or {}).get("decode-gemv") or {})
    for k, v in (r.get("counters") or {}).items():
        if k.startswith("decode_gemv"):
            counters[k] = counters.get(k, 0) + v
events = [e for r in reports for e in r.get("events", []) if "decode-gemv" in e]
acted = counters.get("decode_gemv_calls", 0) > 0
json.dump({"workers": len(reports), "acted": acted, "counters": counters, "configs": patch.get("configs"),
           "events": events}, open(sys.argv[2], "w"), indent=1)
print(f"decode-gemv {'ACTED' if acted else 'DID NOT ACT'} in {len(reports)} worker report(s): {counters}")
for key, c in sorted((patch.get("configs") or {}).items()):
    print(f"  {key}: {c.get('config')} from {c.get('source')}")
for e in events:
    print(f"  event: {e}")
sys.exit(0 if acted else 1)
EOF
for l in stock overlay; do "$py" "$here/stack.py" stop "$l" >> "$out/boot-$l.log" 2>&1; done
say "done, rc $rc; results in $out"
exit $rc
