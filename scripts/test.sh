#!/usr/bin/env bash
# The test command (what CI runs through .ci/run): sets up .venv if needed, then runs every test,
# the real-engine ones included (they boot vLLM's CPU build; about 20 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
