#!/usr/bin/env bash
# One-GPU check without network, in under 8 minutes (typically 1-2): the tiny model on CUDA through the
# `hf` backend with JSON-constrained decoding, a short TRL LoRA SFT run in bf16, and a Jacobian-lens fit
# on the GPU compared with the same fit on the CPU. Prints one line per check:
#   CHECK <name>: PASS|FAIL <detail>
#
# usage: scripts/gpu_check.sh [WHEELS_DIR] [-- extra args for python -m lhd_train.ops.gpu_check]
#   WHEELS_DIR  a folder of wheels (trl, xgrammar, datasets, ... and their dependencies) for a machine
#               that has only PyTorch (CUDA), transformers, peft and accelerate; whatever does not import
#               is installed from it with `pip install --no-index --find-links WHEELS_DIR`.
# Environment: PYTHON (default: .venv/bin/python if present, else python3), GPU_CHECK_DEVICE (cuda),
#              GPU_CHECK_TIMEOUT (seconds, default 480).
# Exit status: 0 when every check passed, 1 when one failed, 124 on timeout, 2 on a setup problem.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
WHEELS=""
if [[ $# -gt 0 && "$1" != "--" ]]; then WHEELS="$1"; shift; fi
if [[ $# -gt 0 && "$1" == "--" ]]; then shift; fi

if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3; fi

export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
export TRANSFORMERS_NO_ADVISORY_WARNINGS=1 HF_HUB_DISABLE_PROGRESS_BARS=1 WANDB_MODE=disabled
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"   # lhd from this checkout, installed or not

# import name -> distribution name, for what lhd needs beyond torch/transformers/peft/accelerate
NEEDED="trl:trl xgrammar:xgrammar datasets:datasets pydantic:pydantic yaml:pyyaml safetensors:safetensors tqdm:tqdm packaging:packaging"
missing=()
for pair in $NEEDED; do
  mod="${pair%%:*}"; dist="${pair##*:}"
  "$PY" -c "import $mod" 2>/dev/null || missing+=("$dist")
done
if [[ ${#missing[@]} -gt 0 ]]; then
  if [[ -z "$WHEELS" ]]; then
    echo "CHECK setup: FAIL missing ${missing[*]}; pass a wheels folder: scripts/gpu_check.sh WHEELS_DIR" >&2
    exit 2
  fi
  echo "installing ${missing[*]} from $WHEELS (no index)" >&2
  if ! "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" "${missing[@]}"; then
    echo "CHECK setup: FAIL pip could not install ${missing[*]} from $WHEELS" >&2
    exit 2
  fi
fi
for mod in torch transformers peft accelerate; do
  "$PY" -c "import $mod" 2>/dev/null || { echo "CHECK setup: FAIL $mod does not import" >&2; exit 2; }
done

timeout --kill-after=20 "${GPU_CHECK_TIMEOUT:-480}" \
  "$PY" -m lhd_train.ops.gpu_check --device "${GPU_CHECK_DEVICE:-cuda}" "$@"
rc=$?
[[ $rc -eq 124 ]] && echo "CHECK timeout: FAIL gpu_check ran past ${GPU_CHECK_TIMEOUT:-480} s"
exit $rc
