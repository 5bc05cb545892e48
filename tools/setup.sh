#!/usr/bin/env bash
# Set up a development environment in .venv: lorakit (editable) with the notebook,
# test and browser-test dependencies. Safe to run again. On Linux as root it also
# installs Debian's chromium for the real-browser tests (skipped elsewhere).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
# a C compiler builds lorakit's optional ulp kernel (lorakit/inspect/_ulpkernel.c);
# without one lorakit installs and runs on its numpy path
if [ "$(uname -s)" = "Linux" ] && [ "$(id -u)" = "0" ] && ! command -v cc >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq gcc libc6-dev >/dev/null
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[dev]'
if [ "$(uname -s)" = "Linux" ] && [ "$(id -u)" = "0" ] && ! command -v chromium >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq chromium >/dev/null
fi
.venv/bin/python -m ipykernel install --sys-prefix --name python3 >/dev/null 2>&1 || true
