#!/usr/bin/env bash
# Builds, in <checkout>/.gpu/VERSION/, the parts that bring vLLM 0.26.0 (CUDA 13, torch 2.11) onto a lent
# H200, whose image has torch 2.11 but no vLLM and no package registry. The project's copy of
# ../shared/gpu/prepare.sh, with three changes (see bench/gpu/README.md):
#   - wheels tagged manylinux_2_29 ... manylinux_2_33 are accepted: llguidance 1.7.x, which
#     vLLM 0.22+ pin, exists only as manylinux_2_31 wheels, and the shared script's platform list
#     skips 2_29 to 2_33, so there pip lists llguidance up to 1.6.1 only;
#   - the parts go to .gpu/VERSION/ (beside the 0.20.2 parts of the shared script in .gpu/) with a
#     MANIFEST of their checksums, for bench/gpu/device_install.sh (tracked, so it travels with
#     the tree), which waits for every part and moves a /tmp/site of another release aside;
#   - it works from a git worktree (there .git is a file).
# Run it from the root of the project checkout (about 3-5 minutes):
#   bash bench/gpu/prepare.sh                              # vLLM 0.26.0, bench/gpu/device-wheels-0.26.0.txt
#   VLLM_VERSION=X DEVICE_WHEELS=list.txt bash bench/gpu/prepare.sh
# (DEVICE_WHEELS: the wheels that release needs beyond the image; /work/shared/gpu/h200-image-packages.txt
#  lists what the image has. Delete .gpu/VERSION/ to rebuild after changing either.)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(git rev-parse --show-toplevel)"
VLLM_VERSION=${VLLM_VERSION:-0.26.0}
if ! [[ "$VLLM_VERSION" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  echo "VLLM_VERSION=$VLLM_VERSION: expected a vLLM release number such as 0.26.0" >&2; exit 2
fi
out="$root/.gpu/$VLLM_VERSION"
DEVICE_WHEELS=${DEVICE_WHEELS:-$here/device-wheels-$VLLM_VERSION.txt}
[ -f "$DEVICE_WHEELS" ] || { echo "DEVICE_WHEELS=$DEVICE_WHEELS: no such file (expected a pip requirements list, one name==version a line)" >&2; exit 2; }
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$out"
git check-ignore -q "$out" || echo '/.gpu/' >> "$exclude"
if [ -f "$out/MANIFEST" ]; then
  echo "parts already in $out (delete the folder to rebuild)"; ls -la "$out"; exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
for p in manylinux_2_35 manylinux_2_34 manylinux_2_33 manylinux_2_32 manylinux_2_31 manylinux_2_30 \
         manylinux_2_29 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  plat+=(--platform "${p}_x86_64")
done
plat+=(--platform any)
echo "downloading vLLM $VLLM_VERSION and the wheels in $DEVICE_WHEELS ..."
python3 -m pip download -q --no-deps "${plat[@]}" -d "$work/dl" "vllm==$VLLM_VERSION"
python3 -m pip download -q --no-deps "${plat[@]}" -d "$work/payload/wheels" -r <(grep -v '^#' "$DEVICE_WHEELS" | sort -u)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$work/z" zstandard==0.25.0
cp "$work"/z/zstandard-*.whl "$out/zstandard.whl"
mkdir -p "$work/payload/site"
( cd "$work/payload/site" && python3 -m zipfile -e "$work"/dl/vllm-"$VLLM_VERSION"-*.whl . )
# FlashAttention 3 is not used (TurboQuant forces FA2 and the H200 runs fine on FA2): drop 150 MB.
# Without it vLLM picks FA2 on Hopper (vllm/v1/attention/backends/fa_utils.py, get_flash_attn_version).
rm -f "$work/payload/site/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"
# The Rust frontend binary (43 MB, 11 MB packed) runs only with VLLM_USE_RUST_FRONTEND=1 (vllm/envs.py);
# without it the last part leaves room for zstandard.whl within one call's 64 MiB.
rm -f "$work/payload/site/vllm/vllm-rs"
echo "compressing (about two minutes) ..."
tar -C "$work/payload" -cf - site wheels | zstd -q -T0 -19 --long=27 -o "$work/payload.tar.zst"
rm -f "$out"/part*
split -b 56M -d "$work/payload.tar.zst" "$out/part"
( cd "$out" && sha256sum part* zstandard.whl > MANIFEST )
ls -la "$out"
echo "done: vLLM $VLLM_VERSION, $(ls "$out"/part* | wc -l) parts, $(du -cb "$out"/part* | tail -1 | cut -f1) bytes; see bench/gpu/README.md for the run calls"
