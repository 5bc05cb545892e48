#!/usr/bin/env bash
# The fast tier for development: every test not marked `slow` (no subprocess-heavy,
# timing, browser, notebook, fuzz or architecture-parity tests), in well under a
# minute. Sets up .venv first only when it is missing. Extra arguments go to pytest.
# The whole suite (what CI runs) stays `bash tools/test.sh`. Workers as there
# (LORAKIT_TEST_WORKERS, default one per CPU core).
# Compiled modules are kept between runs (Python's __pycache__ folders, git-ignored):
# with PYTHONDONTWRITEBYTECODE set, each worker compiled every lorakit module and
# re-rewrote every test module's asserts on every run (BENCHMARKS.md, "The test suite").
set -euo pipefail
cd "$(dirname "$0")/.."
unset PYTHONDONTWRITEBYTECODE
[ -x .venv/bin/python ] || bash tools/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${LORAKIT_TEST_WORKERS:-auto}" \
    --dist worksteal -m "not slow" "$@"
