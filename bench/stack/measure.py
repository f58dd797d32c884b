"""The measuring steps against a serving label: `stress`, `decode`, `steps` (decode step times at
stream counts and contexts, bench/serve_measure.py), `logprobs`, `continuation` and `compare`."""

from __future__ import annotations

import argparse
import concurrent.futures
import glob
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

from .. import serve_measure as sm  # bench/serve_measure.py (stdlib only)
from .server import alive, load_state, MODEL, ROOT, save_state, say, sdir, tail, wait, write_json
from .collect import collect, overlay_reports, spec_counters


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


def served_block_size(label: str) -> int | None:
    """The KV cache block size the server's workers report (engine_config.block_size): prefix caching keeps
    whole blocks only, and a hybrid's blocks are large (1,472 tokens for the slice with TurboQuant k8v4)."""
    sizes = {r["engine_config"]["block_size"] for r in overlay_reports(sdir(label))
             if isinstance(r.get("engine_config"), dict) and isinstance(r["engine_config"].get("block_size"), int)}
    return max(sizes) if sizes else None


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
    prefix_len, fresh_len, block = a.prefix, a.fresh, served_block_size(a.label)
    if block and prefix_len % block:  # a prefix shorter than a block is never cached: the step would measure nothing
        prefix_len = -(-prefix_len // block) * block
        fresh_len = max(fresh_len, prefix_len + a.cont)
        say(f"{a.label}: continuation: --prefix {a.prefix} rounded up to {prefix_len} tokens, whole blocks of the "
            f"server's {block}-token KV cache blocks (prefix caching keeps whole blocks only); fresh prompt "
            f"{fresh_len} tokens")
    res: dict[str, Any] = {"kind": "continuation", "label": a.label, "vllm_args": st["vllm_args"], "top": a.top,
                           "max_tokens": a.max_tokens, "prefix": prefix_len, "prefix_asked": a.prefix,
                           "block_size": block, "cont": a.cont, "fresh": fresh_len, "seed": a.seed, "trials": []}

    def ask(ids: list[int], n: int = a.max_tokens) -> dict[str, Any]:
        return sm.request_logprobs(port, model, ids, n, a.top)

    def warm(prefix: list[int]) -> str | None:
        err = reset_prefix_cache(port)
        return err or ask(prefix, 1).get("error")

    failed = False
    for i in range(a.trials):
        prefix = sm.prompt_ids(prefix_len, "continuation", a.seed, i, "prefix")
        cont = prefix + sm.prompt_ids(a.cont, "continuation", a.seed, i, "cont")
        fresh = sm.prompt_ids(fresh_len, "continuation", a.seed, i, "fresh")
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
        if pair[0].get("cached_tokens") == 0 and not trial["errors"]:
            trial["errors"].append(f"NOT EXERCISED: the continuing request found no cached tokens (prefix {prefix_len}, "
                                   f"block size {block}): no prefill continued from cached context")
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
