#!/usr/bin/env bash
# Train the tiny MoE at EP2, then continue the same run at TP2: the checkpoint (model and Adam
# state) is resharded on load. Run from the repository root after `make quickstart`'s setup.
set -euo pipefail
OUT=${OUT:-runs/reshard_example}
.venv/bin/megatron-rl lm-train tiny-moe-cpu train.steps=20 \
  train.output_dir=$OUT checkpoint.dir=$OUT/ckpt checkpoint.save_every=10
.venv/bin/megatron-rl lm-train tiny-moe-cpu train.steps=30 parallel.ep=1 parallel.tp=2 \
  train.output_dir=$OUT checkpoint.dir=$OUT/ckpt checkpoint.load=latest
