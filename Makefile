SHELL := /bin/bash
VENV := .venv
PYTEST_ARGS ?=

.PHONY: quickstart test lint setup gpu-check

setup:
	@tools/ensure_venv.sh dev

quickstart: setup
	$(VENV)/bin/megatron-rl quickstart

# the package layering (.importlinter) first; pytest exits 5 when it collects nothing: that is
# not a failure of the project. Chromium (for the HTML report's headless checks) is installed
# when missing and apt can; otherwise those checks skip, saying why.
test: setup
	$(VENV)/bin/lint-imports --no-cache
	@tools/ensure_chromium.sh
	@set +e; $(VENV)/bin/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=0; fi; exit $$rc

lint: setup
	$(VENV)/bin/ruff check megatron_rl tests tools benchmarks
	$(VENV)/bin/lint-imports --no-cache

# on a CUDA machine: the gpu-marked tests and benchmarks/mfu.py (logs in $$OUT, default
# runs/gpu_check); elsewhere one line and exit 0
gpu-check: setup
	tests/gpu/run_all.sh
