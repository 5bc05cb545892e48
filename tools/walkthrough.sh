#!/usr/bin/env bash
# Set up (tools/setup.sh) and open JupyterLab on a copy of the walkthrough notebook, which
# fuses the embedded tiny model's adapter, inspects it and times decode, offline.
# The URL JupyterLab prints opens that notebook itself (not the Launcher).
# Extra arguments go to `jupyter lab` (e.g. --no-browser --port 8890).
set -euo pipefail
cd "$(dirname "$0")/.."
NOTEBOOK=notebooks/01_why_dtype_matters.ipynb
# LORAKIT_NO_SETUP=1 skips the set-up step (the tests use it on a ready environment);
# LORAKIT_VENV names that environment (default .venv, the one tools/setup.sh makes)
[ "${LORAKIT_NO_SETUP:-0}" = "1" ] || bash tools/setup.sh
VENV="${LORAKIT_VENV:-.venv}"
ALLOW_ROOT=()
[ "$(id -u)" = "0" ] && ALLOW_ROOT=(--allow-root)
# JupyterLab saves outputs into the notebooks it opens: it opens a copy, in
# scratch/walkthrough/ (git ignores scratch/), so the tracked notebooks stay as they
# are. Notebooks already copied keep your edits; delete the folder for fresh copies.
WORK="scratch/walkthrough"
mkdir -p "$WORK/notebooks"
cp -Rn notebooks/. "$WORK/notebooks/"
echo "walkthrough: opening a copy of notebooks/ in $WORK/notebooks" \
  "(the tracked notebooks stay unmodified; delete $WORK for fresh copies)"
# the copies find the embedded model and adapters here
export LORAKIT_DATA="${LORAKIT_DATA:-$PWD/data}"
# The server's root is the copy (no notebook argument: given a file, Jupyter serves
# that file's folder instead, and the URL below would name a missing path).
exec "$VENV/bin/jupyter" lab "${ALLOW_ROOT[@]}" --ServerApp.root_dir="$PWD/$WORK" \
  --LabApp.default_url="/lab/tree/$NOTEBOOK" "$@"
