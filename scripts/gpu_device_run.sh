#!/usr/bin/env bash
# The whole device call (issue 38, docs/gpu.md): the device check, the engine benchmark, $OUT/summary.txt;
# under 10 min. run(command="bash scripts/gpu_device_run.sh", carry=["build/gpu"], timeout_s=590)
# CPU form: GPU_CHECK_DEVICE=cpu; BENCH=0: no benchmark. Other arguments go to gpu_check.sh (-- -k lens).
set -u; cd "$(dirname "$0")/.."; O=${OUT:-build/gpu-out}; mkdir -p "$O"; D=${GPU_CHECK_DEVICE:-cuda}
P=${PYTHON:-python3}; S=${GPU_CHECK_SITE:-/tmp/lhd/site-packages}; M=/tmp/lhd/bench-model
export PYTHON=$P GPU_CHECK_SITE=$S HF_HUB_OFFLINE=1 TVM_FFI_DISABLE_TORCH_C_DLPACK=1
(nvidia-smi; $P -VV) >"$O/gpu.txt" 2>&1
R=--require-gpu W="576 30 9 3 1536" N=4 T=${BENCH_TIMEOUT:-140}   # SmolLM2-135M-shaped random Llama
[[ $D == cpu ]] && R= W="64 2 4 2 128" N=2 T=${BENCH_TIMEOUT:-300}
GPU_CHECK_TIMEOUT=${GPU_CHECK_TIMEOUT:-400} bash scripts/gpu_check.sh $R "$@" 2>"$O/gpu_check.err" | tee "$O/gpu_check.txt"
c=${PIPESTATUS[0]}; echo "gpu_check rc=$c" >>"$O/gpu_check.txt"
export PYTHONPATH=$S:$PWD; b=skipped
[[ ${BENCH:-1} == 0 ]] || { $P -c "import sys;from lhd_train.tiny_model import build_tiny_model as b;w,l,h,k,i=map(int,sys.argv[2:])
b('llama',sys.argv[1],hidden_size=w,num_layers=l,num_attention_heads=h,num_key_value_heads=k,intermediate_size=i)" \
  $M $W 2>>"$O/gpu_check.err"
timeout -k 10 $T $P benchmarks/rollout_throughput.py --model $M --backends hf --tasks 1 \
  --trials $N --json "$O/throughput.json" >"$O/throughput.txt" 2>>"$O/gpu_check.err"; b=$?; }
{ tail -n 1 "$O/gpu.txt"; grep -E '^(GPU|CHECK|PROJ)|passed|failed|rc=' "$O/gpu_check.txt"; cat "$O/throughput.txt"
  $P -c "import json,sys;m=json.load(open(sys.argv[1]))[0]['modes'];s,e=m['sequential'],m['engine']
print('engine / sequential %.2fx'%(s['wall_s']/e['wall_s']))" "$O/throughput.json"; echo "bench rc=$b"
} >"$O/summary.txt" 2>&1
cat "$O/summary.txt"; exit $c
