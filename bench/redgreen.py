"""Red-to-green on a CUDA GPU with the overlay itself (vLLM 0.20.2, torch.compile + CUDA graphs,
Triton GDN, max_num_batched_tokens 8192, compile cache on).

Configurations (each its own process and boot):
  legacy-nocap     4096-row buffer, guard off, no profile cap      (expect: boot crash, fake tensors)
  legacy-cap4096   4096-row buffer, guard off, profile cap 4096    (expect: runtime crash, setStorage)
  forced-guard     4096-row buffer, guard on,  profile cap 4096    (expect: our CapacityError)
  overlay          defaults: resolver-sized buffer, no cap         (expect: serves the band)
  stock            VLLM_OVERLAY=0                                   (reference outputs)
Traffic: the bug report's step (2500 + 2600 + 2400 + 8 x 40 tokens queued together), 32 tokens out,
greedy, logprobs of every generated token.

  python bench/redgreen.py --model tiny --configs legacy-nocap,legacy-cap4096 --out DIR
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import common  # bench/common.py: run as python3 bench/redgreen.py, Python puts bench/ first on sys.path

# The legacy tree had no memory-headroom, and its forward of max_num_batched_tokens at boot would
# meet the 4096-row buffer before any traffic: off in the configurations that reproduce that tree.
NO_HEADROOM = {"VLLM_OVERLAY_MEMORY_HEADROOM": "0"}
CONFIGS = {
    "legacy-nocap": {"VLLM_OVERLAY_TEST_BUFFER_ROWS": "4096", "VLLM_OVERLAY_TEST_GUARD": "0", **NO_HEADROOM},
    "legacy-cap4096": {"VLLM_OVERLAY_TEST_BUFFER_ROWS": "4096", "VLLM_OVERLAY_TEST_GUARD": "0",
                       "VLLM_OVERLAY_PROFILE_RUN_CAP": "4096", **NO_HEADROOM},
    "forced-guard": {"VLLM_OVERLAY_TEST_BUFFER_ROWS": "4096", "VLLM_OVERLAY_PROFILE_RUN_CAP": "4096", **NO_HEADROOM},
    "overlay": {},
    "stock": {"VLLM_OVERLAY": "0"},
}


def child(out: str, model: str, mem: float) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # all prompts queued before the first step
    res: dict = {"env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_OVERLAY")}}
    t0 = time.time()
    try:
        from vllm import LLM, SamplingParams

        llm = LLM(model=common.model_dir(model), load_format="dummy", skip_tokenizer_init=True,
                  max_num_batched_tokens=8192, max_model_len=32768, max_num_seqs=32, dtype="bfloat16",
                  gpu_memory_utilization=mem, enable_prefix_caching=False, seed=0,
                  additional_config={"gdn_prefill_backend": "triton"})
        res["boot_s"] = round(time.time() - t0, 1)
        sp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, detokenize=False, logprobs=1)
        outs = llm.generate(common.prompts(common.BUG_SHAPE), sp, use_tqdm=False)
        res["token_ids"] = [list(o.outputs[0].token_ids) for o in outs]
        res["logprobs"] = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                           for o in outs]
        res["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - the error is the result
        res.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000], traceback=traceback.format_exc()[-3000:])
    common.finish_child(out, res)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", default=None)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--mem", type=float, default=0.5)
    ap.add_argument("--timeout", type=int, default=420,
                    help="per configuration; a cold H200 needs about 4 min per tiny-model boot (Triton autotune)")
    ap.add_argument("--tag", default="", help="suffix of the result file (runs split over several invocations)")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.model, args.mem)
        return
    os.makedirs(args.out, exist_ok=True)
    results = {"script": "bench/redgreen.py", "model": args.model, "environment": common.environment(),
               "settings": {"max_num_batched_tokens": 8192, "max_model_len": 32768, "max_num_seqs": 32,
                            "compilation": "vLLM default (torch.compile + CUDA graphs)",
                            "gdn_prefill_backend": "triton", "prefix_caching": False,
                            "traffic": "2500+2600+2400 + 8x40 tokens queued together, 32 out, greedy"},
               "configs": {}}
    for name in args.configs.split(","):
        env = {**CONFIGS[name], "VLLM_OVERLAY_REPORT_DIR": os.path.join(args.out, f"reports-{args.model}-{name}")}
        print(f"== {name}: {CONFIGS[name] or 'defaults'}", flush=True)
        r = common.run_child(os.path.abspath(__file__), ["--model", args.model, "--mem", str(args.mem)], env,
                             os.path.join(args.out, f"redgreen-{args.model}-{name}.log"), args.timeout)
        results["configs"][name] = r
        rep = r.get("reports", {})
        print(f"   ok={r.get('ok')} failure={r.get('failure')} boot_s={r.get('boot_s')} band_forwards="
              f"{rep.get('band_forwards')} guard_trips={rep.get('guard_trips')} error={str(r.get('error'))[:300]}",
              flush=True)
    ov, st = results["configs"].get("overlay"), results["configs"].get("stock")
    if ov and st and ov.get("ok") and st.get("ok"):
        diffs = [abs(a - b) for la, lb in zip(ov["logprobs"], st["logprobs"]) for a, b in zip(la, lb)]
        results["overlay_vs_stock"] = {"token_ids_equal": ov["token_ids"] == st["token_ids"],
                                       "max_abs_logprob_diff": max(diffs) if diffs else None}
        print("overlay vs stock:", results["overlay_vs_stock"], flush=True)
    suffix = f"-{args.tag}" if args.tag else ""
    common.write_result(os.path.join(args.out, f"redgreen-{args.model}{suffix}.json"), results)


if __name__ == "__main__":
    main()
