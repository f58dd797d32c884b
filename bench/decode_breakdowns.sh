#!/usr/bin/env bash
# Decode-step breakdowns of several models from one GPU: one stock `vllm serve` per model, side by side
# (`decode_breakdown.py --boot-only`: bf16 KV, no MTP, CUDA graphs up to 128 tokens, vLLM's torch
# profiler on; here with a fixed KV cache), booted STAGGER seconds apart, and once every one serves,
# `decode_breakdown.py --url` against each in turn (one at a time: no timing shares the GPU with
# another). Then every server stops.
#
#   bash bench/decode_breakdowns.sh [OUT_DIR]
#
# Settings (environment): MODELS (bench/models names, the order of the boots and of the measurements;
# default the 35B geometry and its 8-layer slice, bf16 and AWQ 4-bit), STREAMS (1,16), STEPS (64),
# CONTEXT (2048), MNBT (8192), MEM (--mem per server, 0.05), KV_BYTES (2684354560; empty: vLLM sizes the
# KV cache), STAGGER (60), WAIT (1500 s for every server to serve), PORT0 (8041; one port per model,
# upward), CONFIG (stock or overlay), BOOT_EXTRA (more `stack.py boot` options; by default
# `--max-num-seqs 128`: 2.5 GiB of KV cache hold 240 Mamba blocks for the geometry's 30 GDN layers, and
# vLLM refuses to boot with more sequences than blocks), SERVE_EXTRA (more `vllm serve` arguments),
# GRAPHS_OFF_FALLBACK (1: where a trace hides the kernels of CUDA-graph replays, boot that model again
# with --graphs off and break it down again).
# Writes OUT_DIR/decode-breakdown-MODEL-CONFIG-graphsG-h.{json,md}, OUT_DIR/boot-MODEL.log and
# OUT_DIR/traces-MODEL/ (the worker's traces).
set -u
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-${OUT:-/tmp/decode-breakdowns}}
models=${MODELS:-"qwen36-35b-a3b-geometry qwen36-35b-a3b-geometry-awq qwen36-35b-a3b-slice8 qwen36-35b-a3b-slice8-awq"}
streams=${STREAMS:-1,16}
steps=${STEPS:-64}
context=${CONTEXT:-2048}
mnbt=${MNBT:-8192}
mem=${MEM:-0.05}
kv_bytes=${KV_BYTES-2684354560}
boot_extra=${BOOT_EXTRA---max-num-seqs 128}
serve_extra=${SERVE_EXTRA:-}
stagger=${STAGGER:-60}
wait_s=${WAIT:-1500}
port0=${PORT0:-8041}
config=${CONFIG:-stock}
fallback=${GRAPHS_OFF_FALLBACK:-1}
py=${PYTHON:-python3}

fail() { echo "decode_breakdowns: $1 '$2': expected $3" >&2; exit 2; }
[[ "$config" == stock || "$config" == overlay ]] || fail CONFIG "$config" "stock or overlay"
[[ "$stagger" =~ ^[0-9]+$ ]] || fail STAGGER "$stagger" "whole seconds >= 0"
[[ "$wait_s" =~ ^[0-9]+$ && "$wait_s" -gt 0 ]] || fail WAIT "$wait_s" "whole seconds > 0"
[[ "$port0" =~ ^[0-9]+$ ]] || fail PORT0 "$port0" "a port number"
[[ "$fallback" == 0 || "$fallback" == 1 ]] || fail GRAPHS_OFF_FALLBACK "$fallback" "0 or 1"
[[ "$mnbt" =~ ^[0-9]+$ ]] || fail MNBT "$mnbt" "a whole number of tokens"
[[ -z "$kv_bytes" || "$kv_bytes" =~ ^[0-9]+$ ]] || fail KV_BYTES "$kv_bytes" "bytes (a whole number) or empty"
for m in $models; do
  [[ -f "$here/models/$m.json" || "$m" == tiny ]] || fail MODELS "$m" "names of bench/models/*.json or tiny"
