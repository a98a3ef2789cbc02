"""Build a backend from a ModelSpec. Heavy or GPU-only modules are imported only when used."""
from __future__ import annotations

from rollouts.backend import Backend, BackendError
from rollouts.spec import ModelSpec


def build_backend(spec: ModelSpec, name: str = "", log_dir: str | None = None) -> Backend:
    if spec.backend == "hf":
        from rollouts.hf import HFBackend

        return HFBackend.from_spec(spec)
    if spec.backend == "openai":
        from rollouts.openai_backend import OpenAIBackend

        return OpenAIBackend.from_spec(spec)
    if spec.backend == "vllm":
        from rollouts.vllm_server import VLLMBackend

        return VLLMBackend.from_spec(spec, name=name, log_dir=log_dir)
    if spec.backend == "transformers-serve":
        from rollouts.vllm_server import TransformersServeBackend

        return TransformersServeBackend.from_spec(spec, name=name, log_dir=log_dir)
    raise BackendError(f"unknown backend '{spec.backend}' (allowed: hf, openai, vllm, transformers-serve)")
