#!/usr/bin/env bash
# Make sure `chromium` (Debian's package) is on PATH, for the headless checks of the HTML report
# (tests/test_report_viewer.py). Idempotent: does nothing when chromium is already there.
# Never fails the caller: without apt, or without root, it says why and exits 0 (the tests that
# need chromium then skip, saying so).
set -uo pipefail

if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "[chromium] not installed, and apt-get is not available here: the browser checks will skip"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
  else
    echo "[chromium] not installed, and installing it needs root (apt-get install chromium):" \
         "the browser checks will skip"
    exit 0
  fi
else
  SUDO=()
fi
echo "[chromium] not on PATH: installing Debian's chromium (apt-get, ~1 min)"
start=$(date +%s)
log=$(mktemp)
if ! "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive \
     apt-get install -y -q --no-install-recommends chromium >"$log" 2>&1; then
  echo "[chromium] apt-get install failed; updating the package lists and retrying"
  if ! { "${SUDO[@]}" apt-get update -q >>"$log" 2>&1 &&
         "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive \
           apt-get install -y -q --no-install-recommends chromium >>"$log" 2>&1; }; then
    echo "[chromium] could not install chromium (the browser checks will skip); apt said:"
    tail -n 5 "$log" | sed 's/^/[chromium]   /'
    rm -f "$log"
    exit 0
  fi
fi
rm -f "$log"
echo "[chromium] installed $(chromium --version 2>/dev/null || echo chromium)" \
     "in $(( $(date +%s) - start ))s"
exit 0
