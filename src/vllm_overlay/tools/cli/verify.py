"""`vllm-overlay verify`: every patch's targets, rewrite hashes and anchors, and support proofs
against a vLLM release's sources (the installed vLLM, a wheel, or every release of the matrix);
`--propose` prints the spec entries for a release not in the matrix yet."""

from __future__ import annotations

import argparse
import re
import sys

from vllm_overlay import sources, versions
from vllm_overlay.tools import matrix, wheels
from vllm_overlay.errors import OverlayError


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("verify", help="check every target, hash, anchor and proof; exit 1 on drift")
    p.add_argument("--wheel", metavar="PATH", help="check this vLLM wheel's sources instead of the installed vLLM")
    p.add_argument("--version", metavar="X.Y.Z",
                   help="check the CUDA wheel of this vLLM release (from the cache, else downloaded)")
    p.add_argument("--download", action="store_true",
                   help="allowed for compatibility: --version downloads a wheel missing from the cache")
    p.add_argument("--all", action="store_true",
                   help=f"check every release of the matrix ({versions.RELEASES[0]} to {versions.RELEASES[-1]})")
    p.add_argument("--propose", action="store_true",
                   help="print the spec entries (hashes, anchors, targets, proofs) to add for this release")
    p.add_argument("--out", metavar="FILE",
                   help="with --propose: write the proposal (support rows, failing checks, and each target's "
                        "source diffed against the newest release of the matrix) to this Markdown file")
    p.add_argument("--quiet", action="store_true", help="print only failed checks and one line per release")
    p.set_defaults(func=run)


def _print_checks(checks: list[matrix.Check], quiet: bool) -> None:
    for c in checks:
        if quiet and c.ok:
            continue
        print(f"vLLM {c.version} {c.patch_id} {c.what} {c.subject}: {'ok' if c.ok else 'FAILED'}: {c.detail}")


def _one(version: str, read: sources.Reader, where: str, quiet: bool) -> int:
    if version not in versions.RELEASES:
        print(f"vLLM {version} ({where}) is not in the support matrix ({versions.RELEASES[0]} to "
              f"{versions.RELEASES[-1]}); nothing applies there. Run with --propose to compute its entries.")
        return 1
    checks = matrix.sweep(version, read)
    _print_checks(checks, quiet)
    bad = sum(not c.ok for c in checks)
    print(f"vLLM {version} ({where}): {len(checks) - bad} ok, {bad} failed")
    return 1 if bad else 0


def run(args: argparse.Namespace) -> int:
    if args.all:
        if args.wheel or args.version or args.propose:
            raise OverlayError("--all checks every release; it takes no --wheel, --version or --propose")
        failed = []
        for i, v in enumerate(versions.RELEASES, 1):
            wheel = wheels.fetch_vllm_wheel(v)
            checks = matrix.sweep(v, sources.wheel_reader(wheel))
            _print_checks(checks, quiet=True)
            bad = sum(not c.ok for c in checks)
            print(f"[{i}/{len(versions.RELEASES)}] vLLM {v}: {len(checks) - bad} ok, {bad} failed", flush=True)
            if bad:
                failed.append(v)
        print(f"{len(versions.RELEASES) - len(failed)} of {len(versions.RELEASES)} releases verified"
              + (f"; failed: {', '.join(failed)}" if failed else ""))
        return 1 if failed else 0
    if args.version and not re.fullmatch(r"[0-9]+\.[0-9]+\.[0-9]+", args.version):
        raise OverlayError(f"--version {args.version!r}: expected a vLLM release X.Y.Z (e.g. {versions.RELEASES[-1]})")
    if args.version and not args.wheel:
        args.wheel = wheels.fetch_vllm_wheel(args.version)
    if args.wheel:
        version = args.version or wheels.version_of(args.wheel)
        read, where = sources.wheel_reader(args.wheel), args.wheel
    else:
        inst = versions.installed_vllm()
        if inst is None:
            raise OverlayError("vLLM is not installed here; pass --wheel PATH or --version X.Y.Z")
        version, read, where = inst.version, sources.installed_reader(), f"installed {inst.distribution}"
    if args.out and not args.propose:
        raise OverlayError(f"--out {args.out!r}: only with --propose (it names the proposal's file)")
    if args.propose:
        for line in matrix.propose(version, read):
            print(line)
        if args.out:
            base = versions.RELEASES[-1]
            text = matrix.proposal(version, read, base, sources.wheel_reader(wheels.fetch_vllm_wheel(base)))
            with open(args.out, "w", encoding="utf-8") as f:
                f.write(text)
            print(f"proposal written to {args.out} (each target's source diffed against {base})")
        sys.stdout.flush()
        return 0
    return _one(version, read, where, args.quiet)
