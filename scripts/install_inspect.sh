#!/usr/bin/env bash
# Build .venv-inspect, the environment that runs inspect_ai (`make inspect-env`): `lhd export
# --format inspect`, inspect_ai's log reader and `inspect view`.
#
# Why a venv of its own: every inspect-ai release caps a package below the version constraints.txt
# pins for the main venv (0.3.285: fsspec<=2026.6.0; older releases cap click; its aiobotocore caps
# python-dateutil), so it cannot be installed into .venv. .venv-inspect is layered over .venv: a
# .pth file appends .venv's site-packages AFTER its own (as `make test-compat` does), so lhd and its
# dependencies come from .venv and only what inspect-ai needs at other versions (fsspec, ...) is
# installed here and shadows .venv's copy. pip leaves .venv's packages alone ("outside environment").
#
# Idempotent: a finished environment is recognised by its stamp and left alone. On failure it
# prints one line saying why, writes that line to <venv>.failed (tests/interop/test_inspect_log.py
# prints it as its skip reason) and exits 1.
#
# Settings (environment): LHD_INSPECT_VENV (default .venv-inspect), LHD_BASE_VENV (.venv, with lhd
# installed: `make env`), INSPECT_AI_VERSION (0.3.285).
set -uo pipefail

VENV="${LHD_INSPECT_VENV:-.venv-inspect}"
BASE="${LHD_BASE_VENV:-.venv}"
VERSION="${INSPECT_AI_VERSION:-0.3.285}"
NAME=inspect-env
# shellcheck source=scripts/venv_build.sh
source "$(dirname "${BASH_SOURCE[0]}")/venv_build.sh"
lock_venv

[[ -x "$BASE/bin/python" ]] || fail "no $BASE/bin/python to layer over (run \`make env\` first)"
BASE_SITE="$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    || fail "cannot locate site-packages of $BASE"
BASE_SITE="$(cd "$BASE_SITE" && pwd -P)" || fail "cannot resolve $BASE_SITE"
WANT="inspect-ai==$VERSION over $BASE_SITE"  # a moved .venv means a rebuild
skip_if_built "$VENV/bin/inspect"
start_log

if [[ ! -x "$VENV/bin/python" ]]; then
    # The same interpreter as .venv's, so .venv's compiled packages load here.
    "$BASE/bin/python" -m venv "$VENV" >> "$LOG" 2>&1 || fail "cannot create a venv at $VENV (see $LOG)"
fi
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    || fail "cannot locate site-packages of $VENV"
# "zz": .pth files are read in name order and append to sys.path, so .venv's site-packages comes last.
printf '%s\n' "$BASE_SITE" > "$SITE/zz_lhd_base_venv.pth" || fail "cannot write $SITE/zz_lhd_base_venv.pth"

"$VENV/bin/python" -m pip install "inspect-ai==$VERSION" >> "$LOG" 2>&1 \
    || fail "cannot install inspect-ai==$VERSION: $(last_error) (see $LOG)"
# The venv's own old setuptools would shadow .venv's (torch wants setuptools>=77); inspect-ai needs none.
"$VENV/bin/python" -m pip uninstall -y setuptools >> "$LOG" 2>&1 || fail "cannot remove setuptools from $VENV (see $LOG)"

# Verify: inspect_ai and this checkout's exporter import here, with inspect-ai's own versions winning.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHONPATH="$ROOT" "$VENV/bin/python" -c '
import sys
import fsspec, inspect_ai, lhd_train.interop.inspect_log
from inspect_ai.log import read_eval_log, write_eval_log
here = sys.prefix
if not fsspec.__file__.startswith(here):
    sys.exit(f"fsspec {fsspec.__version__} is loaded from {fsspec.__file__}, not from {here}")
' >> "$LOG" 2>&1 || fail "inspect_ai or lhd's exporter does not import in $VENV: $(tail -n 1 "$LOG")"
"$VENV/bin/inspect" --version >> "$LOG" 2>&1 || fail "\`$VENV/bin/inspect --version\` fails (see $LOG)"

mark_built
echo "inspect-env: ok: $VENV/bin/inspect (inspect-ai $VERSION over $BASE)"
