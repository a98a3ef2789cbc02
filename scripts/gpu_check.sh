#!/usr/bin/env bash
# The device check: the paths most at risk on a GPU node, on one GPU, without network and without vLLM,
# in under 8 minutes on one H200 (a lent machine's lease; GPU_CHECK_TIMEOUT, default 450 s, stops it in
# time and every test that finished has printed). It runs the device tests, `pytest -m gpu tests/gpu`,
# with one line per test as it finishes:
#   CHECK <name>: PASS|FAIL|SKIP <measurements> [seconds]
# plus PROJ lines projecting a measurement to Llama-3.1-8B, then pytest's summary. The tests
# (tests/gpu/): versions against lhd's ranges (FAIL outside them), env, the tiny model through the hf
# backend with JSON schemas (and which decode path ran), xgrammar's Triton kernel from a worker thread,
# then a random Llama-3.1-8B at full size built on the GPU: hf decode tokens/s against the
# memory-bandwidth bound, one ~120k-token row, one LoRA SFT / DPO / GRPO step at 8k tokens with the real
# vocabulary, the lens at 8B size and its bf16 error against fp32; then TRL on the tiny model (QLoRA with
# bitsandbytes) and the lens on the GPU against the CPU. `-- --all` adds the older 8B-slice tests
# (beyond 8 minutes).
#
# usage: scripts/gpu_check.sh [--require-gpu] [BUNDLE.tar.xz | WHEELS_DIR] [-- --all | pytest args, e.g. -k lens]
#   --require-gpu  exit 3 before the tests when torch sees no GPU (a broken CUDA stack would otherwise
#                  pass as all SKIP)
#   BUNDLE.tar.xz  the packages the image lacks (scripts/build_gpu_bundle.py; default: the
#                  build/gpu/lhd-deps-pyXY.tar.xz of this Python when it exists), unpacked once into
#                  $GPU_CHECK_SITE (default /tmp/lhd/site-packages: the name must contain site-packages,
#                  or dill pickles pyarrow by value and every Dataset fails) and put first on PYTHONPATH
#   WHEELS_DIR     a folder of wheels: whatever does not import is installed from it (pip --no-index)
# Environment: PYTHON (default: .venv/bin/python if present, else python3), GPU_CHECK_DEVICE (cuda, cuda:N;
#              cpu runs the tests' CPU forms, as the CPU suite does), GPU_CHECK_TIMEOUT (seconds, default 450).
# On a lent machine (build the bundle here first: make gpu-bundle; carry build/gpu):
#   bash scripts/gpu_check.sh 2>$OUT/gpu_check.err | tee $OUT/gpu_check.txt
# Exit status: pytest's (0 when no test failed, 1 when one failed), 124 on timeout, 2 on a setup problem,
# 3 with --require-gpu when torch sees no GPU.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SOURCE=""
REQUIRE_GPU=0
if [[ $# -gt 0 && "$1" == "--require-gpu" ]]; then REQUIRE_GPU=1; shift; fi
if [[ $# -gt 0 && "$1" != "--" ]]; then SOURCE="$1"; shift; fi
if [[ $# -gt 0 && "$1" == "--" ]]; then shift; fi

if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3; fi

export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
export TRANSFORMERS_NO_ADVISORY_WARNINGS=1 HF_HUB_DISABLE_PROGRESS_BARS=1 WANDB_MODE=disabled
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1   # apache-tvm-ffi would compile a torch extension at `import xgrammar`
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"

TAG="$("$PY" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')"
if [[ -z "$SOURCE" && -f "build/gpu/lhd-deps-py$TAG.tar.xz" ]]; then SOURCE="build/gpu/lhd-deps-py$TAG.tar.xz"; fi
if [[ "$SOURCE" == *.tar.xz ]]; then
  # The one install line: the bundle's packages ahead of the image's, lhd from this checkout.
  SITE="${GPU_CHECK_SITE:-/tmp/lhd/site-packages}"
  mkdir -p "$SITE" && "$PY" -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='tar')" \
    "$SOURCE" "$SITE" || { echo "CHECK setup: FAIL cannot unpack $SOURCE into $SITE" >&2; exit 2; }
  export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  echo "bundle $SOURCE unpacked into $SITE, first on PYTHONPATH" >&2
else
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"   # lhd from this checkout, installed or not
  WHEELS="$SOURCE"
  NEEDED="trl:trl xgrammar:xgrammar datasets:datasets pydantic:pydantic yaml:pyyaml safetensors:safetensors tqdm:tqdm packaging:packaging pytest:pytest pytest_timeout:pytest-timeout"
  missing=()
  for pair in $NEEDED; do
    mod="${pair%%:*}"; dist="${pair##*:}"
    "$PY" -c "import $mod" 2>/dev/null || missing+=("$dist")
  done
  if [[ ${#missing[@]} -gt 0 ]]; then
    if [[ -z "$WHEELS" ]]; then
      echo "CHECK setup: FAIL missing ${missing[*]}; pass the bundle (scripts/build_gpu_bundle.py) or a wheels folder" >&2
      exit 2
    fi
    echo "installing ${missing[*]} from $WHEELS (no index)" >&2
    if ! "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" "${missing[@]}"; then
      echo "CHECK setup: FAIL pip could not install ${missing[*]} from $WHEELS" >&2
      exit 2
    fi
  fi
fi
for mod in torch transformers accelerate peft trl datasets; do
  # the import's own last line names the cause (peft without accelerate: "No module named 'accelerate'")
  if ! why="$("$PY" -c "import $mod" 2>&1)"; then
    echo "CHECK setup: FAIL $mod does not import: $(grep -v '^ ' <<<"$why" | tail -n 1)" >&2; exit 2
  fi
done

command -v nvidia-smi >/dev/null && nvidia-smi \
  --query-gpu=index,name,driver_version,memory.used,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.limit \
  --format=csv,noheader 2>&1 | sed 's/^/GPU /'
echo "host $(hostname) $(date -u +%Y-%m-%dT%H:%MZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
if [[ $REQUIRE_GPU == 1 ]] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "CHECK setup: FAIL --require-gpu: torch $("$PY" -c 'import torch; print(torch.__version__)') sees no GPU" \
    "(CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset})" >&2
  exit 3
fi
MARK=gpu; [[ "$DEVICE" == cpu ]] && MARK="not gpu"
ARGS=()
for a in "$@"; do
  if [[ "$a" == "--all" ]]; then export LHD_GPU_ALL=1; else ARGS+=("$a"); fi
done
export LHD_CHECK_LINES=1 LHD_GPU_DEVICE="$DEVICE" PYTHONUNBUFFERED=1
timeout --kill-after=20 "${GPU_CHECK_TIMEOUT:-450}" \
  "$PY" -m pytest tests/gpu -m "$MARK" -q -rfE -p no:cacheprovider "${ARGS[@]}"
rc=$?
[[ $rc -eq 124 ]] && echo "CHECK timeout: FAIL the device tests ran past ${GPU_CHECK_TIMEOUT:-450} s"
exit $rc
