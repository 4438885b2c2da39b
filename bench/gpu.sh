#!/usr/bin/env bash
# GPU benchmark wrapper: runs bench/gpu.py under a 9-minute limit; installs nothing.
#
#   bash bench/gpu.sh                  # ~3 min on an H200 (2 min measured)
#   bash bench/gpu.sh --smoke          # CPU check of the script itself
#
# Uses the project's .venv when present, else the python on PATH (which must have torch with CUDA,
# transformers, peft and numpy).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || PY=python
exec timeout --kill-after=10 540 "$PY" bench/gpu.py "$@"
