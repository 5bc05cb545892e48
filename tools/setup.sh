#!/usr/bin/env bash
# Set up a development environment in .venv: lorakit (editable) with the notebook,
# test and browser-test dependencies. Safe to run again. On Linux as root it also
# installs Debian's chromium for the real-browser tests and xfsprogs for the
# copy-on-write tests (skipped elsewhere).
#
# Output is one progress line per step. What the tools print (pip's notices,
# setuptools' build banners, apt's lists) goes to a log that is shown only when its
# step fails, with the step's exit status; LORAKIT_SETUP_VERBOSE=1 shows it all.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VERBOSE="${LORAKIT_SETUP_VERBOSE:-0}"
LOG="$(mktemp "${TMPDIR:-/tmp}/lorakit-setup.XXXXXX")"
trap 'rm -f "$LOG"' EXIT

# step "what it does" command...: one line of progress; the command's output only on failure
step() {
  local what="$1" start=$SECONDS rc=0
  shift
  printf 'setup: %s ... ' "$what"
  if [ "$VERBOSE" = "1" ]; then
    echo
    "$@" || rc=$?
  else
    "$@" >"$LOG" 2>&1 || rc=$?
  fi
  if [ "$rc" -ne 0 ]; then
    echo "failed (exit $rc)"
    [ "$VERBOSE" = "1" ] || { echo "--- output of: $*" >&2; cat "$LOG" >&2; echo "---" >&2; }
    exit "$rc"
  fi
  echo "done ($((SECONDS - start)) s)"
}

apt_install() {
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq "$@"
}

# a C compiler builds lorakit's optional C kernels (lorakit/kernels.py lists them);
# without one lorakit installs and runs on its numpy path
if [ "$(uname -s)" = "Linux" ] && [ "$(id -u)" = "0" ] && ! command -v cc >/dev/null 2>&1; then
  step "installing a C compiler (apt-get gcc)" apt_install gcc libc6-dev
fi
if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $PY" "$PY" -m venv .venv
fi
step "updating pip" .venv/bin/python -m pip install -q --upgrade pip
step "installing lorakit (editable) and its dependencies" \
  .venv/bin/python -m pip install -q -e '.[dev]'
if [ "$(uname -s)" = "Linux" ] && [ "$(id -u)" = "0" ] && ! command -v chromium >/dev/null 2>&1; then
  step "installing chromium for the browser tests (apt-get)" apt_install chromium
fi
# mkfs.xfs makes the loop XFS image (reflink) that the copy-on-write fuse tests mount
if [ "$(uname -s)" = "Linux" ] && [ "$(id -u)" = "0" ] && ! command -v mkfs.xfs >/dev/null 2>&1; then
  step "installing xfsprogs for the copy-on-write tests (apt-get)" apt_install xfsprogs
fi
# the kernel spec is a convenience: a failure here must not fail the set-up
step "registering the Jupyter kernel" \
  bash -c '.venv/bin/python -m ipykernel install --sys-prefix --name python3 || true'
echo "setup: ready (.venv/bin/python; $SECONDS s in all)"
