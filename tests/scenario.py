"""One real vLLM engine (CPU build) per process, driven the way the tests need it.

Run as ``python tests/scenario.py OUT.json [--mnbt N] [--compile] [--shape bug|short]``. Settings
come from the environment (VLLM_OVERLAY_*), exactly as in a served process, which is why every
boot is its own process: the overlay's register() reads them once per process. Writes JSON with
the outputs (token ids and logprobs) or the error, and where the overlay reports went.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback

BUG_SHAPE = [2500, 2600, 2400] + [40] * 8  # the bug report: one step of 7820 tokens
SHORT_SHAPE = [300, 40, 40]


def own_report() -> dict:
    """This process's overlay report (the engine core and its worker run here)."""
    from vllm_overlay.report import STATE

    path = STATE.report_path()
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"patches": {}}


def mark_window(seq: int, name: str, limit: float = 20.0) -> float:
    """Write memory-headroom's mark file, then wait until the report shows window ``seq`` open (the
    watch polls every 0.5 s, the report is flushed within a second); seconds waited."""
    path = os.path.join(os.environ["VLLM_OVERLAY_REPORT_DIR"], "memory-window.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"seq": seq, "name": name}, f)
    os.replace(tmp, path)
    t0 = time.time()
    while time.time() - t0 < limit:
        rt = own_report()["patches"].get("memory-headroom", {}).get("runtime") or {}
        if any(w.get("seq") == seq for w in rt.get("windows", [])):
            return round(time.time() - t0, 2)
        time.sleep(0.2)
    raise RuntimeError(f"memory-headroom did not open window {seq} within {limit} s")


BROKEN_TEXT = "a line no vLLM release has (a proof broken on purpose by the test)"


def break_proof(patch_id: str, release: str) -> str:
    """Give ``patch_id``'s support row of ``release`` one more proof, which no vLLM file holds (in this
    process: its module's SPEC is replaced); returns the proof's file. A test of the carry-over: the
    patch must then be skipped, naming that proof and file."""
    import dataclasses
    import importlib

    from vllm_overlay.spec import Proof

    mod = importlib.import_module("vllm_overlay.patches." + patch_id.replace("-", "_"))
    row = mod.SPEC.support_for(release)
    path = row.proof[0].path if row.proof else "config/vllm.py"
    rows = tuple(dataclasses.replace(r, proof=(*r.proof, Proof(path, BROKEN_TEXT))) if r is row else r
                 for r in mod.SPEC.support)
    mod.SPEC = dataclasses.replace(mod.SPEC, support=rows)
    return path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--mnbt", type=int, default=8192)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--shape", choices=("bug", "short"), default="bug")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--kv-cache-dtype", default=None)
    ap.add_argument("--model", default=None, help="model directory (default: the embedded tiny hybrid)")
    ap.add_argument("--ngram-spec", type=int, default=0, metavar="K",
                    help="speculative decoding with vLLM's ngram drafter and K speculative tokens")
    ap.add_argument("--mtp", type=int, default=0, metavar="K",
                    help="MTP speculative decoding with K speculative tokens (the tiny hybrid with one MTP layer, "
                         "dummy weights, in a temporary model directory)")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (worker processes on the CPU build)")
    ap.add_argument("--ep", action="store_true", help="enable_expert_parallel (experts split over the --tp ranks)")
    ap.add_argument("--memory-windows", action="store_true",
                    help="open a memory-headroom window around the generate call (the mark file in "
                         "VLLM_OVERLAY_REPORT_DIR, acknowledged through the report) and keep its record")
    ap.add_argument("--break-proof", metavar="PATCH@RELEASE", default=None,
                    help="add a proof no file holds to that patch's support row of RELEASE (break_proof)")
    ap.add_argument("--first-mnbt", type=int, default=0,
                    help="first boot (and release) an engine with this max_num_batched_tokens in this process")
    # prefix caching puts hybrid models in mamba 'align' mode, which cuts prefills at block
    # boundaries; without it the bug report's step is exactly one forward of 7820 tokens
    args = ap.parse_args()
    # the engine core runs in this process, so all prompts are queued before its first step
    # (as in the bug report's reproduction): the bug report's step is then exactly one forward
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.break_proof:  # before vLLM loads the plugin, which registers in this process
        patch_id, release = args.break_proof.split("@")
        break_proof(patch_id, release)
    from vllm import LLM, SamplingParams

    from vllm_overlay.tools.models import tiny_hybrid_dir

    result: dict = {"argv": sys.argv[1:], "report_dir": os.environ.get("VLLM_OVERLAY_REPORT_DIR")}
    t0 = time.time()
    try:
        kwargs = {}
        if args.kv_cache_dtype:
            kwargs["kv_cache_dtype"] = args.kv_cache_dtype
        if args.ngram_spec:
            kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.ngram_spec,
                                            "prompt_lookup_max": 4, "prompt_lookup_min": 2}
        model = args.model or tiny_hybrid_dir()
        if args.mtp:
            import tempfile

            with open(os.path.join(model, "config.json")) as f:
                cfg = json.load(f)
            cfg["num_nextn_predict_layers"] = 1  # Qwen3-Next's MTP layer (vLLM builds Qwen3NextMTP)
            model = tempfile.mkdtemp(prefix="tiny-hybrid-mtp-")
            with open(os.path.join(model, "config.json"), "w") as f:
                json.dump(cfg, f)
            kwargs["speculative_config"] = {"method": "mtp", "num_speculative_tokens": args.mtp}
        if args.tp > 1:
            kwargs["tensor_parallel_size"] = args.tp
        if args.ep:
            kwargs["enable_expert_parallel"] = True

        def boot(mnbt: int) -> LLM:
            return LLM(model=model, load_format="dummy", skip_tokenizer_init=True,
                       max_num_batched_tokens=mnbt, max_model_len=max(8192, mnbt),
                       max_num_seqs=32, gpu_memory_utilization=0.3, enforce_eager=not args.compile,
                       seed=0, enable_prefix_caching=False, **kwargs)

        if args.first_mnbt:  # an earlier engine in the same process, released before the next
            import gc
            import weakref

            from vllm_overlay.patches import gdn_output_prealloc as gdn

            first = boot(args.first_mnbt)
            refs = [weakref.ref(b) for b in gdn.buffers()]
            result["first_rows"] = [int(r().shape[0]) for r in refs]
            del first
            gc.collect()
            result["first_freed"] = [r() is None for r in refs]
        llm = boot(args.mnbt)
        if args.first_mnbt:
            result["second_rows"] = [int(b.shape[0]) for b in gdn.buffers()]
        result["boot_s"] = time.time() - t0
        rng = random.Random(0)
        lens = BUG_SHAPE if args.shape == "bug" else SHORT_SHAPE
        prompts = [{"prompt_token_ids": [rng.randrange(10, 4000) for _ in range(n)]} for n in lens]
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True, detokenize=False,
                            logprobs=1)
        if args.memory_windows:
            result["window_ack_s"] = [mark_window(1, "generate")]
        outs = llm.generate(prompts, sp, use_tqdm=False)
        if args.memory_windows:
            result["window_ack_s"].append(mark_window(2, "idle"))
            result["runtime"] = own_report()["patches"]["memory-headroom"].get("runtime")
        result["token_ids"] = [list(o.outputs[0].token_ids) for o in outs]
        result["logprobs"] = [
            [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs
        ]
        result["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - the error is the result
        result["ok"] = False
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-6000:]
    result["wall_s"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(result, f)
    time.sleep(2.5)  # let the engine processes flush their reports
    return 0


if __name__ == "__main__":
    sys.exit(main())
