"""Backends that launch their own OpenAI-compatible server and talk to it through `OpenAIBackend`.

`vllm`: `vllm serve` with tensor/data parallel, prefix caching, LoRA adapters, structured outputs
(vLLM does the continuous batching). `transformers-serve`: `transformers serve` on CPU, which runs
on the dev and CI machines and exercises the same supervision code (it ignores JSON schemas, so it
uses the schema-in-prompt path)."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

from rollouts.managed_server import ManagedServer, free_port
from rollouts.openai_backend import OpenAIBackend
from rollouts.spec import ModelSpec


def vllm_command(spec: ModelSpec, port: int, served_name: str) -> list[str]:
    exe = shutil.which("vllm") or "vllm"
    cmd = [exe, "serve", spec.model, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", served_name, "--dtype", spec.dtype,
           "--tensor-parallel-size", str(spec.tensor_parallel_size),
           "--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
    if spec.data_parallel_size > 1:
        cmd += ["--data-parallel-size", str(spec.data_parallel_size)]
    if spec.revision:
        cmd += ["--revision", spec.revision]
    if spec.max_model_len:
        cmd += ["--max-model-len", str(spec.max_model_len)]
    cmd.append("--enable-prefix-caching" if spec.enable_prefix_caching else "--no-enable-prefix-caching")
    if spec.adapters:
        cmd += ["--enable-lora", "--max-lora-rank", str(spec.max_lora_rank), "--max-loras", str(len(spec.adapters)),
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
        server.start(spec.startup_timeout_s)
        tok = None
        if Path(spec.model).exists():  # exact token counts for local checkpoints
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(spec.model, trust_remote_code=spec.trust_remote_code)
        super().__init__(spec, server.base_url, served_name, structured, tok)
        self.server = server
        if self.max_model_len is None and tok is not None:
            self.max_model_len = _context_len(spec.model)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "backend": self.kind, "command": self.server.cmd,
                "log": str(self.server.log_path)}

    async def aclose(self) -> None:
        await super().aclose()
        self.server.stop()


class VLLMBackend(ManagedServerBackend):
    kind = "vllm"

    @classmethod
    def from_spec(cls, spec: ModelSpec, name: str = "", log_dir: str | None = None) -> "VLLMBackend":
        port = free_port()
        served = name or Path(spec.model).name
        env = {"CUDA_VISIBLE_DEVICES": spec.gpus} if spec.gpus else {}
        log = Path(log_dir or ".") / f"vllm-{served}-{port}.log"
        server = ManagedServer(vllm_command(spec, port, served), port, log, env)
        mode = "vllm" if spec.structured_outputs == "auto" else spec.structured_outputs
        return cls(spec, server, served, mode)


class TransformersServeBackend(ManagedServerBackend):
    kind = "transformers-serve"

    @classmethod
    def from_spec(cls, spec: ModelSpec, name: str = "", log_dir: str | None = None) -> "TransformersServeBackend":
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
