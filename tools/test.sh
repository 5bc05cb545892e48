#!/usr/bin/env bash
# Set up (tools/setup.sh) and run the whole test suite, notebooks and the
# real-browser JupyterLab tests included. Extra arguments go to pytest.
# The fast tier for development is tools/test-fast.sh (pytest -m "not slow").
# Tests run in pytest-xdist workers, one per CPU core (`-n auto`; LORAKIT_TEST_WORKERS
# overrides it, 0 runs them in this one process); --dist worksteal lets an idle worker take queued tests
# from a busy one, so the few minute-long tests do not leave a core idle at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
unset PYTHONDONTWRITEBYTECODE  # keep compiled modules between workers and runs
bash tools/setup.sh
exec .venv/bin/python -m pytest -q -n "${LORAKIT_TEST_WORKERS:-auto}" --dist worksteal "$@"
