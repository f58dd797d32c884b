#!/usr/bin/env bash
# On the GPU host, from the checkout root, once .gpu/VERSION/ (bench/gpu/prepare.sh's parts,
# zstandard.whl and MANIFEST) has been copied there, in one copy or several:
#
#   bash bench/gpu/device_install.sh [VERSION]      # default 0.26.0
#
# Each run moves the files it finds in .gpu/VERSION/ to /tmp/stage-VERSION. While some file the
# MANIFEST names is missing it says which and exits 0; a checksum that differs exits 1, naming the
# file. Once all are there it unpacks vLLM and its wheels into /tmp/site (a /tmp/site holding another
# release is moved to /tmp/site-OLDVERSION), installs this project there (offline, no build
# isolation) and prints the versions. Once installed, a run only reinstalls the project.
# Afterwards every command that needs vLLM starts with:  export PYTHONPATH=/tmp/site
# DEVICE_TMP: another folder than /tmp (e.g. to rehearse the install on a CPU machine).
set -euo pipefail
export PYTHONUNBUFFERED=1
here="$(cd "$(dirname "$0")" && pwd)"
version="${1:-0.26.0}"
if ! [[ "$version" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  echo "device_install.sh: VERSION '$version' is not a vLLM release number such as 0.26.0" >&2; exit 2
fi
src=".gpu/$version"
tmp="${DEVICE_TMP:-/tmp}"
site="$tmp/site"
stage="$tmp/stage-$version"
mkdir -p "$stage"
for f in "$src"/part* "$src"/zstandard.whl "$src"/MANIFEST; do
  [ -f "$f" ] && mv -f "$f" "$stage/"
done

installed() {  # the vLLM version in /tmp/site once its install finished (the marker), or nothing
  # an install cut short (between unpacking vLLM and installing its wheels) has no marker and is
  # done again: on the H200 one such site lacked pydantic
  [ -f "$site/.staged-vllm" ] && cat "$site/.staged-vllm"
}

have="$(installed || true)"
if [ "$have" != "$version" ]; then
  rc=0; why="$(python3 "$here/bundle.py" check "$stage")" || rc=$?
  if [ "$rc" = 3 ]; then echo "vLLM $version: $why (from .gpu/$version/)"; exit 0; fi
  if [ "$rc" != 0 ]; then echo "vLLM $version: $why" >&2; exit 1; fi
  if [ -n "$have" ]; then
    echo "$site holds vLLM $have: moving it to $site-$have"
    rm -rf "$site-$have"; mv "$site" "$site-$have"
  elif [ -d "$site" ]; then
    echo "$site has no finished install of this script (cut short, or staged otherwise): moving it to $site-unmarked"
    rm -rf "$site-unmarked"; mv "$site" "$site-unmarked"
  fi
  rm -rf "$site" "$tmp/payload" "$tmp/zs"
  # the zstandard module unpacks the parts (pip wants the wheel's own file name back)
  cp "$stage/zstandard.whl" "$stage/zstandard-0.25.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl"
  python3 -m pip install -q --no-index --no-deps --target "$tmp/zs" "$stage"/zstandard-0.25.0-*.whl
  PYTHONPATH="$tmp/zs" python3 "$here/bundle.py" unpack "$stage" "$tmp/payload"
  mv "$tmp/payload/site" "$site"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$tmp"/payload/wheels/*.whl
  rm -rf "$tmp/payload"
  echo "$version" > "$site/.staged-vllm"
fi
# PYTHONPATH folders get no .pth processing, and CUTLASS DSL's wheel puts its `cutlass` package on the
# path through one (vLLM 0.34.0's kernel warm-up imports it on CUDA): a sitecustomize here runs the
# folder's .pth files in every process that has it on PYTHONPATH, then the one it shadows, if any
cat > "$site/sitecustomize.py" <<'SITE'
"""Written by bench/gpu/device_install.sh: runs this folder's .pth files (PYTHONPATH folders get none),
then the sitecustomize module this one shadows, if there is one."""
import importlib.util
import os
import site
import sys

_here = os.path.dirname(os.path.abspath(__file__))
site.addsitedir(_here)
for _entry in sys.path:
    if _entry and os.path.abspath(_entry) != _here:
        _path = os.path.join(_entry, "sitecustomize.py")
        if os.path.isfile(_path):
            _spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", _path)
            try:
                _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
            except Exception as _exc:  # the shadowed one's failure is its own, as Python's would be
                print(f"sitecustomize: {_path}: {_exc!r}", file=sys.stderr)
            break
SITE
if [ -f pyproject.toml ]; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target "$site" . >/dev/null
fi
PYTHONPATH="$site" python3 - "$version" <<'PY'
import sys, torch, vllm, importlib.util
if vllm.__version__ != sys.argv[1]:
    sys.exit(f"device_install.sh: the staged site holds vLLM {vllm.__version__}, expected {sys.argv[1]}")
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
extra = ""
if importlib.util.find_spec("nvidia_cutlass_dsl"):  # its .pth, run by the site's sitecustomize
    extra = " | cutlass " + ("found" if importlib.util.find_spec("cutlass") else "NOT FOUND")
print("vllm", vllm.__version__, "| torch", torch.__version__, "|", gpu + extra)
PY
