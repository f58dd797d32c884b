#!/usr/bin/env bash
# decode-gemv against stock vLLM on one GPU. First the GEMV microbenchmark
# (bench/decode_gemv_h200.py: each dense projection shape of the model, cuBLAS against the GEMV's
# configs, which writes the fastest config per shape to OUT_DIR/gemv-configs.json). Then two
# `vllm serve` of the model side by side, booted STAGGER s apart with the same settings: the overlay
# with VLLM_OVERLAY_DECODE_GEMV=1 reading that table (label gemv) and stock vLLM (label stock). Once
# both serve, on each in turn (one at a time: no timing shares the GPU with another): `stack.py steps`
# (decode steps at each stream count, REPS rounds, median and spread) and `stack.py logprobs` (greedy
# tokens and top-20 logprobs of PROMPTS prompts), then `stack.py compare` of the two. A server that
# does not serve beside the other (e.g. both do not fit in memory) is booted again alone once the other
# has been measured and stopped.
#
#   bash bench/decode_gemv_ab.sh [OUT_DIR]
#
# Settings (environment): MODEL (a bench/models name, default qwen36-35b-a3b-geometry), STREAMS (1,16),
# CONTEXTS (2048: prompt tokens per stream), TOKENS (128 decode steps per round), REPS (5), PROMPTS (8),
# LENGTHS (16,512,2048,4000: logprob prompt lengths), LP_TOKENS (16 greedy tokens a prompt), MNBT (8192),
# MAX_MODEL_LEN (8192), MEM (0.05 a server), KV_BYTES (2684354560; empty: vLLM sizes the KV cache),
# MAX_NUM_SEQS (128: 2.5 GiB of KV cache hold 240 Mamba blocks for the geometry's 30 GDN layers),
# MAX_CAPTURE (128), STAGGER (60), WAIT (900 s for a server to serve), PORT0 (8061; the second server PORT0+1),
# MICRO (1; 0 skips the microbenchmark: the lever server then uses GEMV_CONFIGS, the shipped table or
# the heuristic), MICRO_BUDGET (150: its --budget-s), GEMV_CONFIGS (a config table for the lever server instead of the one measured here),
# LEVER_ENV (more overlay settings for the lever server, "NAME=VALUE ..."), GEMV (1: the lever server runs
# decode-gemv, VLLM_OVERLAY_DECODE_GEMV=1; 0: it runs with VLLM_OVERLAY_DECODE_GEMV=0, for a lever measured
# without it), TUNE_MOE (0; 1: before the boots, `vllm-overlay tune-moe` tunes the model's fused-MoE shape
# at TUNE_BATCHES (1,2,4,8,16,32,64,128) into OUT_DIR/moe-configs, TUNE_LIMIT seconds at most (300), and
# the lever server reads that folder: VLLM_OVERLAY_MOE_CONFIG_DIR; stopped by TUNE_LIMIT, it reads the batch
# sizes finished), BASE (stock: the second server is stock vLLM, VLLM_OVERLAY=0, label stock; overlay: it is
# the overlay with VLLM_OVERLAY_DECODE_GEMV=0 and an empty VLLM_OVERLAY_MOE_CONFIG_DIR, label base, so that
# the two servers differ only in the lever's settings).
# Writes OUT_DIR/gemv.json (microbenchmark), OUT_DIR/gemv-configs.json, OUT_DIR/compare.json, and the
# servers' state folders (steps.json, logprobs.json, serve.log, overlay reports) under OUT_DIR/stack.
set -u -o pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-${OUT:-/tmp/decode-gemv-ab}}
model=${MODEL:-qwen36-35b-a3b-geometry}
streams=${STREAMS:-1,16}
contexts=${CONTEXTS:-2048}
tokens=${TOKENS:-128}
reps=${REPS:-5}
prompts=${PROMPTS:-8}
lengths=${LENGTHS:-16,512,2048,4000}
lp_tokens=${LP_TOKENS:-16}
mnbt=${MNBT:-8192}
max_len=${MAX_MODEL_LEN:-8192}
mem=${MEM:-0.05}
kv_bytes=${KV_BYTES-2684354560}
max_seqs=${MAX_NUM_SEQS:-128}
max_capture=${MAX_CAPTURE:-128}
stagger=${STAGGER:-60}
wait_s=${WAIT:-900}
port0=${PORT0:-8061}
micro=${MICRO:-1}
micro_budget=${MICRO_BUDGET:-150}
configs=${GEMV_CONFIGS:-}
lever_env=${LEVER_ENV:-}
gemv=${GEMV:-1}
tune_moe=${TUNE_MOE:-0}
tune_batches=${TUNE_BATCHES:-1,2,4,8,16,32,64,128}
tune_limit=${TUNE_LIMIT:-300}
base=${BASE:-stock}
py=${PYTHON:-python3}

