#!/usr/bin/env bash
# The GPU acceptance run (bench/gpu.py): the real train stage on every configuration this machine can host.
#
#   bash bench/gpu.sh --out gpu.json           # after the README's install (make venv): ~10 min at most
#   bash bench/gpu.sh --device cpu --tiny      # the same plumbing on the CPU, tiny model
#
# The interpreter is the project's .venv/bin/python (what `make venv` builds: torch, transformers, peft,
# accelerate, dvc, fineflow); without a .venv, $PYTHON (it needs the same installed). It says which it uses.
# Arguments pass through to bench/gpu.py (--help lists them). Its --budget-s (default 540 s) skips what would
# not finish; the timeout here (GPU_BENCH_TIMEOUT_S, default 600 s) is the backstop.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -x .venv/bin/python ]]; then
    python=.venv/bin/python
elif [[ -n "${PYTHON:-}" ]]; then
    python=$PYTHON
else
    echo "bench/gpu.sh: no .venv/bin/python (run \`make venv\` first) and no \$PYTHON set" >&2
    exit 2
fi
echo "bench/gpu.sh: interpreter $python" >&2
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false DVC_NO_ANALYTICS=1 TOKENIZERS_PARALLELISM=false
exec timeout --kill-after=10 "${GPU_BENCH_TIMEOUT_S:-600}" "$python" bench/gpu.py "$@"
