#!/usr/bin/env bash
# Set up (tools/setup.sh) and open JupyterLab on the walkthrough notebook, which
# fuses the embedded tiny model's adapter, inspects it and times decode, offline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
ALLOW_ROOT=()
[ "$(id -u)" = "0" ] && ALLOW_ROOT=(--allow-root)
exec .venv/bin/jupyter lab "${ALLOW_ROOT[@]}" notebooks/01_why_dtype_matters.ipynb "$@"
