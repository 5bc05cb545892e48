#!/usr/bin/env bash
# Set up (tools/setup.sh) and run the whole test suite, notebooks and the
# real-browser JupyterLab tests included. Extra arguments go to pytest.
# The fast tier for development is tools/test-fast.sh (pytest -m "not slow").
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
exec .venv/bin/python -m pytest -q "$@"
