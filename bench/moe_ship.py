"""Which tuned fused-MoE configs ship with vllm-overlay: the rule applied to what `vllm-overlay tune-moe`
measured on a device, never by hand.

  python bench/moe_ship.py TUNE_OUT_DIR                   # the table and the decision; writes nothing
  python bench/moe_ship.py TUNE_OUT_DIR --write DEST      # also writes the shipped files into DEST
                                                          # (src/vllm_overlay/moe_configs for a release)

TUNE_OUT_DIR is a `tune-moe --out-dir` folder: its config files and their `tune-state/*.state.json`.
A shipped config changes what every user on that device runs without asking, so the bar is higher
than tune-moe's own (which keeps a winner whose re-timed median is lower): a batch size ships its
tuned config only where tune-moe's re-timing says "faster beyond the spread" (every one of its tuned
timings below every timing of vLLM's config). Every other batch size of the file holds vLLM's own
config for that size, as tune-moe recorded it, so the shipped file never runs a size differently
from vLLM where no gain was measured. A shape with no such batch size ships nothing. The table
gives, per tuned batch size: the re-timed medians and ranges, their ratio, tune-moe's verdict and
whether it ships (markdown, for docs/moe.md).

Exit codes: 0 (whatever ships or not), 2 bad usage (a folder without tune-state, an unreadable state).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from typing import Any

BEYOND = "faster beyond the spread"


def decide(state: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per tuned batch size of a state file: its figures and whether its tuned config ships."""
    rows = []
    for b, rec in sorted(state["batches"].items(), key=lambda kv: int(kv[0])):
        c = rec.get("confirm") or {}
        ships = c.get("verdict") == BEYOND  # tune-moe says so only of a winner it kept
        if c:
            why = c["verdict"]
        elif rec["config"] == rec["default_config"]:
            why = "vLLM's config was the fastest"
        elif rec.get("default_us") is None:
            why = "vLLM's config failed to run in the search: no comparison"
        else:
            why = "not re-timed (--confirm 0): no evidence"
        rows.append({"batch": int(b), "ships": ships, "why": why, "confirm": c or None,
                     "config": rec["config"], "default_config": rec["default_config"],
                     "search_us": rec.get("us"), "search_default_us": rec.get("default_us")})
    return rows


def shipped_file(config_file: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The file to ship: the tuned configs of the rows that ship, vLLM's own config at every other
    batch size; None when no row ships."""
    if not any(r["ships"] for r in rows):
        return None
    out = dict(config_file)
    for r in rows:
        out[str(r["batch"])] = dict(r["config"] if r["ships"] else r["default_config"])
    return out


def table(name: str, meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [f"{name} ({meta.get('device')}, vLLM {meta.get('vllm')}, Triton {meta.get('triton')}, "
             f"{meta.get('search')} search)", "",
             "| batch | vLLM's config us | tuned us | vLLM / tuned | re-timing | ships |", "|---|---|---|---|---|---|"]
    for r in rows:
        c = r["confirm"]
        if c and c.get("default_median") and c.get("tuned_median"):
            d, t = c["default_us"], c["tuned_us"]
            lines.append(f"| {r['batch']} | {c['default_median']:.1f} ({min(d):.1f}-{max(d):.1f}) | "
                         f"{c['tuned_median']:.1f} ({min(t):.1f}-{max(t):.1f}) | "
                         f"{c['default_median'] / c['tuned_median']:.3f} x | {r['why']} | {'yes' if r['ships'] else 'no'} |")
        else:
            su = r["search_default_us"]
            lines.append(f"| {r['batch']} | {su if su is not None else '-'} | {r['search_us']} | - | {r['why']} | "
                         f"{'yes' if r['ships'] else 'no'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tune_dir", help="a `vllm-overlay tune-moe --out-dir` folder")
    ap.add_argument("--write", metavar="DEST", help="write the files that ship into DEST")
    args = ap.parse_args(argv)
    states = sorted(glob.glob(os.path.join(args.tune_dir, "tune-state", "*.state.json")))
    if not states:
        print(f"moe_ship: {args.tune_dir!r} holds no tune-state/*.state.json; expected a tune-moe --out-dir folder",
              file=sys.stderr)
        return 2
    for path in states:
        name = os.path.basename(path).removesuffix(".state.json") + ".json"
        try:
            with open(path) as f:
                state = json.load(f)
            with open(os.path.join(args.tune_dir, name)) as f:
                config_file = json.load(f)
            rows = decide(state)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"moe_ship: {path}: cannot read the state or its config file {name} ({exc!r}); expected what "
                  "tune-moe writes", file=sys.stderr)
            return 2
        print(table(name, state.get("meta", {}), rows))
        ship = shipped_file(config_file, rows)
        shipping = [r["batch"] for r in rows if r["ships"]]
        if ship is None:
            print(f"\n{name}: nothing ships (no batch size faster beyond the spread)\n")
            continue
        sizes = [k for k in ship if k != "triton_version"]
        print(f"\n{name}: ships the tuned config at batch sizes {', '.join(map(str, shipping))}; vLLM's own "
              f"config at the other {len(sizes) - len(shipping)} of the file's {len(sizes)}\n")
        if args.write:
            os.makedirs(args.write, exist_ok=True)
            dest = os.path.join(args.write, name)
            with open(dest, "w") as f:
                json.dump(ship, f, indent=4)
                f.write("\n")
            print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
