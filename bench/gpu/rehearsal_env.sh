#!/usr/bin/env bash
# Makes the virtual environment of the CPU rehearsal (bench/gpu/README.md, "The CPU rehearsal"): a
# Python like the GPU host's with the host's packages at the host's versions, so that a staged bundle
# (device_install.sh with DEVICE_TMP set) imports and builds its engine configs against what the
# host really has.
#
#   bash bench/gpu/rehearsal_env.sh HOST-PACKAGES.txt VENV [PYTHON]
#
# HOST-PACKAGES.txt: the host's `python3 -m pip list --format=freeze`. VENV: the folder to make (it
# must not exist). PYTHON (default: pyenv's 3.12.1, else python3.12): a Python of the host's minor
# version. Every package is installed at the host's version without its dependencies (`--no-deps`: the
# list is the whole environment), except those LEAVE_OUT names: torch and torchvision (the bundle
# carries its own, and the host's would only be shadowed), and the families nothing in vLLM imports
# whose wheels are large or need a toolchain (JAX, ONNX, Lightning, TensorBoard, PyG, BoTorch,
# GPyTorch, CuPy, MPI). Needs a package index; about 3 GB of wheels (NVIDIA's libraries most of it).
set -euo pipefail
LEAVE_OUT='^(torch|torchvision|jax|jaxlib|jax-cuda13-pjrt|jax-cuda13-plugin|flax|chex|optax|orbax-checkpoint|numpyro|diffrax|equinox|lineax|optimistix|treescope|tensorstore|onnx|onnx-ir|onnxruntime|onnxscript|lightning|pytorch-lightning|lightning-utilities|torchmetrics|tensorboard|tensorboard-data-server|torch-geometric|botorch|gpytorch|linear-operator|cupy-cuda13x|mpi4py|e3nn|opt-einsum-fx)$'
if [ $# -lt 2 ] || [ $# -gt 3 ]; then
  echo "usage: bash bench/gpu/rehearsal_env.sh HOST-PACKAGES.txt VENV [PYTHON]" >&2; exit 2
fi
packages=$1 venv=$2
[ -f "$packages" ] || { echo "rehearsal_env.sh: HOST-PACKAGES.txt '$packages': no such file (expected the host's pip list --format=freeze)" >&2; exit 2; }
[ -e "$venv" ] && { echo "rehearsal_env.sh: VENV '$venv' exists; expected a new folder (delete it to make it again)" >&2; exit 2; }
python=${3:-}
if [ -z "$python" ]; then
  python="$HOME/.pyenv/versions/3.12.1/bin/python3"
  [ -x "$python" ] || python=$(command -v python3.12 || true)
fi
[ -n "$python" ] && [ -x "$python" ] || { echo "rehearsal_env.sh: PYTHON '${3:-}': no Python 3.12 found (pyenv's 3.12.1 or python3.12); pass one" >&2; exit 2; }
list=$(mktemp)
grep -E '^[A-Za-z0-9_.-]+==' "$packages" | while IFS= read -r line; do
  name=${line%%==*}
  norm=$(echo "$name" | tr 'A-Z_.' 'a-z--')
  if [[ "$norm" =~ $LEAVE_OUT ]] || [ "$norm" = pip ]; then continue; fi
  echo "$line"
done > "$list"
left=$(( $(grep -cE '^[A-Za-z0-9_.-]+==' "$packages") - $(wc -l < "$list") ))
echo "rehearsal_env.sh: $("$python" --version) into $venv: $(wc -l < "$list") of the host's packages, $left left out (torch, torchvision, pip and the LEAVE_OUT families)"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --no-deps -r "$list"
rm -f "$list"
echo "rehearsal_env.sh: done: $("$venv/bin/python" -m pip list --format=freeze 2>/dev/null | wc -l) distributions in $venv"
