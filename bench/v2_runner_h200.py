"""The overlay on vLLM's Model Runner V2 on a CUDA GPU: does the worker build V2, and do the
capacity guard, the forward telemetry and the profile-run cap (with its pre-capture full-size
forward) fire on it? Read from the overlay's own reports, per configuration.

Written for the H200 with vLLM 0.20.2 staged in /tmp/site (torch 2.11.0+cu130):

  export PYTHONPATH=/tmp/site:$PWD/src
  python bench/v2_runner_h200.py --out $OUT/v2 [--configs v2-overlay,v2-forced-guard] [--tag T]

Every configuration is its own process and boot, with VLLM_USE_V2_MODEL_RUNNER=1 (v1-overlay
sets it to 0, for comparison). vLLM's default compilation (torch.compile + CUDA graphs),
max_num_batched_tokens 8192, the Triton GDN prefill, prefix caching off.

  v2-overlay       defaults + VLLM_OVERLAY_PROFILE_RUN_CAP=4096   (expect: serves the band; the cap
                   fires, one full-size forward before capture; every runner hook fired on V2)
  v2-forced-guard  VLLM_OVERLAY_TEST_BUFFER_ROWS=4096, cap 4096     (expect: our CapacityError from the
                   V2 hooks, no crash inside compiled code)
  v2-stock         VLLM_OVERLAY=0                                  (reference outputs, same runner)
  v1-overlay       as v2-overlay with VLLM_USE_V2_MODEL_RUNNER=0   (the V1 runner, for comparison)

Traffic: --waves W (default 20) times the bug report's step, all prompts queued together
(2500 + 2600 + 2400 + 8 x 40 = 7820 tokens: one forward in the band (4096, 8192] per wave),
8 tokens out, greedy, logprobs of every generated token.

What the vLLM sources say about V2 and hybrid models (checked in the release wheels):
0.20.0-0.22.1 refuse them at config time ("VLLM_USE_V2_MODEL_RUNNER does not yet support:
hybrid/mamba models", for any model with inner state); 0.23.0-0.24.0 refuse them only with prefix
caching ("hybrid/mamba models with align cache mode"); 0.25.0 and later accept them. So on 0.20.2
the tiny hybrid (Qwen3-Next: GDN layers) is refused: the result records vLLM's error as
``refused`` and, with --fallback-model (default tiny-moe-dense, a Qwen3-MoE without GDN layers),
runs the same configuration on V2 with that model. There the telemetry and the cap are proven on
V2; the guard's hooks fire but no GDN buffer exists to protect (v2-forced-guard then serves instead
of tripping, and says so). The guard on V2 needs a release that builds V2 for hybrids: 0.25.0 or
0.26.0 pin torch 2.11; bench/gpu/README.md stages 0.26.0 on a host without a package index.

The JSON (--out/v2-runner-<model>[-TAG].json) holds, per configuration: ok / error / refused,
the runner each worker built (kind and class), each runner patch's status and its runner hooks
(fired, missing), forwards and band forwards counted by the telemetry, the profiling forward's
tokens, guard checks and trips, the overlay's events (the cap's messages), outputs; and v2-overlay
against v2-stock (token ids equal, largest logprob difference).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from typing import Any

import common  # bench/common.py: run as python3 bench/v2_runner_h200.py, Python puts bench/ first on sys.path

RUNNER_PATCHES = ("forward-telemetry", "gdn-output-prealloc", "profile-run-cap")
CONFIGS = {
    "v2-overlay": {"VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_OVERLAY_PROFILE_RUN_CAP": "4096"},
    "v2-forced-guard": {"VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_OVERLAY_TEST_BUFFER_ROWS": "4096",
                        "VLLM_OVERLAY_PROFILE_RUN_CAP": "4096"},
    "v2-stock": {"VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_OVERLAY": "0"},
    "v1-overlay": {"VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_OVERLAY_PROFILE_RUN_CAP": "4096"},
}
REFUSAL = ("does not yet support", "hybrid/mamba")


def child(out: str, model: str, mem: float, waves: int) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # all prompts of a wave queued before its first step
    res: dict[str, Any] = {"env": {k: v for k, v in os.environ.items()
                                   if k.startswith("VLLM_OVERLAY") or k == "VLLM_USE_V2_MODEL_RUNNER"}}
    t0 = time.time()
    try:
        from vllm import LLM, SamplingParams

        extra = {"additional_config": {"gdn_prefill_backend": "triton"}} if model == "tiny" else {}
        llm = LLM(model=common.model_dir(model), load_format="dummy", skip_tokenizer_init=True,
                  max_num_batched_tokens=8192, max_model_len=32768, max_num_seqs=32, dtype="bfloat16",
                  gpu_memory_utilization=mem, enable_prefix_caching=False, seed=0, **extra)
        res["boot_s"] = round(time.time() - t0, 1)
        sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, detokenize=False, logprobs=1)
        res["token_ids"], res["logprobs"] = [], []
        for wave in range(waves):
            outs = llm.generate(common.prompts(common.BUG_SHAPE, seed=wave), sp, use_tqdm=False)
            res["token_ids"].append([list(o.outputs[0].token_ids) for o in outs])
            res["logprobs"].append([[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                                    for o in outs])
            res["waves_done"] = wave + 1
        res["serve_s"] = round(time.time() - t0 - res["boot_s"], 1)
        res["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - the error is the result
        text = f"{type(exc).__name__}: {exc}"
        res.update(ok=False, error=text[:2000], traceback=traceback.format_exc()[-3000:])
        if all(word in text for word in REFUSAL):
            res["refused"] = text[:500]
    common.finish_child(out, res)


def runner_evidence(report_dir: str) -> dict[str, Any]:
    """From the overlay's reports: the runner each worker built and what each runner patch did."""
    from vllm_overlay.reports import load

    reps = load(report_dir) if os.path.isdir(report_dir) else []
    workers = [r for r in reps if r.get("runner") or r.get("engine_config")]
    out: dict[str, Any] = {"workers": []}
    for r in workers:
        out["workers"].append({
            "pid": r["pid"], "role": r["role"], "vllm_version": r.get("vllm_version"),
            "runner": r.get("runner"),
            "patches": {p: {"status": r["patches"].get(p, {}).get("status"),
                            "runner_hooks": r["patches"].get(p, {}).get("runner")} for p in RUNNER_PATCHES},
            "counters": r.get("counters", {}),
            "forwards": r["telemetry"]["forwards"].get("count"),
            "dummy_forwards": r["telemetry"]["dummy_forwards"].get("count"),
            "profile_forward_tokens": r["telemetry"]["profile_forward_tokens"],
            "events": [e for e in r.get("events", []) if "profile-run-cap" in e or "guard" in e
                       or "did not fire" in e][-20:],
        })
    w = out["workers"][0] if len(out["workers"]) == 1 else None
    if w is not None:  # the questions this script answers, one flag each
        hooks = {p: (w["patches"][p]["runner_hooks"] or {}) for p in RUNNER_PATCHES}
        out["built_v2"] = (w["runner"] or {}).get("kind") == "V2"
        out["telemetry_fired"] = "execute_model" in hooks["forward-telemetry"].get("fired", [])
        out["guard_fired"] = bool({"prepare_inputs", "_model_forward"} & set(hooks["gdn-output-prealloc"].get("fired", [])))
        out["guard_checks"] = w["counters"].get("guard_checks", 0)
        out["guard_trips"] = w["counters"].get("guard_trips", 0)
        out["cap_fired"] = any("profiling forward capped" in e for e in w["events"])
        out["precapture_forward"] = any("before CUDA graph capture" in e for e in w["events"])
        out["hooks_missing"] = {p: h.get("missing") for p, h in hooks.items() if h.get("missing")}
    return out


