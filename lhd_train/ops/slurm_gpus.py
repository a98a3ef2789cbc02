"""The GPUs one node of a Slurm job needs for the models the job runs at the same time.

A request the node cannot satisfy is refused when the script is rendered, not found on the node:
more GPUs than a node of the partition has (`max_gpus_per_node`: Slurm would keep the job pending
forever), a `gpus:` list whose length is not the server's tensor x data parallel size, or two
models given the same GPU (the second vLLM server would fail for lack of free memory). `gpus:`
and `device: cuda:N` are positions in the job's `CUDA_VISIBLE_DEVICES` (rollouts/gpus.py, which
`lhd run` checks again on the node); a managed server without `gpus:` takes the first GPUs the job
has (`0 .. tp x dp - 1`), as vLLM does with every GPU visible, and an hf model on `cuda` GPU 0.
A job that starts one server alone (`lhd audit`) gets its positions renumbered from 0 (`from_zero`):
the flagship auditor's "1,2,3,4" sits beside the performer in `lhd run`, and would otherwise make
the audit job ask for 5 GPUs and leave the first idle (issue 30, B5)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lhd_train.errors import InputError
from rollouts.gpus import GpuAssignmentError, find_overlaps, parse_positions


@dataclass
class _Claim:
    key: str  # the model's key in the job (`auditor:` prefix when it comes from an auditor config)
    positions: list[int]
    how: str  # where the positions come from, for the error

    def __str__(self) -> str:
        return f"'{self.key}' ({self.how})"


def from_zero(spec: Any) -> str | None:
    """A managed vLLM server's `gpus:` renumbered from 0 ("1,2,3,4" -> "0,1,2,3") for a job that
    starts it alone; None when they already start at 0, are not set, or do not apply."""
    if spec.backend != "vllm" or spec.device.lower() == "cpu" or not spec.gpus:
        return None
    try:
        positions = parse_positions(spec.gpus)
    except GpuAssignmentError:
        return None  # node_gpus reports it
    compact = list(range(len(positions)))
    return None if positions == compact else ",".join(map(str, compact))


def _positions(source: str, field: str, gpus: str) -> list[int]:
    """`gpus:` parsed by the rule `lhd run` applies on the node (rollouts.gpus.parse_positions)."""
    try:
        return parse_positions(gpus)
    except GpuAssignmentError as e:
        raise InputError(source, field, e.problem, "distinct whole numbers, comma-separated: positions in the job's "
                         "CUDA_VISIBLE_DEVICES") from None


def node_gpus(models: dict[str, Any], keys: list[str], sources: dict[str, str | Path], *, on_gpu: bool = True,
              limit: int | None = None, why: str = "") -> tuple[int, list[str]]:
    """GPUs one node needs for the models `keys`, which the job runs at the same time (managed
    vLLM servers: tp x dp each at their `gpus:` positions; in-process hf on CUDA: 1; openai
    endpoints: 0), and one note per model saying where it runs. `sources` names each model's
    config file for the errors. With `on_gpu` (a GPU partition) the sets are checked: disjoint,
    the right size, and in total at most `limit`; `why` says why the models run together."""
    total, notes, claims, parts = 0, [], [], []
    for k in keys:
        spec, name = models[k], k.removeprefix("auditor:")
        if spec.backend == "vllm" and spec.device.lower() != "cpu":
            need = spec.tensor_parallel_size * spec.data_parallel_size
            if spec.gpus:
                field = f"models.{name}.gpus"
                pos = _positions(str(sources[k]), field, spec.gpus)
                if on_gpu and len(pos) != need:
                    raise InputError(sources[k], field, f"'{spec.gpus}' lists {len(pos)} GPU(s) but "
                                     f"tensor_parallel_size x data_parallel_size = {need}", f"{need} GPU positions")
                claims.append(_Claim(k, pos, f"gpus: {spec.gpus}"))
                need = max(need, len(pos))
            else:
                claims.append(_Claim(k, list(range(need)), f"no gpus:, so the job's first {need} GPU(s)"))
            total += need
            parts.append(f"{k} {need}")
            notes.append(f"{k}: vllm serve {spec.model} on {need} GPU(s)"
                         + (f" (GPU positions {spec.gpus})" if spec.gpus else "")
                         + f", tp {spec.tensor_parallel_size}, dp {spec.data_parallel_size}")
        elif spec.backend == "vllm":
            notes.append(f"{k}: vllm serve {spec.model} on the CPU")
        elif spec.backend == "hf":
            n = 0 if spec.device.lower() == "cpu" else 1
            total += n
            if n:
                parts.append(f"{k} 1")
                index = spec.device.partition(":")[2]
                if index and not index.isdigit():
                    raise InputError(sources[k], f"models.{name}.device", f"'{spec.device}'", "auto, cpu, cuda, cuda:N")
                claims.append(_Claim(k, [int(index or 0)], f"device: {spec.device}"))
            notes.append(f"{k}: in-process transformers ({spec.device}) {spec.model}")
        elif spec.backend == "openai":
            notes.append(f"{k}: remote endpoint {spec.base_url} ({spec.model}), no GPU here")
        else:
            notes.append(f"{k}: {spec.backend} {spec.model}")
    if not on_gpu:
        return total, notes
    # A position past the sum (e.g. `gpus: "4"` alone) still needs the GPUs before it in the job.
    total = max([total] + [p + 1 for c in claims for p in c.positions])
    if limit is not None and total > limit:
        raise InputError(sources[keys[0]], "models",
                         f"{why}one node needs {total} GPUs ({' + '.join(parts)}), more than the {limit} a node "
                         "has; serve a model behind an `openai` endpoint started by another job, or use smaller "
                         "tensor_parallel_size",
                         f"at most {limit} GPUs per node (--var max_gpus_per_node=N for nodes with N GPUs)")
    _check_disjoint(claims, sources, why)
    return total, notes


def _check_disjoint(claims: list[_Claim], sources: dict[str, str | Path], why: str) -> None:
    """The overlap rule of `lhd run` (rollouts.gpus.find_overlaps), reported for the Slurm plan."""
    by_key = {c.key: c for c in claims}
    for gpu, first, second in find_overlaps({c.key: c.positions for c in claims}):
        c, other = by_key[second], by_key[first]
        field = "device" if c.how.startswith("device") else "gpus"
        raise InputError(sources[c.key], f"models.{c.key.removeprefix('auditor:')}.{field}",
                         f"{why}GPU position {gpu} is given to both {other} and {c}",
                         "disjoint GPU sets: `gpus:` on vllm models, `device: cuda:N` on hf models")
