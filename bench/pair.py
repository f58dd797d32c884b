"""Decode step time of two serving servers measured in alternation, and their ratio round by round.

  python3 bench/pair.py A B [--streams 1,16] [--contexts 2048] [--tokens 128] [--reps 8] [--warmup 1]
      [--out FILE]

A and B are labels that `bench/stack.py boot` started and that serve now (their state in
$STACK_STATE_DIR, default /tmp/stack), e.g. the overlay and stock vLLM on one GPU. Per point
(streams x context), the rounds alternate A B, B A, A B, B A, ...: each pair of rounds gives both
servers the same prompts one right after the other, and the order flips every pair, so a slow drift
of the machine (clocks, other load) falls on both alike. A round is `bench/stack.py steps`'s: all
streams at once, the step time read from the streamed tokens (`serve_measure.step_stats`). Per pair
the ratio B / A of the two step times; per point the median ratio with its min-max and count
(`ratio`), the same over two consecutive pairs run in opposite orders, their ratios' geometric mean,
in which a drift linear over the four rounds cancels (`ratio_abba`: the one to quote; an even
--reps gives whole sets), and each server's own median, min-max and count. A round that measured
nothing (an error, an empty window) leaves its pair out, and the point takes up to two more pairs to
make up for it.

Before the first point, --warmup uncounted rounds per stream count on each server (at the smallest
context). A point whose streams do not fit a server's logged KV cache or its max_model_len is
skipped, with the reason. Writes FILE (default $OUT/pair-A-B.json, $OUT defaulting to
bench/results/stack) after every pair. Exit 0 when every point not skipped has --reps pairs; 1 when
a server is not serving or dies; 4 when rounds failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the project root: bench is a package
from bench import serve_measure as sm  # noqa: E402 - stdlib only
from bench.stack import measure, server  # noqa: E402 - bench/stack/: the servers' state, rounds and step arithmetic

SPARE_PAIRS = 2  # pairs a point may add to make up pairs with a failed round


def round_on(label: str, st: dict[str, Any], prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    t0 = time.time()
    got = measure.run_round(st["port"], measure.served_model(st), prompts, max_tokens)
    stats = sm.step_stats(got)
    errors = [g["error"] for g in got if g.get("error")]
    return {"step_ms": stats["step_ms"], "interval_ms": stats.get("interval_ms"), "steps": stats.get("steps"),
            "wall_s": round(time.time() - t0, 2), "errors": errors[:3], **({"why": stats["why"]} if stats.get("why") else {})}


def abba(valid: list[dict[str, Any]]) -> list[float]:
    """The geometric mean of the ratios of two consecutive pairs run in opposite orders (A B then B A, or
    B A then A B), pairs taken two by two from the start: a drift that is linear over those four rounds
    cancels in it, where it biases each pair's ratio by the drift between its two rounds."""
    out, i = [], 0
    while i + 1 < len(valid):
        if valid[i]["order"] != valid[i + 1]["order"]:
            out.append(round((valid[i]["ratio"] * valid[i + 1]["ratio"]) ** 0.5, 4))
            i += 2
        else:
            i += 1
    return out


def valid_pairs(pt: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in pt["pairs"] if p["ratio"] is not None]


def summarize(pt: dict[str, Any]) -> None:
    valid = valid_pairs(pt)
    pt["a_ms"] = sm.stat([p["a"]["step_ms"] for p in valid])
    pt["b_ms"] = sm.stat([p["b"]["step_ms"] for p in valid])
    pt["ratio"] = sm.stat([p["ratio"] for p in valid])
    pt["ratio_abba"] = sm.stat(abba(valid))


def spread(st: dict[str, Any] | None) -> str:
    return f"{st['median']} ({st['min']}-{st['max']}, n={st['n']})" if st else "not measured"