def run_config(name: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    tag = f"{model}-{name}"
    report_dir = os.path.join(args.out, f"reports-v2-{tag}")
    env = {**CONFIGS[name], "VLLM_OVERLAY_REPORT_DIR": report_dir}
    print(f"== {name} ({model}): {CONFIGS[name]}", flush=True)
    r = common.run_child(os.path.abspath(__file__), ["--model", model, "--mem", str(args.mem), "--waves",
                                                     str(args.waves)], env,
                         os.path.join(args.out, f"v2-runner-{tag}.log"), args.timeout)
    r["model"] = model
    r["runner_evidence"] = runner_evidence(report_dir)
    ev, rep = r["runner_evidence"], r.get("reports", {})
    print(f"   ok={r.get('ok')} refused={bool(r.get('refused'))} failure={r.get('failure')} boot_s={r.get('boot_s')} "
          f"runner={[w.get('runner') for w in ev['workers']]} band_forwards={rep.get('band_forwards')} "
          f"guard_trips={ev.get('guard_trips')} cap_fired={ev.get('cap_fired')} "
          f"precapture_forward={ev.get('precapture_forward')} missing={ev.get('hooks_missing')} "
          f"error={str(r.get('error'))[:300]}", flush=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", default=None)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--fallback-model", default="tiny-moe-dense",
                    help="run a configuration with this model when vLLM's V2 refuses --model ('' for none)")
    ap.add_argument("--configs", default="v2-overlay,v2-forced-guard,v2-stock")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--mem", type=float, default=0.5)
    ap.add_argument("--waves", type=int, default=20, help="bug-report steps sent (one band forward each)")
    ap.add_argument("--timeout", type=int, default=420,
                    help="per configuration; a cold H200 needs about 4 min per tiny-model boot (Triton autotune)")
    ap.add_argument("--tag", default="", help="suffix of the result file (runs split over several invocations)")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.model, args.mem, args.waves)
        return
    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown:
        ap.error(f"--configs {','.join(unknown)}: expected names from {', '.join(CONFIGS)}")
    os.makedirs(args.out, exist_ok=True)
    import importlib.util

    if "VLLM_USE_FLASHINFER_SAMPLER" not in os.environ and importlib.util.find_spec("flashinfer") is None:
        # vLLM 0.26.0's samplers import flashinfer on CUDA unless this is 0; the staged site has none
        # (on the H200, 2026-12-01, V2 on 0.26.0 died in load_model: "No module named 'flashinfer'")
        os.environ["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
        print("flashinfer is not installed: VLLM_USE_FLASHINFER_SAMPLER=0 for every configuration", flush=True)
    results: dict[str, Any] = {
        "script": "bench/v2_runner_h200.py", "model": args.model, "environment": common.environment(),
        "settings": {"max_num_batched_tokens": 8192, "max_model_len": 32768, "max_num_seqs": 32,
                     "compilation": "vLLM default (torch.compile + CUDA graphs)", "prefix_caching": False,
                     "gdn_prefill_backend": "triton (tiny hybrid)", "waves": args.waves,
                     "VLLM_USE_FLASHINFER_SAMPLER": os.environ.get("VLLM_USE_FLASHINFER_SAMPLER"),
                     "traffic": "waves x (2500+2600+2400 + 8x40 tokens queued together), 8 out, greedy"},
        "configs": {}}
    suffix = f"-{args.tag}" if args.tag else ""
    path = os.path.join(args.out, f"v2-runner-{args.model}{suffix}.json")
    for name in args.configs.split(","):
        r = run_config(name, args.model, args)
        if r.get("refused") and args.fallback_model:
            r["fallback"] = run_config(name, args.fallback_model, args)
        results["configs"][name] = r
        common.write_result(path, results)  # partial results survive a time limit
    for label, pick in (("", lambda r: r), ("fallback_", lambda r: r.get("fallback") or {})):
        ov, st = pick(results["configs"].get("v2-overlay") or {}), pick(results["configs"].get("v2-stock") or {})
        if ov.get("ok") and st.get("ok"):
            diffs = [abs(a - b) for wa, wb in zip(ov["logprobs"], st["logprobs"])
                     for la, lb in zip(wa, wb) for a, b in zip(la, lb)]
            results[f"{label}overlay_vs_stock_v2"] = {"token_ids_equal": ov["token_ids"] == st["token_ids"],
                                                      "max_abs_logprob_diff": max(diffs) if diffs else None}
            print(f"{label}overlay vs stock (V2):", results[f"{label}overlay_vs_stock_v2"], flush=True)
    common.write_result(path, results)


if __name__ == "__main__":
    main()
