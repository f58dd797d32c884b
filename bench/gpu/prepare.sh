#!/usr/bin/env bash
# Builds the offline bundle that brings vLLM VERSION onto a GPU host without a package index, whose
# Python already has torch (the H200 image of 2026-12-01: Python 3.12.3, torch 2.11.0+cu130):
#
#   bash bench/gpu/prepare.sh [VERSION]          # default 0.26.0; from the checkout root, 3-5 minutes
#   ZSTD_LEVEL=9 bash bench/gpu/prepare.sh 0.33.0   # a release that carries torch: 2 minutes
#   KERNELS_ONLY=1 bash bench/gpu/prepare.sh 0.26.0 # vLLM's ops without its attention kernels (below)
#
# writes .gpu/VERSION/: part00, part01, ... (vLLM's wheel unpacked and the wheels it needs beyond the
# host's packages, one zstd-compressed tar split into parts of at most PART_SIZE, default 48M, for a
# transport that limits file size; PART_SIZE=0: one part), zstandard.whl (what the host needs to
# unpack them) and MANIFEST (sha256 sums). Copy .gpu/VERSION/ to the host's checkout, in as many
# copies as the transport needs, and run bench/gpu/device_install.sh VERSION there.
# DEVICE_WHEELS (default bench/gpu/device-wheels-VERSION.txt): the wheels the release needs beyond the
# host's packages, one name==version a line (bench/gpu/README.md says how the lists were made).
# HOST_PACKAGES: the GPU host's `python3 -m pip list --format=freeze`; where the release has no list yet,
# prepare.sh makes bench/gpu/device-wheels-VERSION.txt from it with bench/gpu/walk_requirements.py.
# ZSTD_LEVEL (default 19): the compression level. A release that carries torch is 2.2 GB to pack, mostly
# wheels (deflated already): on 2 busy cores level 9 packed 0.33.0 in about a minute, where level 19
# had written 94 MB of parts after 4 minutes (2026-12-01).
# Needs pip with access to a package index, and zstd (the command, or Python's zstandard module).
# Delete .gpu/VERSION/ to rebuild.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(git rev-parse --show-toplevel)"
VLLM_VERSION=${1:-${VLLM_VERSION:-0.26.0}}
if ! [[ "$VLLM_VERSION" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  echo "prepare.sh: VERSION '$VLLM_VERSION' is not a vLLM release number such as 0.26.0" >&2; exit 2
fi
out="$root/.gpu/$VLLM_VERSION"
if [ -n "${DEVICE_WHEELS:-}" ]; then
  [ -f "$DEVICE_WHEELS" ] || { echo "DEVICE_WHEELS=$DEVICE_WHEELS: no such file (expected a pip requirements list, one name==version a line)" >&2; exit 2; }
else
  DEVICE_WHEELS="$here/device-wheels-$VLLM_VERSION.txt"
fi
if [ ! -f "$DEVICE_WHEELS" ]; then
  # no list for this release yet: made from the host's packages with the decisions of the 0.34.0 list
  # (bench/gpu/README.md, "vLLM 0.33.0" and "vLLM 0.34.0": the image's numba, setuptools, numpy,
  # cuBLAS and cuSPARSELt reused outside their pins; transformers carried (the image's 5.17.0 refuses
  # the huggingface-hub 2.x that 0.34.0 needs); FlashInfer, cuDNN and the other optional packages left
  # out (CUTLASS DSL and QuACK no longer: 0.34.0's kernel warm-up imports both on CUDA); the 0.26.0
  # list's versions preferred where a requirement allows them). torch, triton and NCCL are carried when
  # the release pins another version than the host has.
  if [ -z "${HOST_PACKAGES:-}" ]; then
    echo "prepare.sh: no wheel list for vLLM $VLLM_VERSION ($DEVICE_WHEELS). Set HOST_PACKAGES=FILE, the GPU host's" \
      "\`python3 -m pip list --format=freeze\`, to make one with bench/gpu/walk_requirements.py, or DEVICE_WHEELS=FILE" \
      "to use a list of your own" >&2
    exit 2
  fi
  [ -f "$HOST_PACKAGES" ] || { echo "HOST_PACKAGES=$HOST_PACKAGES: no such file (expected the GPU host's pip list --format=freeze)" >&2; exit 2; }
  walk=(--prefer "$here/device-wheels-0.26.0.txt"
        --reuse numba --reuse setuptools --reuse numpy --reuse cuda-toolkit --reuse nvidia-cublas
        --reuse nvidia-cusparselt-cu13 --carry transformers
        --leave-out flashinfer-python
        --leave-out tilelang --leave-out tokenspeed-mla --leave-out humming-kernels --leave-out PyNvVideoCodec
        --leave-out torchcodec --leave-out fastsafetensors --leave-out nvidia-cudnn-frontend
        --leave-out instanttensor --leave-out nvidia-cudnn-cu13)
  echo "no wheel list for vLLM $VLLM_VERSION: walking its requirements against $HOST_PACKAGES (metadata only, a few minutes) ..."
  made="$(mktemp)"
  python3 "$here/walk_requirements.py" "$VLLM_VERSION" --image "$HOST_PACKAGES" "${walk[@]}" \
    > "$made" 2> "$made.decisions" || { cat "$made.decisions" >&2; rm -f "$made" "$made.decisions"; exit 1; }
  { echo "# vLLM $VLLM_VERSION: the wheels beyond the host's packages, made by prepare.sh on $(date -u +%Y-%m-%d) with"
    echo "# bench/gpu/walk_requirements.py $VLLM_VERSION --image $(basename "$HOST_PACKAGES") ${walk[*]//$root\//}"
    echo "# (the decisions, requirement by requirement: $(basename "$DEVICE_WHEELS" .txt).decisions.txt)"
    cat "$made"; } > "$DEVICE_WHEELS"
  mv "$made.decisions" "${DEVICE_WHEELS%.txt}.decisions.txt"; rm -f "$made"
  echo "wrote $DEVICE_WHEELS ($(grep -vc '^#' "$DEVICE_WHEELS") wheels) and ${DEVICE_WHEELS%.txt}.decisions.txt; review them" \
    "(bench/gpu/README.md says what each decision means) before running the release on a GPU"
fi
if [ -f "$out/MANIFEST" ]; then
  echo "parts already in $out (delete the folder to rebuild)"; ls -la "$out"; exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# cp312 wheels for every manylinux x86_64 tag up to 2_35: llguidance 1.7.x, which vLLM 0.22+ pin,
# exists only as manylinux_2_31 wheels; NCCL's wheels (torch 2.13+ pin them) are manylinux_2_18,
# CUPTI's 2_25, NVRTC's 2_12
plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
for m in $(seq 35 -1 5); do plat+=(--platform "manylinux_2_${m}_x86_64"); done
for p in manylinux2014 manylinux2010 manylinux1; do plat+=(--platform "${p}_x86_64"); done
plat+=(--platform any)
echo "downloading vLLM $VLLM_VERSION and the wheels in $DEVICE_WHEELS ..."
python3 -m pip download -q --no-deps "${plat[@]}" -d "$work/dl" "vllm==$VLLM_VERSION"
python3 -m pip download -q --no-deps "${plat[@]}" -d "$work/payload/wheels" -r <(grep -v '^#' "$DEVICE_WHEELS" | sort -u)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$work/z" zstandard==0.25.0
cp "$work"/z/zstandard-*.whl "$work/zstandard.whl"
mkdir -p "$work/payload/site"
( cd "$work/payload/site" && python3 -m zipfile -e "$work"/dl/vllm-"$VLLM_VERSION"-*.whl . )
# FlashAttention 3 is not used (TurboQuant forces FA2 and the H200 runs fine on FA2): drop 150 MB.
# Without it vLLM picks FA2 on Hopper (vllm/v1/attention/backends/fa_utils.py, get_flash_attn_version).
rm -f "$work/payload/site/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"
# The Rust frontend binary (43 MB, 11 MB packed) runs only with VLLM_USE_RUST_FRONTEND=1 (vllm/envs.py).
rm -f "$work/payload/site/vllm/vllm-rs"
# KERNELS_ONLY=1: for kernel benchmarks that import vLLM's ops and serve nothing (bench/moe_decode_kernel.py):
# FlashAttention 2 and the bundled DeepGEMM and FMHA sources are left out too, about half the parts; a server
# started from such a bundle fails at its first attention layer. The rest of vllm/third_party stays: vLLM
# finds the GPU through its bundled pynvml (without it the platform is not CUDA and no op loads, as on an
# H100 on 2026-12-08).
if [ "${KERNELS_ONLY:-0}" = 1 ]; then
  echo "KERNELS_ONLY=1: leaving out FlashAttention 2, DeepGEMM and the FMHA sources (no server can run from these parts)"
  rm -rf "$work/payload/site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$work/payload/site/vllm/third_party/deep_gemm" \
    "$work/payload/site/vllm/third_party/fmha_sm100"
fi
echo "compressing $(du -sh "$work/payload" | cut -f1) ..."
mkdir -p "$out"
python3 "$here/bundle.py" pack "$work/payload" "$out" --part-size "${PART_SIZE:-48M}" --level "${ZSTD_LEVEL:-19}" \
  --add "$work/zstandard.whl"
ls -la "$out"
echo "done: vLLM $VLLM_VERSION in $out; on the GPU host: bash bench/gpu/device_install.sh $VLLM_VERSION"
