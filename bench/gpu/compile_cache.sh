#!/usr/bin/env bash
# vLLM's compile cache and Triton's kernel cache, taken off a GPU host after its servers booted and put back on
# the next (fresh) host before they boot, so that the same staged release, model and settings load their
# compiled graphs and kernels instead of compiling them again. On an H100 with vLLM 0.34.0 and the slice
# (bench/results/stack-release-034-h100.json) a cold boot took 306-330 s, of which 108-111 s in the profiling
# run's compilation; the same server warm took 78 s (profiling 0.85 s).
#
#   bash bench/gpu/compile_cache.sh sizes            # the two caches' sizes (bytes) and where they are
#   bash bench/gpu/compile_cache.sh pack OUT_DIR     # both caches as zstd parts (part00, ..., MANIFEST) in OUT_DIR
#   bash bench/gpu/compile_cache.sh restore STAGE    # STAGE's parts back into the two caches (a file of the
#                                                    # same name there is replaced; others are kept)
#
# pack refuses (exit 3, nothing written) when the compressed parts would exceed CACHE_MAX (default 60M: the
# files a GPU call brings back are at most 64 MiB together) and says the sizes. PART_SIZE (default 15M: at most
# 16 MiB a file comes back) sets the parts' size. Where the caches are: VLLM_CACHE_ROOT (default
# ${XDG_CACHE_HOME:-$HOME/.cache}/vllm)/torch_compile_cache and TRITON_CACHE_DIR (default $HOME/.triton/cache),
# as vLLM and Triton choose them. Both are keyed by what they were compiled from (vLLM's compile hash: its
# config factors and sources; Triton's: the kernel source, the device's architecture and the toolchain), so a
# restored entry that does not match is never used; an H100 and an H200 are both sm_90. vLLM 0.34.0 also
# compiles again where a file dynamo traced differs on disk, but the overlay's wrappers and in-memory source
# rewrites enter its key only through compile-cache-key (which patches, their settings, the package's
# version), not their code: so pack records a digest of this checkout's src/vllm_overlay/ and restore
# refuses (exit 4, nothing restored) a cache packed from other sources, unless CACHE_ANY_SOURCES=1 (for
# changes that touch no traced code). Packing needs the zstd command or the zstandard module (device_install.sh puts one in
# $DEVICE_TMP/zs).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
tmp="${DEVICE_TMP:-/tmp}"
vllm_cache="${VLLM_CACHE_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm}/torch_compile_cache"
triton_cache="${TRITON_CACHE_DIR:-$HOME/.triton/cache}"
max="${CACHE_MAX:-60M}"
part="${PART_SIZE:-15M}"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$tmp/zs"

usage() { echo "usage: bash bench/gpu/compile_cache.sh sizes | pack OUT_DIR | restore STAGE" >&2; exit 2; }
bytes() { python3 -c 'import sys; sys.path.insert(0, sys.argv[2]); import bundle; print(bundle.size_of(sys.argv[1]))' "$1" "$here" 2>/dev/null \
  || { echo "compile_cache.sh: $2=$1: expected bytes, e.g. 60M, 512K" >&2; exit 2; }; }
size_of_dir() { if [ -d "$1" ]; then du -sb "$1" | cut -f1; else echo 0; fi; }
sources() {  # the digest of the overlay's sources in this checkout (file names and contents)
  python3 - "$here/../../src/vllm_overlay" <<'PY'
import hashlib, os, sys
root, h = sys.argv[1], hashlib.sha256()
for d, dirs, files in sorted(os.walk(root)):
    dirs[:] = sorted(x for x in dirs if x != "__pycache__")
    for f in sorted(files):
        if not f.endswith(".pyc"):
            p = os.path.join(d, f)
            h.update(os.path.relpath(p, root).encode() + b"\0" + open(p, "rb").read() + b"\0")
print(h.hexdigest())
PY
}

cmd="${1:-}"
case "$cmd" in
  sizes)
    echo "vLLM compile cache: $(size_of_dir "$vllm_cache") bytes in $vllm_cache"
    echo "Triton cache: $(size_of_dir "$triton_cache") bytes in $triton_cache"
    ;;
  pack)
    [ $# -eq 2 ] || usage
    out="$2"
    max_bytes="$(bytes "$max" CACHE_MAX)"; part_bytes="$(bytes "$part" PART_SIZE)"
    src="$tmp/compile-cache-src"; work="$tmp/compile-cache-parts"
    rm -rf "$src" "$work"; mkdir -p "$src"
    [ -d "$vllm_cache" ] && cp -a "$vllm_cache" "$src/vllm_torch_compile_cache"
    [ -d "$triton_cache" ] && cp -a "$triton_cache" "$src/triton_cache"
    if [ -z "$(ls -A "$src")" ]; then
      echo "compile_cache.sh: nothing to pack: neither $vllm_cache nor $triton_cache exists" >&2; exit 3
    fi
    sources > "$src/overlay-sources.sha256"
    python3 "$here/bundle.py" pack "$src" "$work" --part-size "$part_bytes" --level 19 > /dev/null
    packed="$(cat "$work"/part* | wc -c)"
    if [ "$packed" -gt "$max_bytes" ]; then
      echo "compile_cache.sh: the caches pack to $packed bytes, more than CACHE_MAX=$max ($max_bytes): nothing" \
           "written to $out (vLLM $(size_of_dir "$src/vllm_torch_compile_cache"), Triton" \
           "$(size_of_dir "$src/triton_cache") bytes unpacked)" >&2
      rm -rf "$src" "$work"; exit 3
    fi
    mkdir -p "$out"; cp "$work"/part* "$work"/MANIFEST "$out/"
    echo "compile_cache.sh: $(ls "$work" | grep -c '^part') parts, $packed bytes, in $out (vLLM" \
         "$(size_of_dir "$src/vllm_torch_compile_cache"), Triton $(size_of_dir "$src/triton_cache") bytes unpacked)"
    rm -rf "$src" "$work"
    ;;
  restore)
    [ $# -eq 2 ] || usage
    stage="$2"
    dest="$tmp/compile-cache-restore"
    rm -rf "$dest"
    python3 "$here/bundle.py" unpack "$stage" "$dest" > /dev/null
    packed_from="$(cat "$dest/overlay-sources.sha256" 2>/dev/null || echo none)"; now="$(sources)"
    if [ "$packed_from" != "$now" ] && [ "${CACHE_ANY_SOURCES:-0}" != 1 ]; then
      echo "compile_cache.sh: $stage was packed from other overlay sources (src/vllm_overlay digest" \
           "$packed_from, this checkout $now): nothing restored; its graphs may trace code that changed" \
           "(CACHE_ANY_SOURCES=1 restores it anyway)" >&2
      rm -rf "$dest"; exit 4
    fi
    for pair in "vllm_torch_compile_cache:$vllm_cache" "triton_cache:$triton_cache"; do
      name="${pair%%:*}"; target="${pair#*:}"
      if [ -d "$dest/$name" ]; then
        mkdir -p "$target"; cp -a "$dest/$name/." "$target/"
        echo "compile_cache.sh: restored $(size_of_dir "$dest/$name") bytes into $target"
      fi
    done
    rm -rf "$dest"
    ;;
  *) usage ;;
esac
