"""The vLLM backend: its spec, the managed `vllm serve` process, the preflight of a model's config, its
doctor rows and the KV-cache check. vLLM lives in its own environment: only `probe.py`, run by that
environment's python, imports it."""
