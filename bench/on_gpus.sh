#!/usr/bin/env bash
# Run job lists side by side, one list per GPU of this host (jobs of a list run one after another),
# stop them all at a deadline, and pack what they wrote into one archive (one file to copy off the
# host).
#
#   bench/on_gpus.sh DEADLINE_S RESULTS_DIR ARCHIVE "job; job" ["job; job" ...]
#
# List i runs with CUDA_VISIBLE_DEVICES=i (a list naming CUDA_VISIBLE_DEVICES itself, e.g. a TP=2
# run, overrides it). Every job sees BENCH_NOTE, which bench.py and redgreen.py record, so a
# figure measured beside another job says so. TRITON_CACHE_AUTOTUNING=1 keeps Triton's autotune
# results on disk: the first boot on a fresh machine autotunes, later boots on that machine reuse them.
set -u
deadline=$1 dir=$2 archive=$3
shift 3
mkdir -p "$dir"
export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}
n=$#
pids=()
i=0
for jobs in "$@"; do
  note="list $((i + 1)) of $n run side by side on one host"
  [ "$n" -gt 1 ] || note="alone on the host"
  BENCH_NOTE=$note CUDA_VISIBLE_DEVICES=$i setsid bash -c "$jobs" >"$dir/gpu$i.log" 2>&1 &
  pids+=($!)
  i=$((i + 1))
done
end=$((SECONDS + deadline))
while [ $SECONDS -lt $end ]; do
  alive=0
  for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
  [ $alive = 1 ] || break
  sleep 5
done
for p in "${pids[@]}"; do
  if kill -0 "$p" 2>/dev/null; then
    echo "on_gpus.sh: deadline of ${deadline} s reached, stopping job list (pid $p)" | tee -a "$dir/gpu-deadline.log"
    kill -TERM -- "-$p" 2>/dev/null
  fi
done
sleep 3
for f in "$dir"/*.log; do  # keep the ends of logs: the archive must stay small
  [ -f "$f" ] && tail -c 40000 "$f" >"$f.tail" && mv "$f.tail" "$f"
done
tar -czf "$archive" -C "$(dirname "$dir")" "$(basename "$dir")"
for f in "$dir"/*.log; do echo "== $f"; tail -n 8 "$f"; done
ls -la "$archive"
