#!/usr/bin/env bash
# Set up (tools/setup.sh) and open JupyterLab on the walkthrough notebook, which
# fuses the embedded tiny model's adapter, inspects it and times decode, offline.
# The URL JupyterLab prints opens that notebook itself (not the Launcher).
# Extra arguments go to `jupyter lab` (e.g. --no-browser --port 8890).
set -euo pipefail
cd "$(dirname "$0")/.."
NOTEBOOK=notebooks/01_why_dtype_matters.ipynb
# LORAKIT_NO_SETUP=1 skips the set-up step (the tests use it on a ready .venv)
[ "${LORAKIT_NO_SETUP:-0}" = "1" ] || bash tools/setup.sh
ALLOW_ROOT=()
[ "$(id -u)" = "0" ] && ALLOW_ROOT=(--allow-root)
exec .venv/bin/jupyter lab "${ALLOW_ROOT[@]}" --LabApp.default_url="/lab/tree/$NOTEBOOK" \
  "$NOTEBOOK" "$@"