def limits(label: str, st: dict[str, Any]) -> tuple[int, int, float | None]:
    args = st.get("vllm_args") or {}
    for key in ("mnbt", "max_model_len"):
        if not args.get(key):
            sys.exit(f"pair: {label}: its state has no vllm_args[{key!r}] (boot it with bench/stack.py boot)")
    return int(args["mnbt"]), int(args["max_model_len"]), measure.log_number(label, r"KV cache size: ([0-9,]+) tokens")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", help="the reference label (the ratio's denominator), e.g. stock vLLM")
    ap.add_argument("b", help="the other label")
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--contexts", default="2048", help="prompt tokens per stream")
    ap.add_argument("--tokens", type=int, default=128, help="decode steps measured per round")
    ap.add_argument("--reps", type=int, default=8, help="pairs of rounds per point")
    ap.add_argument("--warmup", type=int, default=1, help="uncounted rounds per stream count and server")
    ap.add_argument("--out", default="", help="result file (default $OUT/pair-A-B.json)")
    a = ap.parse_args(argv)
    if a.a == a.b:
        sys.exit(f"pair: A and B are both {a.a!r}: expected two labels")
    if a.tokens < 2 or a.reps < 1 or a.warmup < 0:
        sys.exit(f"pair: --tokens {a.tokens} --reps {a.reps} --warmup {a.warmup}: expected tokens >= 2, reps >= 1, "
                 "warmup >= 0")
    streams, contexts = measure.int_list(a.streams, "--streams"), measure.int_list(a.contexts, "--contexts")
    labels = (a.a, a.b)
    states = {x: server.load_state(x) for x in labels}
    for x in labels:
        if server.wait(x, 1) != 0:
            return 1
    lim = {x: limits(x, states[x]) for x in labels}
    path = a.out or os.path.join(server.out_base(), f"pair-{a.a}-{a.b}.json")
    res: dict[str, Any] = {"kind": "pair", "a": a.a, "b": a.b, "tokens": a.tokens, "reps": a.reps,
                           "order": "A B, B A, A B, ... (the order flips every pair)",
                           "vllm_args": {x: states[x].get("vllm_args") for x in labels},
                           "config": {x: states[x].get("config") for x in labels},
                           "kv_cache_tokens": {x: lim[x][2] for x in labels},
                           "points": {}, "skipped": {}, "warmups": []}

    def save() -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        server.write_json(path, res)

    def dead() -> str | None:
        return next((x for x in labels if not server.alive(states[x]["pid"])), None)

    budget = min(lim[x][0] for x in labels)
    for n in streams:
        mt = sm.max_tokens_for(n, min(contexts), a.tokens, budget)
        for w in range(a.warmup):
            for x in labels:
                r = round_on(x, states[x], [sm.prompt_ids(min(contexts), "pair-warmup", n, w, i) for i in range(n)], mt)
                res["warmups"].append({"label": x, "streams": n, **r})
                server.say(f"pair: warm-up {x} {n} x {min(contexts)}: step {r['step_ms']} ms"
                          + (f", errors {r['errors'][:2]}" if r["errors"] else ""))
    save()
    failed = False
    for n, c in [(n, c) for n in streams for c in contexts]:
        key = measure.point_key(n, c)
        mt = sm.max_tokens_for(n, c, a.tokens, budget)
        why = next((f"{x}: {m}" for x in labels if (m := measure.point_misfit(n, c, mt, lim[x][1], lim[x][2]))), None)
        if why:
            res["skipped"][key] = why
            server.say(f"pair: {key}: SKIPPED: {why}")
            save()
            continue
        pt: dict[str, Any] = {"streams": n, "context": c, "max_tokens": mt, "pairs": [], "complete": False}
        res["points"][key] = pt
        k = 0
        while k < a.reps + SPARE_PAIRS and len(valid_pairs(pt)) < a.reps:
            gone = dead()
            if gone:
                res["server_died"] = gone
                save()
                server.say(f"pair: {gone}: the server is not running any more; no further rounds")
                return 1
            prompts = [sm.prompt_ids(c, "pair", n, k, i) for i in range(n)]
            order = labels if k % 2 == 0 else labels[::-1]
            got = {x: round_on(x, states[x], prompts, mt) for x in order}
            ra, rb = got[a.a]["step_ms"], got[a.b]["step_ms"]
            pair = {"order": " ".join(order), "a": got[a.a], "b": got[a.b],
                    "ratio": round(rb / ra, 4) if ra and rb else None}
            pt["pairs"].append(pair)
            k += 1
            summarize(pt)
            save()
            server.say(f"pair: {key} pair {k} ({pair['order']}): {a.a} {ra} ms, {a.b} {rb} ms, {a.b} / {a.a} "
                      f"{pair['ratio']}" + "".join(f", {x} ERRORS {got[x]['errors'][:2]}" for x in labels
                                                  if got[x]["errors"])
                      + "".join(f", {x} measured nothing: {got[x]['why']}" for x in labels if got[x].get("why")))
        pt["complete"] = len(valid_pairs(pt)) >= a.reps
        failed |= not pt["complete"]
        save()
        server.say(f"pair: {key}: {a.a} {(pt['a_ms'] or {}).get('median')} ms, {a.b} {(pt['b_ms'] or {}).get('median')} "
                  f"ms, {a.b} / {a.a} per pair {spread(pt['ratio'])}"
                  + (f", per two pairs in opposite orders {spread(pt['ratio_abba'])}" if pt["ratio_abba"] else "")
                  + ("" if pt["complete"] else f": NOT DONE ({a.reps} pairs asked)"))
    server.say(f"pair: wrote {path}")
    return 4 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