done
mkdir -p "$out"

label() { echo "bd-${1//./_}"; }
boot() {  # $1 model, $2 port, $3 graphs on|off, $4 wait seconds (0: return once started)
  local t="$out/traces-$1$([[ $3 == off ]] && echo -graphsoff)"
  echo "decode_breakdowns: $(date -u +%H:%M:%S) boot $1 (graphs $3) on port $2"
  "$py" "$here/decode_breakdown.py" --boot-only --label "$(label "$1")" --model "$1" --config "$config" \
    --graphs "$3" --port "$2" --trace-dir "$t" --steps "$steps" --context "$context" --mnbt "$mnbt" \
    --boot-extra="--mem $mem${kv_bytes:+ --kv-bytes $kv_bytes}${boot_extra:+ $boot_extra}" \
    ${serve_extra:+"--serve-extra=$serve_extra"} >> "$out/boot-$1.log" 2>&1 || return 1
  (( $4 == 0 )) || "$py" "$here/stack.py" wait "$(label "$1")" --wait "$4" >> "$out/boot-$1.log" 2>&1
}

t0=$SECONDS
port=$port0
declare -A ports
for m in $models; do
  ports[$m]=$port
  boot "$m" "$port" on 0 || echo "decode_breakdowns: the boot of $m did not start (see $out/boot-$m.log)" >&2
  port=$((port + 1))
  [[ "$m" == "${models##* }" ]] || sleep "$stagger"
done
declare -A up
for m in $models; do
  left=$(( wait_s - (SECONDS - t0) )); (( left < 1 )) && left=1
  if "$py" "$here/stack.py" wait "$(label "$m")" --wait "$left" >> "$out/boot-$m.log" 2>&1; then
    up[$m]=1; echo "decode_breakdowns: $(date -u +%H:%M:%S) $m serves ($((SECONDS - t0)) s after the first boot)"
  else
    echo "decode_breakdowns: $m does not serve (it died, or was not healthy ${wait_s} s after the first boot); its logs: $out/boot-$m.log and the stack state folder" >&2
  fi
done
rc=0
for m in $models; do
  [[ -n "${up[$m]:-}" ]] || { rc=1; continue; }
  echo "decode_breakdowns: $(date -u +%H:%M:%S) breakdown of $m"
  "$py" "$here/decode_breakdown.py" --url "http://127.0.0.1:${ports[$m]}" --trace-dir "$out/traces-$m" --model "$m" \
    --config "$config" --streams "$streams" --steps "$steps" --context "$context" --mnbt "$mnbt" --out "$out" --tag h || rc=1
  res="$out/decode-breakdown-$m-$config-graphson-h.json"
  if [[ "$fallback" == 1 ]] && grep -q '"graphs_hide_kernels": true' "$res" 2>/dev/null; then
    echo "decode_breakdowns: CUDA graph replays of $m hid their kernels: again with graphs off"
    "$py" "$here/stack.py" stop "$(label "$m")" >> "$out/boot-$m.log" 2>&1
    if boot "$m" "${ports[$m]}" off "$wait_s"; then
      "$py" "$here/decode_breakdown.py" --url "http://127.0.0.1:${ports[$m]}" --trace-dir "$out/traces-$m-graphsoff" \
        --model "$m" --config "$config" --graphs off --streams "$streams" --steps "$steps" --context "$context" \
        --mnbt "$mnbt" --out "$out" --tag h || rc=1
    else
      echo "decode_breakdowns: the graphs-off boot of $m failed ($out/boot-$m.log)" >&2; rc=1
    fi
  fi
done
for m in $models; do "$py" "$here/stack.py" stop "$(label "$m")" >> "$out/boot-$m.log" 2>&1; done
echo "decode_breakdowns: done in $((SECONDS - t0)) s, rc $rc; results in $out"
exit $rc
