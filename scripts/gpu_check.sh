#!/usr/bin/env bash
# The device check of issue 20: the paths most at risk on a GPU node, on one GPU, without network and
# without vLLM, in under 8 minutes (about 2-4 on an H100/H200). One line per check:
#   CHECK <name>: PASS|FAIL|SKIP <detail>
# plus PROJ lines that project a measurement to Llama-3.1-8B. The checks (lhd_train/ops/gpu_check.py):
# env (CUDA, bf16, C compiler, bitsandbytes/triton), the tiny model through the hf backend with JSON
# schemas, xgrammar's Triton kernel from a worker thread (and the hf backend on cuda:1 with 2 GPUs),
# an 8B-shaped 4-layer slice (hf backend peak memory vs its KV budget formula, a real out-of-memory
# error split and retried, lens peak and time vs the lens planner), TRL LoRA SFT, SFT with rows longer
# than max_length (none dropped), DPO LoRA bf16 + gradient checkpointing, QLoRA (SKIP without
# bitsandbytes), single-process training on one GPU (needs 2 GPUs), the lens on the GPU vs the CPU.
#
# usage: scripts/gpu_check.sh [WHEELS_DIR] [-- extra args for lhd gpu-check]
#   WHEELS_DIR  a folder of wheels (trl, xgrammar, datasets, ... and their dependencies) for a machine
#               that has only PyTorch (CUDA), transformers, peft and accelerate; whatever does not import
#               is installed from it with `pip install --no-index --find-links WHEELS_DIR`
#               (bitsandbytes too, when the folder has it: the QLoRA check needs it).
#   extra args  --only NAME,NAME  --small (a small slice)  --device cuda:N  --work DIR
# Environment: PYTHON (default: .venv/bin/python if present, else python3), GPU_CHECK_DEVICE (cuda),
#              GPU_CHECK_TIMEOUT (seconds, default 480).
# Record the output in docs/gpu.md (how: docs/gpu.md, "The device check"):
#   scripts/gpu_check.sh 2>gpu_check.err | tee gpu_check.txt
# Exit status: 0 when no check failed, 1 when one failed, 124 on timeout, 2 on a setup problem.
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
if ! "$PY" -c "import bitsandbytes" 2>/dev/null && [[ -n "$WHEELS" ]] && ls "$WHEELS"/bitsandbytes-* >/dev/null 2>&1; then
  "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" bitsandbytes || echo "bitsandbytes: not installed" >&2
fi
for mod in torch transformers peft accelerate; do
  "$PY" -c "import $mod" 2>/dev/null || { echo "CHECK setup: FAIL $mod does not import" >&2; exit 2; }
done

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total \
  --format=csv,noheader 2>&1 | sed 's/^/GPU /'
echo "host $(hostname) $(date -u +%Y-%m-%dT%H:%MZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
timeout --kill-after=20 "${GPU_CHECK_TIMEOUT:-480}" \
  "$PY" -m lhd_train.cli gpu-check --device "${GPU_CHECK_DEVICE:-cuda}" "$@"
rc=$?
[[ $rc -eq 124 ]] && echo "CHECK timeout: FAIL gpu_check ran past ${GPU_CHECK_TIMEOUT:-480} s"
exit $rc
