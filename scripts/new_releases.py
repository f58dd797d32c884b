"""Ask the package index for vLLM releases the support matrix does not know, and write a proposal for
each release newer than it. Run by a maintainer (not by CI: it reaches the package index):

    .venv/bin/python scripts/new_releases.py [--out DIR] [--list]

It reads the releases with `pip index versions vllm` (pip's configured index: PIP_INDEX_URL and pip.conf
apply; pre-releases are left out), then prints

- the releases newer than the newest of `versions.RELEASES`: for each, unless --list, it runs
  `vllm-overlay verify --download --version X --propose --out DIR/proposal-vllm-X.md` (the CUDA wheel
  downloads once into ~/.cache/vllm-overlay/wheels, about 250 MB);
- the releases from 0.20.0 on, older than the newest of the matrix, that are in neither
  `versions.RELEASES` nor `versions.LEFT_OUT`: each needs a decision (into the matrix, or left out with
  its reason).

DIR/releases.json records the lists. Exit status: 0, 1 where a release is in neither list, 2 where the
index could not be read or a proposal failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

from packaging.version import InvalidVersion, Version

from vllm_overlay import versions

FIRST = Version("0.20.0")


def index_releases() -> list[str]:
    """The vLLM releases the package index lists (pip index versions: final releases only)."""
    proc = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "vllm", "--disable-pip-version-check"],
                          capture_output=True, text=True, timeout=300)
    found = re.search(r"^Available versions: (.*)$", proc.stdout, re.M)
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"pip index versions vllm (exit {proc.returncode}): {(proc.stderr or proc.stdout)[-800:]}")
    out = []
    for text in found.group(1).split(","):
        try:
            v = Version(text.strip())
        except InvalidVersion:
            continue
        if not v.is_prerelease and not v.is_devrelease:
            out.append(str(v))
    return sorted(set(out), key=Version)


def classify(releases: list[str]) -> dict[str, list[str]]:
    newest = Version(versions.RELEASES[-1])
    newer = [v for v in releases if Version(v) > newest]
    neither = [v for v in releases if FIRST <= Version(v) <= newest
               and v not in versions.RELEASES and v not in versions.LEFT_OUT]
    return {"index": releases, "newer": newer, "neither": neither}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="release-proposals", metavar="DIR",
                    help="where releases.json and the proposals go (default: release-proposals)")
    ap.add_argument("--list", action="store_true", help="only list the releases; write no proposal")
    args = ap.parse_args()
    try:
        found = classify(index_releases())
    except RuntimeError as exc:
        print(f"could not read the package index: {exc}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "releases.json"), "w") as f:
        json.dump(found, f, indent=1)
    print(f"newer than the matrix (newest {versions.RELEASES[-1]}): {', '.join(found['newer']) or 'none'}")
    print(f"from {FIRST} on, in neither versions.RELEASES nor versions.LEFT_OUT: {', '.join(found['neither']) or 'none'}")
    failed = []
    for v in [] if args.list else found["newer"]:
        path = os.path.join(args.out, f"proposal-vllm-{v}.md")
        proc = subprocess.run([sys.executable, "-m", "vllm_overlay", "verify", "--download", "--version", v,
                               "--propose", "--out", path], timeout=3600)
        if proc.returncode != 0:
            failed.append(v)
        print(f"vLLM {v}: " + (f"proposal written to {path}" if proc.returncode == 0
                               else f"the proposal failed (exit {proc.returncode})"), flush=True)
    if failed:
        return 2
    return 1 if found["neither"] else 0


if __name__ == "__main__":
    sys.exit(main())
