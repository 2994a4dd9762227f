#!/usr/bin/env bash
# Kept for old instructions: the GPU check is tests/gpu/run_all.sh (`make gpu-check`).
exec "$(dirname "$0")/../tests/gpu/run_all.sh" "$@"
