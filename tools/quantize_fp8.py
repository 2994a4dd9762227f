"""Thin wrapper: `megatron-rl convert fp8 --hf SRC --out DST [--model NAME]` (see --help):
a blockwise-128x128 FP8 HF checkpoint for SGLang engines (docs/fp8.md)."""

import sys

from megatron_rl.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "fp8", *sys.argv[1:]]))