fail() { echo "decode_gemv_ab: $1 '$2': expected $3" >&2; exit 2; }
for v in TOKENS:$tokens REPS:$reps PROMPTS:$prompts LP_TOKENS:$lp_tokens MNBT:$mnbt MAX_MODEL_LEN:$max_len \
         MAX_NUM_SEQS:$max_seqs MAX_CAPTURE:$max_capture WAIT:$wait_s PORT0:$port0; do
  [[ "${v#*:}" =~ ^[1-9][0-9]*$ ]] || fail "${v%%:*}" "${v#*:}" "a whole number > 0"
done
[[ "$stagger" =~ ^[0-9]+$ ]] || fail STAGGER "$stagger" "whole seconds >= 0"
[[ "$micro" == 0 || "$micro" == 1 ]] || fail MICRO "$micro" "0 or 1"
[[ "$gemv" == 0 || "$gemv" == 1 ]] || fail GEMV "$gemv" "0 or 1"
[[ "$tune_moe" == 0 || "$tune_moe" == 1 ]] || fail TUNE_MOE "$tune_moe" "0 or 1"
[[ "$base" == stock || "$base" == overlay ]] || fail BASE "$base" "stock or overlay"
[[ "$tune_batches" =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || fail TUNE_BATCHES "$tune_batches" "batch sizes such as 1,16,64"
[[ "$tune_limit" =~ ^[1-9][0-9]*$ ]] || fail TUNE_LIMIT "$tune_limit" "whole seconds > 0"
[[ "$micro_budget" =~ ^[1-9][0-9]*$ ]] || fail MICRO_BUDGET "$micro_budget" "whole seconds > 0"
[[ -z "$kv_bytes" || "$kv_bytes" =~ ^[0-9]+$ ]] || fail KV_BYTES "$kv_bytes" "bytes (a whole number) or empty"
[[ -f "$here/models/$model.json" || "$model" == tiny ]] || fail MODEL "$model" "a name of bench/models/*.json or tiny"
[[ -z "$configs" || -f "$configs" ]] || fail GEMV_CONFIGS "$configs" "an existing config table file"
mkdir -p "$out"
export STACK_STATE_DIR="$out/stack"
t0=$SECONDS
say() { echo "decode_gemv_ab: $(date -u +%H:%M:%S) (+$((SECONDS - t0)) s) $*"; }

if [[ "$micro" == 1 ]]; then
  say "GEMV microbenchmark ($model shapes)"
  if "$py" "$here/decode_gemv_h200.py" --model "$model" --out "$out/gemv.json" --budget-s "$micro_budget" \
       --write-configs "$out/gemv-configs.json" 2>&1 | tee "$out/gemv.log"; then
    [[ -n "$configs" ]] || configs="$out/gemv-configs.json"
  else
    say "the microbenchmark failed ($out/gemv.log); the lever server uses ${configs:-the shipped table or the heuristic}"
  fi
fi

moe_dir=""
if [[ "$tune_moe" == 1 ]]; then
  read -r experts hidden inter topk < <("$py" -c "import json,sys; c=json.load(open(sys.argv[1])); print(c['num_experts'], \
c['hidden_size'], c['moe_intermediate_size'], c['num_experts_per_tok'])" "$here/models/$model.json") \
    || { echo "decode_gemv_ab: TUNE_MOE=1: $model's config names no MoE shape (num_experts, moe_intermediate_size, ...)" >&2; exit 2; }
  say "fused-MoE tuning (E=$experts, N=$inter, hidden $hidden, top-$topk, batch sizes $tune_batches, at most $tune_limit s)"
  "$py" -m vllm_overlay tune-moe --experts "$experts" --intermediate "$inter" --hidden "$hidden" --topk "$topk" \
    --dtype bf16 --batch-sizes "$tune_batches" --search quick --time-limit "$tune_limit" --out-dir "$out/moe-configs" \
    2>&1 | tee "$out/tune-moe.log"
  tune_rc=${PIPESTATUS[0]}
  if [[ "$tune_rc" == 0 ]]; then
    moe_dir="$out/moe-configs"
  elif [[ "$tune_rc" == 3 ]] && compgen -G "$out/moe-configs/E=*.json" > /dev/null; then
    # --time-limit stopped it: the file holds the finished batch sizes and vLLM's own config for the rest
    moe_dir="$out/moe-configs"; say "tune-moe stopped at TUNE_LIMIT $tune_limit s; the lever server reads the batch sizes it finished"
  else
    say "tune-moe failed (exit $tune_rc, $out/tune-moe.log); no boot"; exit 1
  fi
fi

b=stock; [[ "$base" == overlay ]] && b=base  # the baseline's label
declare -A port env
port[gemv]=$port0; port[$b]=$((port0 + 1))
env[gemv]="VLLM_OVERLAY_DECODE_GEMV=$gemv${configs:+ VLLM_OVERLAY_DECODE_GEMV_CONFIGS=$configs}${moe_dir:+ VLLM_OVERLAY_MOE_CONFIG_DIR=$moe_dir}${lever_env:+ $lever_env}"
env[$b]=""
if [[ "$b" == base ]]; then
  mkdir -p "$out/moe-configs-none"
  env[base]="VLLM_OVERLAY_DECODE_GEMV=0 VLLM_OVERLAY_MOE_CONFIG_DIR=$out/moe-configs-none"
fi
boot() {  # $1 label
  local cfg=overlay; [[ $1 == stock ]] && cfg=stock
  say "boot $1 (config $cfg, port ${port[$1]}${env[$1]:+, $(echo ${env[$1]})})"
  "$py" "$here/stack.py" boot "$1" --config "$cfg" --model "$model" --kv auto --mtp 0 --mnbt "$mnbt" \
    --max-model-len "$max_len" --max-capture "$max_capture" --mem "$mem" ${kv_bytes:+--kv-bytes "$kv_bytes"} \
    --max-num-seqs "$max_seqs" --port "${port[$1]}" ${env[$1]:+--overlay-env "${env[$1]}"} >> "$out/boot-$1.log" 2>&1
}
serves() {  # $1 label, $2 seconds
  "$py" "$here/stack.py" wait "$1" --wait "$2" >> "$out/boot-$1.log" 2>&1
}
measure() {  # $1 label
  say "steps of $1 (streams $streams, contexts $contexts, $tokens tokens, $reps rounds)"
  "$py" "$here/stack.py" steps "$1" --streams "$streams" --contexts "$contexts" --tokens "$tokens" --reps "$reps" \
    2>&1 | tee -a "$out/measure-$1.log" || rc=1
  say "logprobs of $1 ($prompts prompts, lengths $lengths, $lp_tokens tokens)"
  "$py" "$here/stack.py" logprobs "$1" --prompts "$prompts" --lengths "$lengths" --max-tokens "$lp_tokens" \
    2>&1 | tee -a "$out/measure-$1.log" || rc=1
  "$py" "$here/stack.py" stop "$1" >> "$out/boot-$1.log" 2>&1
}

rc=0
boot gemv || say "the boot of gemv did not start ($out/boot-gemv.log)"
sleep "$stagger"
boot "$b" || say "the boot of $b did not start ($out/boot-$b.log)"
declare -A up done_
for l in gemv "$b"; do  # both serve (or are gone) before anything is timed
  left=$(( wait_s - (SECONDS - t0) )); (( left < 60 )) && left=60
  if serves "$l" "$left"; then
    up[$l]=1; say "$l serves"
  else
    say "$l does not serve beside the other (died or timed out; $out/boot-$l.log)"
    "$py" "$here/stack.py" stop "$l" >> "$out/boot-$l.log" 2>&1
  fi
done
for l in gemv "$b"; do
  [[ -n "${up[$l]:-}" ]] && { measure "$l"; done_[$l]=1; }
done
for l in gemv "$b"; do
  [[ -n "${done_[$l]:-}" ]] && continue
  say "boot $l again, alone"
  if boot "$l" && serves "$l" "$wait_s"; then
    say "$l serves"; measure "$l"; done_[$l]=1
  else
    say "$l does not serve alone either ($out/boot-$l.log)"; rc=1
    "$py" "$here/stack.py" stop "$l" >> "$out/boot-$l.log" 2>&1
  fi
done
if [[ -n "${done_[gemv]:-}" && -n "${done_[$b]:-}" ]]; then
  "$py" "$here/stack.py" compare "$STACK_STATE_DIR/gemv/logprobs.json" "$STACK_STATE_DIR/$b/logprobs.json" \
    --out "$out/compare.json" 2>&1 | tee "$out/compare.log" || rc=1
fi
say "done, rc $rc; results in $out"
exit $rc
