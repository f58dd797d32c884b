"""The wheels a vLLM release needs beyond a GPU host's packages: vLLM's Requires-Dist walked
recursively for that host (CPython 3.12 on Linux x86_64, manylinux up to 2_35, as prepare.sh
downloads), stopping at every requirement the host's installed version meets. Metadata only: pip
resolves each step with --dry-run --no-deps and reports the chosen wheel's Requires-Dist, nothing
is downloaded. Run on a machine with a package index:

  python3 bench/gpu/walk_requirements.py VERSION --image HOST-PACKAGES.txt \
      [--prefer bench/gpu/device-wheels-0.26.0.txt] [--carry torch --carry triton] \
      [--leave-out flashinfer-python ...] [--reuse numba ...] [--dist-info vllm-VERSION.dist-info]

--image: the host's `pip list --format=freeze`. --prefer: a proven list whose version of a package is
taken where the requirement allows it (else the newest wheel that meets it). --carry NAME: carried
even where the host has a version (its requirement still decides the version). --leave-out NAME: not
carried and not walked (optional at run time). --reuse NAME: the host's version is used even where
it is outside the requirement (say why in the README). --dist-info: read vLLM's own METADATA from an
unpacked wheel instead of asking the index.

Prints the carried wheels, one name==version a line (a device-wheels list), and on stderr every
requirement decided, with who asked for it: reused (host's version meets it), reused despite the
requirement (--reuse), left out, carried.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import defaultdict

try:
    from packaging.markers import Marker
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version
except ImportError:  # pip vendors packaging
    from pip._vendor.packaging.markers import Marker  # type: ignore[no-redef]
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.specifiers import SpecifierSet  # type: ignore[no-redef]
    from pip._vendor.packaging.version import Version  # type: ignore[no-redef]

ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "os_name": "posix",
       "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
       "platform_release": "", "platform_version": "", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "implementation_version": "3.12.3"}
# every manylinux tag from 2_35 down (NCCL's wheels are manylinux_2_18, CUPTI's 2_25, NVRTC's 2_12)
PLATFORMS = [f"manylinux_2_{m}" for m in range(35, 4, -1)] + ["manylinux2014", "manylinux2010", "manylinux1"]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_list(path: str) -> dict[str, str]:
    out = {}
    for line in open(path):
        line = line.split("#")[0].strip()
        if line and "==" in line:
            name, _, ver = line.partition("==")
            out[norm(name)] = ver.strip()
    return out


def applies(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**ENV, "extra": e}) for e in (extras or {""}))


def resolve(specs: dict[str, str]) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, requires_dist) for each `name<spec>`, newest wheel that fits, no deps."""
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed", "--no-deps",
           "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    for p in PLATFORMS:
        cmd += ["--platform", f"{p}_x86_64"]
    cmd += ["--platform", "any"]
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "r.json")
        cmd += ["--target", os.path.join(tmp, "t"), "--report", report, *[f"{n}{s}" for n, s in specs.items()]]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode:
            sys.exit(f"walk: pip could not resolve {sorted(specs.items())}:\n{run.stderr[-3000:]}")
        got = json.load(open(report))["install"]
    return {norm(i["metadata"]["name"]): (i["metadata"]["version"], i["metadata"].get("requires_dist") or [])
            for i in got}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("version")
    ap.add_argument("--image", required=True)
    ap.add_argument("--prefer", default="")
    ap.add_argument("--carry", action="append", default=[])
    ap.add_argument("--leave-out", action="append", default=[])
    ap.add_argument("--reuse", action="append", default=[])
    ap.add_argument("--dist-info", default="")
    a = ap.parse_args()
    image = read_list(a.image)
    prefer = read_list(a.prefer) if a.prefer else {}
    carry, leave, reuse = ({norm(n) for n in x} for x in (a.carry, a.leave_out, a.reuse))

    if a.dist_info:
        from email.parser import Parser

        meta = Parser().parse(open(os.path.join(a.dist_info, "METADATA")))
        root_reqs = meta.get_all("Requires-Dist") or []
    else:
        root_reqs = resolve({"vllm": f"=={a.version}"})["vllm"][1]

    asked: dict[str, list[tuple[str, Requirement]]] = defaultdict(list)  # name -> (who, requirement)
    extras: dict[str, set[str]] = defaultdict(set)
    chosen: dict[str, tuple[str, list[str]]] = {}
    decided: dict[str, str] = {}
    queue = [("vllm", r) for r in root_reqs]
    while queue:
        for who, text in queue:
            req = Requirement(text) if isinstance(text, str) else text
            if not applies(req, extras[who] if who != "vllm" else set()):
                continue
            n = norm(req.name)
            asked[n].append((who, req))
            new_extras = set(req.extras) - extras[n]
            extras[n] |= set(req.extras)
            if new_extras and n in chosen:  # walk the new extras' requirements too
                chosen.pop(n)
        queue = []
        todo: dict[str, str] = {}
        for n, reqs in asked.items():
            spec = SpecifierSet(",".join(str(r.specifier) for _, r in reqs if str(r.specifier)))
            if n in leave:
                decided[n] = "left out"
                continue
            if n in image and n not in carry:
                if spec.contains(Version(image[n]), prereleases=True):
                    decided[n] = f"reused: host has {image[n]}"
                    continue
                if n in reuse:
                    decided[n] = f"reused despite the requirement: host has {image[n]}"
                    continue
            if n in chosen and spec.contains(Version(chosen[n][0]), prereleases=True):
                continue
            pin = prefer.get(n)
            todo[n] = f"=={pin}" if pin and spec.contains(Version(pin), prereleases=True) else str(spec)
        if not todo:
            break
        got = resolve(todo)
        for n, (ver, reqs) in got.items():
            chosen[n] = (ver, reqs)
            decided[n] = f"carried: {ver}"
            queue += [(n, r) for r in reqs]
    for n in sorted(asked):
        who = "; ".join(sorted({f"{w} {r.name}{r.specifier}{'[' + ','.join(sorted(r.extras)) + ']' if r.extras else ''}" for w, r in asked[n]}))
        print(f"{n:36s} {decided.get(n, '?'):48s} <- {who}", file=sys.stderr)
    for n in sorted(chosen):
        if decided.get(n, "").startswith("carried"):
            print(f"{n}=={chosen[n][0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
