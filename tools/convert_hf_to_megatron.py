"""Thin wrapper: `megatron-rl convert hf-to-megatron ...` (see --help)."""

import sys

from megatron_rl.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "hf-to-megatron", *sys.argv[1:]]))
