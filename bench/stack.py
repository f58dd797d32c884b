"""The bug report's serving stack through `vllm serve`, driven in steps (a server started with
`boot` runs on in its own process session until `stop`, so the steps may come from several commands).

  python3 bench/stack.py boot LABEL --config overlay --tp 2 --ep --kv turboquant_k8v4 --mtp 3 [--wait S]
       [--gpu N] [--port P] [--mem F] [--model NAME|DIR] [--spec-method M] [--max-num-seqs N]
       [--max-capture N] [--additional-config JSON] [--extra "ARGS"] [--overlay-env "NAME=VALUE ..."]
       [--env "NAME=VALUE ..."]                       # e.g. --env VLLM_USE_V2_MODEL_RUNNER=1
  python3 bench/stack.py wait LABEL --wait S          # until /health answers, the server dies, or S seconds
  python3 bench/stack.py stress LABEL --min-band 1000 --duration S
  python3 bench/stack.py decode LABEL --streams 1,16 --tokens 256 --reps 3
  python3 bench/stack.py steps LABEL --streams 1,16 --contexts 2048,32768 --tokens 64 --reps 3 [--budget-s S]
  python3 bench/stack.py logprobs LABEL --prompts 8 --top 20 --out NAME [--lengths 16,64,...]
  python3 bench/stack.py memory LABEL [--phases longest,band,burst,mixed] [--budget-s S]  # traffic phases,
                                                      # memory per phase (bench/memory_serve.py)
  python3 bench/stack.py series tq-mtp-steps [--gpus 0,1] [--labels a,b] [--deadline S]  # label after label:
                                                      # boot, steps, logprobs, stop; the same command resumes
  python3 bench/stack.py series v2-bf16               # Model Runner V2: stress, logprobs, forced guard, stock
  python3 bench/stack.py series tqspec                # TurboQuant + MTP, the overlay's verify path off / on
  python3 bench/stack.py series memory                # memory under traffic: cap vs memory-headroom vs vLLM
  python3 bench/stack.py series release               # one release's stack: TurboQuant + MTP stress and verify
                                                      # logprobs, AWQ weights, forced guard, bf16 decode vs stock
  python3 bench/stack.py stop LABEL                   # ends the server, then `collect`
  python3 bench/stack.py collect LABEL                # copies log tail, reports, results into $OUT/LABEL
  python3 bench/stack.py merge RESULT.json NAME=DIR|NAME=LABEL.json|NAME='COPIES/*/LABEL.json' ...
  python3 bench/stack.py compare A.json B.json [--top 20]  # two logprob runs, first token and later

Configurations (the overlay's environment; every one uses the same vLLM arguments):
  overlay        the overlay's defaults, profile cap 4096 through the legacy name GENESIS_PROFILE_RUN_CAP_M
  legacy         + VLLM_OVERLAY_TEST_BUFFER_ROWS=4096, VLLM_OVERLAY_TEST_GUARD=0 (the reference tree's sizing),
                 VLLM_OVERLAY_MEMORY_HEADROOM=0
  forced-guard   + VLLM_OVERLAY_TEST_BUFFER_ROWS=4096 with the capacity guard on, VLLM_OVERLAY_MEMORY_HEADROOM=0
  stock          VLLM_OVERLAY=0 (stock vLLM refuses TurboQuant on hybrid models: run it with --kv auto)

Runs from the project root with vLLM importable (or staged in /tmp/site: bench/gpu/README.md); this
tree's src/ goes first on PYTHONPATH. State lives in /tmp/stack/LABEL ($STACK_STATE_DIR); every step writes
`$OUT/LABEL/` (or bench/results/stack/LABEL without $OUT): summary.json (merged over the steps run on
this machine), serve.log (its last 400 kB), reports/, stress/, decode.json, steps.json, NAME.json.
With `--compact` (or STACK_COMPACT=1) a step writes one file per label instead, `$OUT/LABEL.json`
(summary, result files, the overlay's reports, the log's first 60 kB and last 150 kB), for copying
results off a host. `merge` and `compare` read either form.

Every server gets the caller's environment less its overlay settings: other variables, such as
VLLM_USE_V2_MODEL_RUNNER, pass through; `--env` sets more for one server and the state records the
server's VLLM_* variables. Several servers run side by side with their own LABEL, --port and --gpu
(CUDA_VISIBLE_DEVICES, in nvidia-smi's order). `steps` and `logprobs` are described in
bench/serve_measure.py, `memory` in bench/memory_serve.py, the series in bench/README.md.
This file is the command; the benchmark is the package bench/stack/ (bench/stack/__init__.py lists
its modules).
"""

import os
import sys

# the project root first: bench/ is a package (bench/stack/ holds the benchmark, bench/serve_measure.py its
# arithmetic), and this script's own folder, which Python puts first, has a bench.py of its own
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.stack.cli import main  # noqa: E402 - bench/stack/cli.py

if __name__ == "__main__":
    sys.exit(main())
