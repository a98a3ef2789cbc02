#!/usr/bin/env bash
# Debian's Chromium for the headless-browser tests of the report and the trajectory viewer.
# Idempotent. As root (CI, dev machines) it installs with apt and fails loudly if apt fails;
# without root it only warns, and those tests skip with a reason.
set -euo pipefail

if command -v chromium >/dev/null 2>&1 || [ -n "${LHD_CHROMIUM:-}" ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo"; else
    echo "warning: chromium is not installed and apt needs root; the browser tests will be skipped" >&2
    exit 0
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends chromium
chromium --version
