#!/usr/bin/env bash
# GPU benchmark wrapper: one process, bench/gpu.py, under a hard 14-minute limit; installs nothing.
#
#   bash bench/gpu.sh --out /tmp/gpu.json      # on a GPU: every configuration (~2-4 min on an H200)
#   bash bench/gpu.sh --device cpu --tiny      # CPU dry run of the script itself
#
# Arguments pass through to bench/gpu.py (--help lists them). The interpreter is $PYTHON, else python3
# (many GPU images have no `python`); it needs torch, transformers >= 5.17 and peft, nothing of fineflow's.
# bench/gpu.py's own --budget-s (default 480 s) skips what would not finish; the timeout is the backstop.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
exec timeout --kill-after=10 "${GPU_BENCH_TIMEOUT_S:-840}" "${PYTHON:-python3}" bench/gpu.py "$@"
