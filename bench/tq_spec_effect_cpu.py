"""How far the logprobs of a dummy-weight model move when its verify steps attend to the new tokens
only: what a replayed TurboQuant verify graph of stock vLLM 0.22.0+ does,
measured on the CPU build so that the GPU run can pick a model whose difference shows.

On vLLM 0.22.0-0.33.0 a TurboQuant verify batch (1 + k tokens a request) is captured in a full CUDA
graph with the dummy batch's seq_len == q_len, so on replay each request's tokens attend to those
1 + k tokens only, causally: the first one (the last accepted token, whose logits give the next
token while drafts are rejected) attends to itself alone in every full-attention layer. Here the CPU
build runs greedy generation one request at a time (every decode step is one token of one request)
twice, once as vLLM computes it and once with the full-attention layers' output of every decode step
replaced by that token's own value vector (softmax over one key), its KV still written to the cache
as vLLM does; the GDN layers are left alone. Then the two runs are compared as `bench/stack.py
compare` does. The replacement is in this script's process only (vLLM's Attention.forward wrapped
in memory); nothing is installed.

  flock /tmp/vllm-engine.lock python bench/tq_spec_effect_cpu.py --model tiny
  flock /tmp/vllm-engine.lock python bench/tq_spec_effect_cpu.py --model qwen36-35b-a3b-slice8 --experts 8

Seen on 2026-12-01 (vLLM 0.32.0's CPU build, 2 cores, dummy weights, greedy, 16 tokens after prompts
of 16, 512, 1024, 2000 and 4000 tokens, top-20): the tiny hybrid (hidden 256, one full-attention
layer) moves by at most 0.000492 (later positions; 5-8 steps of its logits' bf16 grid, top-20
overlap 19/20): below the 0.002 that two correct runs of the 35B geometry differed by on the H200
(bench/results/stack-tq-mtp-steps-h200.json), so it cannot show the fault. The 35B geometry's
first 8 layers (hidden 2048, 16 query and 2 KV heads of 256, two full-attention layers; 8 experts
here for the CPU's memory, 256 on the GPU) move by 0.031-0.062, top-20 overlap 1-8 of 20, the top-1
token kept (dummy weights: every model repeats the prompt's last token), first tokens bit-identical.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import serve_measure as sm  # bench/serve_measure.py: run as a script, Python puts bench/ first on sys.path

HERE = os.path.dirname(os.path.abspath(__file__))

LENGTHS = (16, 512, 1024, 2000, 4000)


def child(mode: str, model: str, out: str, tokens: int, mem: float) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: the wrapper reaches it
    os.environ["VLLM_OVERLAY"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.model_executor.layers.attention import attention as attn_mod

    original = attn_mod.Attention.forward

    def forward(self, query, key, value, output_shape=None, output_dtype=None):  # type: ignore[no-untyped-def]
        out = original(self, query, key, value, output_shape, output_dtype)  # stores the KV as vLLM does
        if mode == "self" and query.shape[0] == 1 and value is not None:
            v = value.reshape(1, self.num_kv_heads, self.head_size_v)
            v = v.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
            return v.reshape(out.shape).to(out.dtype)
        return out

    attn_mod.Attention.forward = forward
    llm = LLM(model=model, load_format="dummy", enforce_eager=True, skip_tokenizer_init=True, max_model_len=8192,
              max_num_batched_tokens=8192, enable_prefix_caching=False, seed=0, gpu_memory_utilization=mem)
    prompts = [sm.prompt_ids(n, "logprobs", 0, i) for i, n in enumerate(LENGTHS)]
    sp = SamplingParams(temperature=0, max_tokens=tokens, logprobs=20, ignore_eos=True)
    res = {"kind": "logprobs", "mode": mode, "prompts": []}
    for ids in prompts:  # one at a time: every decode step is a single token
        c = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].outputs[0]
        res["prompts"].append({
            "prompt_tokens": len(ids), "prompt_digest": sm.ids_digest(ids), "token_ids": list(c.token_ids),
            "positions": [{"token": t, "logprob": lp[t].logprob, "top": {str(k): v.logprob for k, v in lp.items()}}
                          for t, lp in zip(c.token_ids, c.logprobs)]})
    with open(out, "w") as f:
        json.dump(res, f)


def model_dir(name: str, experts: int | None, scratch: str) -> str:
    if name == "tiny":
        sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
        from vllm_overlay.tools.models import tiny_hybrid_dir

        src = os.path.join(tiny_hybrid_dir(), "config.json")
    elif os.path.isdir(name):
        src = os.path.join(name, "config.json")
    else:
        src = os.path.join(HERE, "models", f"{name}.json")
    if not os.path.isfile(src):
        sys.exit(f"tq_spec_effect_cpu: --model {name!r}: expected 'tiny', a model directory or bench/models/NAME")
    cfg = json.load(open(src))
    if experts:
        cfg["num_experts"] = experts
        cfg["num_experts_per_tok"] = min(cfg["num_experts_per_tok"], experts)
    folder = os.path.join(scratch, "model")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return folder


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="'tiny', bench/models/NAME or a model directory")
    ap.add_argument("--experts", type=int, default=None, help="num_experts for the CPU's memory (default: the model's)")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--mem", type=float, default=0.2, help="--gpu-memory-utilization (the CPU build's memory share)")
    ap.add_argument("--out", default="", help="write both runs and the comparison here (JSON)")
    ap.add_argument("--child", nargs=4, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        mode, model, out, tokens = a.child
        child(mode, model, out, int(tokens), a.mem)
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        model = model_dir(a.model, a.experts, scratch)
        runs = {}
        for mode in ("full", "self"):
            path = os.path.join(scratch, f"{mode}.json")
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--mem", str(a.mem), "--child", mode,
                                model, path, str(a.tokens)], capture_output=True, text=True, timeout=1800)
            if p.returncode != 0 or not os.path.exists(path):
                print(p.stdout[-3000:] + p.stderr[-5000:])
                sys.exit(f"tq_spec_effect_cpu: the {mode} run failed (exit {p.returncode})")
            runs[mode] = json.load(open(path))
    c = sm.compare_logprobs(runs["self"], runs["full"])
    print(f"{a.model}{f' ({a.experts} experts)' if a.experts else ''}, attending to the new token only vs vLLM: "
          + sm.describe_comparison(c))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": a.model, "experts": a.experts, "runs": runs, "compare": c}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
