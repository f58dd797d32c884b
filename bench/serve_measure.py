"""Measurements through a running `vllm serve` (stdlib only, used by bench/stack.py and
bench/make_table.py): decode step times from streamed completions, top-k logprobs of the first
generated tokens, the comparison of two logprob runs, and the verify-step table.

Step time. Every stream of a round sends a prompt of `context` random token ids and asks for
`max_tokens` greedy tokens (ignore_eos). Each SSE chunk is timed on arrival and counted by its
`token_ids`. The rounds' prefills are chunked by the scheduler, so the first streams decode in
mixed batches while the last ones prefill; only the window from the moment every stream has its
first token (no prefill left) to the moment the first stream ends (the batch is still whole) is
measured: per stream its time in the window over the tokens it received there, then the median
over streams (`step_stats`); a round where a stream's chunks mostly reached the client together
(`BUNCHED_S`) measures nothing. `max_tokens_for` asks for enough tokens
that the window holds `tokens` steps. With dummy weights every draft is rejected, so a speculative
step yields one token and its interval is drafting plus verifying.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import math
import random
import statistics
import time
from typing import Any

LOGPROB_LENGTHS = (16, 64, 256, 1024, 2500, 4000, 6000, 8000)  # two above 4096 (the profile cap)
# Chunks of one stream read within this of each other reached the client together (no decode step of
# these models is this short on any device): a stream whose window is mostly such intervals was not
# seen as its steps came (its thread was not scheduled), and its round measures nothing.
BUNCHED_S = 50e-6


# ---- prompts -------------------------------------------------------------------------------------


def prompt_ids(length: int, *seed: object, lo: int = 10, hi: int = 4000) -> list[int]:
    """`length` random token ids in [lo, hi), fixed by `seed` (distinct seeds: no shared prefix)."""
    if length < 1:
        raise ValueError(f"prompt_ids: length={length}, expected >= 1")
    rng = random.Random("/".join(str(s) for s in seed) + f"/{length}")
    return [rng.randrange(lo, hi) for _ in range(length)]


def ids_digest(ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


def max_tokens_for(streams: int, context: int, tokens: int, budget: int) -> int:
    """Tokens each stream asks for so that `tokens` steps fall inside the measured window.

    The scheduler prefills the prompts `budget` tokens a step, about one after the other: the first
    stream has its first token after ceil(context / budget) steps and the last after
    ceil(streams * context / budget); the first stream must still be decoding `tokens` steps after
    that. 10 % and 2 steps of slack cover the budget the decoding streams take from the prefill.
    """
    for name, v in (("streams", streams), ("context", context), ("tokens", tokens), ("budget", budget)):
        if v < 1:
            raise ValueError(f"max_tokens_for: {name}={v}, expected >= 1")
    lag = math.ceil(streams * context / budget) - math.ceil(context / budget)
    return tokens + 1 + (math.ceil(lag * 1.1) + 2 if lag else 0)


# ---- streamed completions ------------------------------------------------------------------------


def sse_payload(line: bytes | str) -> Any:
    """One SSE line: the decoded JSON object, "DONE" for the end marker, None for anything else."""
    text = line.decode(errors="replace") if isinstance(line, bytes) else line
    text = text.strip()
    if not text.startswith("data:"):
        return None
    body = text[5:].strip()
    if body == "[DONE]":
        return "DONE"
    return json.loads(body)


def chunk_tokens(chunk: dict[str, Any]) -> int:
    """Generated tokens in one streamed completion chunk (`return_token_ids` gives them exactly)."""
    n = 0
    for choice in chunk.get("choices", []):
        ids = choice.get("token_ids")
        n += len(ids) if ids is not None else (1 if choice.get("text") else 0)
    return n


def read_stream(lines: Any, clock: Any = time.perf_counter) -> dict[str, Any]:
    """Chunks of one streamed completion from an iterable of SSE lines: [[arrival, tokens], ...]."""
    chunks: list[list[float]] = []
    error = None
    for line in lines:
        payload = sse_payload(line)
        if payload is None:
            continue
        if payload == "DONE":
            break
        if "error" in payload:
            error = str(payload["error"])[:300]
            break
        n = chunk_tokens(payload)
        if n:
            chunks.append([clock(), n])
    return {"chunks": chunks, "tokens": int(sum(n for _, n in chunks)), "error": error}


def stream_completion(port: int, model: str, ids: list[int], max_tokens: int,
                      timeout: float = 900) -> dict[str, Any]:
    """POST one streamed greedy completion and time its chunks (perf_counter seconds)."""
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "return_token_ids": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t_send = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return {"t_send": t_send, "chunks": [], "tokens": 0,
                    "error": f"HTTP {resp.status}: {resp.read()[:300].decode(errors='replace')}"}
        got = read_stream(iter(resp.readline, b""))
    except OSError as exc:
        return {"t_send": t_send, "chunks": [], "tokens": 0, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        conn.close()
    got["t_send"] = t_send
    if got["error"] is None and got["tokens"] < max_tokens:
        got["error"] = f"stream ended after {got['tokens']} of {max_tokens} tokens"
    return got


# ---- step statistics -----------------------------------------------------------------------------


def step_stats(streams: list[dict[str, Any]]) -> dict[str, Any]:
    """Decode step time of one round from its streams' chunk times (see the module's docstring).

    step_ms: per stream, the window's time from its first to its last chunk over the tokens that
    came after the first (robust to chunks that reach the client bunched together), then the median
    over streams. interval_ms: per stream the median per-token interval, then the median over streams
    (the same figure when chunks arrive one per step; a burst of chunks pulls it down). mean_ms: all
    streams' window time over all their window tokens. prefill_s: first send to the last stream's
    first token. steps: per-token intervals measured, all streams. why: when nothing was measured.
    """
    live = [s for s in streams if s.get("chunks")]
    out: dict[str, Any] = {"streams": len(streams), "step_ms": None, "interval_ms": None, "mean_ms": None,
                           "steps": 0}
    if len(live) < len(streams) or not streams:
        out["why"] = f"{len(streams) - len(live)} of {len(streams)} streams produced no tokens"
        return out
    start = max(s["chunks"][0][0] for s in live)  # every prompt prefilled
    end = min(s["chunks"][-1][0] for s in live)  # the first stream ended
    out["prefill_s"] = round(start - min(s.get("t_send", s["chunks"][0][0]) for s in live), 4)
    out["window_s"] = round(max(0.0, end - start), 4)
    per_stream, medians, spans, toks, bunched = [], [], 0.0, 0, []
    for s in live:
        inside = [c for c in s["chunks"] if start <= c[0] <= end]
        n = sum(c[1] for c in inside[1:])
        gaps = [b[0] - a[0] for a, b in zip(inside, inside[1:])]
        close = sum(g < BUNCHED_S for g in gaps)
        if 2 * close > len(gaps):
            bunched.append(f"{close} of {len(gaps)}")
        if n:
            span = inside[-1][0] - inside[0][0]
            per_stream.append(span / n)
            medians.append(statistics.median((b[0] - a[0]) / b[1] for a, b in zip(inside, inside[1:])))
            out["steps"] += len(inside) - 1
            spans += span
            toks += n
    if not per_stream:
        out["why"] = ("no decode step with every stream decoding: the first stream ended before the last "
                      "one's first token (ask for more tokens)")
        return out
    if bunched:
        out["why"] = (f"chunks reached the client bunched together ({', '.join(bunched)} intervals of "
                      f"{len(bunched)} stream(s) under {BUNCHED_S * 1e6:.0f} us): the client did not see the steps "
                      "as they came (a busy machine); the round measures nothing")
        return out
    out["step_ms"] = round(1000 * statistics.median(per_stream), 4)
    out["interval_ms"] = round(1000 * statistics.median(medians), 4)
    out["mean_ms"] = round(1000 * spans / toks, 4)
    out["tokens_in_window"] = toks
    out["streams_measured"] = len(per_stream)
    return out


def stat(values: list[float]) -> dict[str, Any] | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"median": round(statistics.median(vals), 4), "min": round(min(vals), 4),
            "max": round(max(vals), 4), "n": len(vals)}


# ---- logprobs ------------------------------------------------------------------------------------


def logprob_prompts(n: int, lengths: list[int] | None = None, seed: int = 0) -> list[list[int]]:
    """`n` fixed prompts: the lengths cycle through `lengths` (default LOGPROB_LENGTHS)."""
    lens = list(lengths or LOGPROB_LENGTHS)
    if n < 1 or not lens or min(lens) < 1:
        raise ValueError(f"logprob_prompts: n={n}, lengths={lens}; expected n >= 1 and lengths >= 1")
    return [prompt_ids(lens[i % len(lens)], "logprobs", seed, i) for i in range(n)]


def token_key(key: str) -> int:
    """A top-logprob key from `return_tokens_as_token_ids`: "token_id:123" -> 123."""
    if not key.startswith("token_id:"):
        raise ValueError(f"top-logprob key {key!r}: expected 'token_id:N' (ask with "
                         "return_tokens_as_token_ids=true; a server without a tokenizer cannot name tokens)")
    return int(key.split(":", 1)[1])


def parse_logprobs(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """Per generated position: the token id, its logprob and the top entries {id: logprob}."""
    lp = choice.get("logprobs") or {}
    tokens, token_lps, tops = lp.get("tokens") or [], lp.get("token_logprobs") or [], lp.get("top_logprobs") or []
    ids = choice.get("token_ids") or [token_key(t) for t in tokens]
    out = []
    for i, tid in enumerate(ids):
        top = tops[i] if i < len(tops) and tops[i] else {}
        out.append({"token": int(tid), "logprob": token_lps[i] if i < len(token_lps) else None,
                    "top": {str(token_key(k)): float(v) for k, v in top.items()}})
    return out


def request_logprobs(port: int, model: str, ids: list[int], max_tokens: int, top: int,
                     timeout: float = 600) -> dict[str, Any]:
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "logprobs": top, "return_tokens_as_token_ids": True,
                       "return_token_ids": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    rec: dict[str, Any] = {"prompt_tokens": len(ids), "prompt_digest": ids_digest(ids),
                           "seconds": round(time.perf_counter() - t0, 3)}
    if resp.status != 200:
        rec["error"] = f"HTTP {resp.status}: {raw[:400].decode(errors='replace')}"
        return rec
    body_json = json.loads(raw)
    choice = body_json["choices"][0]
    # prompt tokens served from the prefix cache (vLLM reports them with --enable-prompt-tokens-details)
    details = (body_json.get("usage") or {}).get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        rec["cached_tokens"] = int(details["cached_tokens"])
    rec["positions"] = parse_logprobs(choice)
    rec["token_ids"] = [p["token"] for p in rec["positions"]]
    return rec


def top_k(top: dict[str, float], k: int) -> dict[str, float]:
    """The k largest entries (vLLM adds the sampled token when it is not among them)."""
    return dict(sorted(top.items(), key=lambda kv: (-kv[1], int(kv[0])))[:k])


def _compare_position(a: dict[str, float], b: dict[str, float], k: int) -> dict[str, Any]:
    ta, tb = top_k(a, k), top_k(b, k)
    common = set(ta) & set(tb)
    diffs = [abs(ta[t] - tb[t]) for t in common]
    best_a = max(ta, key=lambda t: (ta[t], -int(t))) if ta else None
    best_b = max(tb, key=lambda t: (tb[t], -int(t))) if tb else None
    return {"top1_equal": best_a is not None and best_a == best_b, "overlap": len(common), "k": min(len(ta), len(tb)),
            "identical": sum(ta[t] == tb[t] for t in common), "max_abs_diff": max(diffs) if diffs else None,
            "spread_a": (max(ta.values()) - min(ta.values())) if ta else None}


def compare_logprobs(a: dict[str, Any], b: dict[str, Any], k: int = 20) -> dict[str, Any]:
    """Two logprob runs on the same prompts: the first generated token's top-k (same top-1, overlap of
    the id sets, max |difference| on the ids both have, bit-identical entries), then every later
    position where both runs generated the same tokens before it."""
    pa, pb = a.get("prompts") or [], b.get("prompts") or []
    if [p.get("prompt_digest") for p in pa] != [p.get("prompt_digest") for p in pb]:
        raise ValueError("compare_logprobs: the two runs did not send the same prompts (prompt_digest "
                         "differs); run both with the same --prompts/--lengths/--seed")
    per_prompt, first, later = [], [], []
    for i, (x, y) in enumerate(zip(pa, pb)):
        if x.get("error") or y.get("error") or not x.get("positions") or not y.get("positions"):
            per_prompt.append({"prompt": i, "prompt_tokens": x.get("prompt_tokens"),
                               "error": x.get("error") or y.get("error") or "no positions"})
            continue
        rows = []
        for pos, (u, v) in enumerate(zip(x["positions"], y["positions"])):
            if pos and x["token_ids"][:pos] != y["token_ids"][:pos]:
                break  # the runs took different paths: later positions are not comparable
            row = {"position": pos, **_compare_position(u["top"], v["top"], k)}
            rows.append(row)
            (first if pos == 0 else later).append(row)
        per_prompt.append({"prompt": i, "prompt_tokens": x.get("prompt_tokens"),
                           "same_tokens": x["token_ids"] == y["token_ids"], "positions": rows})

    def fold(rows: list[dict[str, Any]]) -> dict[str, Any]:
        diffs = [r["max_abs_diff"] for r in rows if r["max_abs_diff"] is not None]
        spreads = [r["spread_a"] for r in rows if r["spread_a"] is not None]
        return {"positions": len(rows), "top1_equal": sum(r["top1_equal"] for r in rows),
                "min_overlap": min((r["overlap"] for r in rows), default=None),
                "common_entries": sum(r["overlap"] for r in rows),
                "identical_entries": sum(r["identical"] for r in rows),
                "max_abs_diff": max(diffs) if diffs else None,
                "spread_min": round(min(spreads), 6) if spreads else None,
                "spread_max": round(max(spreads), 6) if spreads else None}

    return {"k": k, "prompts": len(pa), "first_token": fold(first), "later_tokens": fold(later),
            "same_tokens": sum(1 for p in per_prompt if p.get("same_tokens")), "per_prompt": per_prompt}


def describe_comparison(c: dict[str, Any]) -> str:
    f, lt = c["first_token"], c["later_tokens"]
    diff = "-" if f["max_abs_diff"] is None else f"{f['max_abs_diff']:.3g}"
    text = (f"first token, {c['prompts']} prompts: top-1 equal {f['top1_equal']}/{f['positions']}, top-{c['k']} "
            f"overlap >= {f['min_overlap']}, max |diff| {diff} over {f['common_entries']} shared entries "
            f"({f['identical_entries']} bit-identical); spread of the top-{c['k']} {f['spread_min']}-"
            f"{f['spread_max']} nats")
    if lt["positions"]:
        ldiff = "-" if lt["max_abs_diff"] is None else f"{lt['max_abs_diff']:.3g}"
        text += (f"; later tokens on the same path: {lt['positions']} positions, top-1 equal {lt['top1_equal']}, "
                 f"max |diff| {ldiff}")
    return text + f"; same generated tokens on {c['same_tokens']}/{c['prompts']} prompts"


# ---- the verify-step table -----------------------------------------------------------------------


def run_kind(run: dict[str, Any]) -> tuple[str, bool]:
    """("tq" | "bf16" | the KV dtype, speculative?) from a run's recorded vLLM arguments."""
    args = run.get("vllm_args") or {}
    kv = str(args.get("kv_cache_dtype", "auto"))
    return ("tq" if kv.startswith("turboquant") else "bf16" if kv == "auto" else kv), bool(args.get("mtp"))


