#!/usr/bin/env bash
# Runs ON the lent GPU machine, from the checkout root:   bash bench/gpu/device_install.sh [VERSION]
# (VERSION: the vLLM release staged by bench/gpu/prepare.sh; default 0.26.0; its parts lie in
#  .gpu/VERSION/ and are carried over one or two per `run` call).
# Every call moves the parts it finds into /tmp/stage-VERSION. Once all parts named in
# .gpu/VERSION/MANIFEST are there and their checksums match, it reassembles them, unpacks vLLM and
# its missing wheels into /tmp/site (a /tmp/site holding another vLLM release is moved aside to
# /tmp/site-OLDVERSION), installs the project itself there (offline, no build isolation) and
# prints the versions; before that it only says which parts are still missing and exits 0.
# Idempotent: once installed, a call only reinstalls the project.
# Afterwards, every command that needs vLLM starts with:  export PYTHONPATH=/tmp/site
set -euo pipefail
export PYTHONUNBUFFERED=1
version="${1:-0.26.0}"
if ! [[ "$version" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  echo "device_install.sh: VERSION '$version' is not a vLLM release number such as 0.26.0" >&2; exit 2
fi
src=".gpu/$version"
tmp="${DEVICE_TMP:-/tmp}"  # another folder only to rehearse the install off the GPU machine
site="$tmp/site"
stage="$tmp/stage-$version"
mkdir -p "$stage"
for f in "$src"/part* "$src"/zstandard.whl "$src"/MANIFEST; do
  [ -f "$f" ] && mv -f "$f" "$stage/"
done

installed() {  # the vLLM version in /tmp/site once its install finished (the marker), or nothing
  # an install cut short (the call ended between unpacking vLLM and installing its wheels) has no
  # marker and is done again: on the H200 one such site lacked pydantic
  [ -f "$site/.staged-vllm" ] && cat "$site/.staged-vllm"
}

have="$(installed || true)"
if [ "$have" != "$version" ]; then
  if [ ! -f "$stage/MANIFEST" ]; then
    echo "vLLM $version: no MANIFEST yet in $stage (carry .gpu/$version/MANIFEST with a part)"; exit 0
  fi
  need=$(awk '{print $2}' "$stage/MANIFEST")
  missing=""
  for n in $need; do [ -f "$stage/$n" ] || missing="$missing $n"; done
  if [ -n "$missing" ]; then
    echo "vLLM $version: still to carry:$missing (from .gpu/$version/)"; exit 0
  fi
  ( cd "$stage" && sha256sum --quiet -c MANIFEST ) || { echo "vLLM $version: a part's checksum differs from MANIFEST: carry it again" >&2; exit 1; }
  if [ -n "$have" ]; then
    echo "$site holds vLLM $have: moving it to $site-$have"
    rm -rf "$site-$have"; mv "$site" "$site-$have"
  elif [ -d "$site" ]; then
    echo "$site has no finished install of this script (cut short, or staged by another script): moving it to $site-unmarked"
    rm -rf "$site-unmarked"; mv "$site" "$site-unmarked"
  fi
  rm -rf "$site" "$tmp/payload" "$tmp/zs"
  # pip wants a wheel's own file name back
  cp "$stage/zstandard.whl" "$stage/zstandard-0.25.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl"
  python3 -m pip install -q --no-index --no-deps --target "$tmp/zs" "$stage"/zstandard-0.25.0-*.whl
  PYTHONPATH="$tmp/zs" python3 - "$stage" "$tmp/payload" <<'PY'
import glob, io, sys, tarfile, zstandard
parts = sorted(glob.glob(sys.argv[1] + "/part*"))
class Cat(io.RawIOBase):
    def __init__(self, files): self.fs = [open(f, "rb") for f in files]; self.i = 0
    def readable(self): return True
    def readinto(self, b):
        while self.i < len(self.fs):
            n = self.fs[self.i].readinto(b)
            if n: return n
            self.i += 1
        return 0
reader = zstandard.ZstdDecompressor(max_window_size=2**31).stream_reader(io.BufferedReader(Cat(parts), 1 << 20))
with tarfile.open(fileobj=reader, mode="r|") as tar:
    tar.extractall(sys.argv[2])
print("unpacked", len(parts), "parts")
PY
  mv "$tmp/payload/site" "$site"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$tmp"/payload/wheels/*.whl
  rm -rf "$tmp/payload"
  echo "$version" > "$site/.staged-vllm"
fi
if [ -f pyproject.toml ]; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target "$site" . >/dev/null
fi
PYTHONPATH="$site" python3 - "$version" <<'PY'
import sys, torch, vllm
if vllm.__version__ != sys.argv[1]:
    sys.exit(f"device_install.sh: the staged site holds vLLM {vllm.__version__}, expected {sys.argv[1]}")
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
print("vllm", vllm.__version__, "| torch", torch.__version__, "|", gpu)
PY
