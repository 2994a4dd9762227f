#!/usr/bin/env bash
# The GPU check (`make gpu-check`; tools/gpu_check.sh delegates here). On a CUDA machine: the
# `gpu`-marked tests (TE layer specs, a bf16 and an FP8 train step, NCCL weight broadcast into a
# real SGLang engine when sglang is installed) and benchmarks/mfu.py (tokens/s and MFU of a
# qwen3-30b-a3b / qwen3.5-35b-a3b layer slice). Logs go to $OUT (default runs/gpu_check).
# Without a GPU it prints one line and exits 0. Each part has its own timeout, all well within
# 10 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/gpu_check}
PY=${PYTHON:-.venv/bin/python}

if ! command -v nvidia-smi > /dev/null 2>&1 || ! nvidia-smi -L > /dev/null 2>&1; then
  echo "gpu check: no CUDA GPU on this machine; nothing to run"
  exit 0
fi
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
if [ ! -x "$PY" ]; then
  tools/ensure_venv.sh dev > "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
fi
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu check: nvidia-smi sees a GPU but torch.cuda does not (see $OUT/nvidia-smi.txt)"
  exit 1
fi

rc=0
echo "== gpu-marked tests (log: $OUT/pytest_gpu.log)"
timeout "${PYTEST_TIMEOUT:-330}" "$PY" -m pytest -m gpu -q -s -p no:cacheprovider \
  tests/test_gpu.py tests/test_fp8_training.py tests/test_routing_replay.py \
  2>&1 | tee "$OUT/pytest_gpu.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1

echo "== benchmarks/mfu.py (log: $OUT/mfu.log, results: $OUT/mfu.json)"
timeout "${MFU_TIMEOUT:-210}" "$PY" benchmarks/mfu.py --json "$OUT/mfu.json" \
  2>&1 | tee "$OUT/mfu.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1

echo "gpu check: $([ $rc -eq 0 ] && echo passed || echo FAILED) (logs in $OUT)"
exit "$rc"
