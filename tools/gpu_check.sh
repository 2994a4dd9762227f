#!/usr/bin/env bash
# The one prepared GPU check: run on a lent GPU machine (see DEVELOPERS notes on `device`).
# Installs the project, runs the tests marked `gpu`, writes logs to $OUT/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
tools/ensure_venv.sh dev > "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
.venv/bin/python -m pytest -m gpu -q -s 2>&1 | tee "$OUT/pytest_gpu.log"
rc=${PIPESTATUS[0]}
exit "$rc"