def _point_ms(run: dict[str, Any] | None, point: str) -> dict[str, Any] | None:
    if not run:
        return None
    return ((run.get("steps") or {}).get("points") or {}).get(point, {}).get("step_ms")


def _fmt(s: dict[str, Any] | None, mark: str = "") -> str:
    return "-" if not s else f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f}){mark}"


def accepted_tokens(run: dict[str, Any] | None) -> float:
    points = ((run or {}).get("steps") or {}).get("points") or {}
    return sum((p.get("spec_decode") or {}).get("accepted_tokens", 0) for p in points.values())


def steps_table(runs: dict[str, dict[str, Any]], target: float = 1.10) -> list[str]:
    """Markdown rows (streams x context) of the verify-step times of runs classified by KV dtype and
    MTP: TQ+MTP, bf16+MTP, their ratio against `target`, TQ without MTP, and the drafter's share
    (step with MTP minus step without, same KV dtype); bf16 without MTP where it was measured."""
    kinds: dict[tuple[str, bool], tuple[str, dict[str, Any]]] = {}
    for name, r in runs.items():
        if (r.get("steps") or {}).get("points"):
            kinds.setdefault(run_kind(r), (name, r))
    if not kinds:
        return []
    tq, bf, tq0, bf0 = (kinds.get(k, (None, None)) for k in (("tq", True), ("bf16", True), ("tq", False),
                                                              ("bf16", False)))
    points: list[str] = []
    for _, r in kinds.values():
        for p in (r.get("steps") or {}).get("points") or {}:
            if p not in points:
                points.append(p)
    points.sort(key=lambda p: tuple(int(x) for x in p.split("x")))
    named = ", ".join(f"{k[0]}{'+MTP' if k[1] else ' no MTP'} = `{n}`" for k, (n, _) in kinds.items())
    head = ["| streams x context | TQ+MTP ms | bf16+MTP ms | TQ / bf16 (target <= {:.2f}) | TQ no-MTP ms | "
            "drafter + verify share (TQ) |".format(target)]
    if bf0[1]:
        head[0] += " bf16 no-MTP ms | drafter + verify share (bf16) |"
    cols = head[0].count("|") - 1
    out = [f"Runs: {named}. Step time in ms: median of the reps, (min-max).", "", head[0], "|" + "---|" * cols]

    def share(on: dict[str, Any] | None, off: dict[str, Any] | None) -> str:
        if not (on and off):
            return "-"
        d = on["median"] - off["median"]
        return f"{d:+.2f} ms ({100 * d / on['median']:.0f} % of the MTP step)"

    marks = {id(r): (" *" if accepted_tokens(r) else "") for _, r in kinds.values()}

    def mark(run: dict[str, Any] | None) -> str:
        return marks.get(id(run), "") if run else ""

    for p in points:
        s, c = p.split("x")
        a, b, a0 = _point_ms(tq[1], p), _point_ms(bf[1], p), _point_ms(tq0[1], p)
        if a and b:
            ratio = a["median"] / b["median"]
            rtext = f"{ratio:.3f} ({'met' if ratio <= target else 'MISSED'})"
        else:
            rtext = "-"
        row = (f"| {s} x {c} | {_fmt(a, mark(tq[1]))} | {_fmt(b, mark(bf[1]))} | {rtext} | {_fmt(a0, mark(tq0[1]))} | "
               f"{share(a, a0)} |")
        if bf0[1]:
            b0 = _point_ms(bf0[1], p)
            row += f" {_fmt(b0, mark(bf0[1]))} | {share(b, b0)} |"
        out.append(row)
    if any(marks.values()):
        out += ["", "\\* drafts were accepted in this run: a step yielded more than one token, so the figure is the "
                "time per generated token, shorter than a step."]
    return out
