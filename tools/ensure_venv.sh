#!/usr/bin/env bash
# Create or reuse .venv (Python 3.12) with the project installed. Idempotent: a stamp records
# the hash of setup.py, so a complete venv is reused and a changed setup.py reinstalls.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
EXTRAS=${1:-dev}

find_python() {
  for c in "${PYTHON:-}" python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 \
           /usr/local/bin/python3.12 /usr/bin/python3.12; do
    [ -n "$c" ] || continue
    if "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; then
      echo "$c"; return 0
    fi
  done
  echo "error: Python 3.12 not found (set PYTHON=/path/to/python3.12)" >&2
  return 1
}

want="$(sha256sum setup.py | cut -c1-16)-$EXTRAS"
stamp="$VENV/.megatron-rl-installed"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VENV/bin/python" -c "import megatron_rl, megatron.core, torch" 2>/dev/null; then
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  py=$(find_python)
  echo "[setup] creating $VENV with $py"
  "$py" -m venv "$VENV"
fi
echo "[setup] installing megatron-rl[$EXTRAS] into $VENV (first time: ~3 min, ~6 GB)"
"$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off -q \
  -e ".[$EXTRAS]" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
if ! "$VENV/bin/python" -c "import megatron_rl, megatron.core, torch" >/dev/null 2>&1; then
  echo "error: $VENV is incomplete: 'import megatron_rl, megatron.core, torch' fails" >&2
  exit 1
fi
echo "$want" > "$stamp"
