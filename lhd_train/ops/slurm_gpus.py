"""The GPUs one node of a Slurm job needs for the models the job runs at the same time.

A request the node cannot satisfy is refused when the script is rendered: more GPUs than a node of
the partition has (`max_gpus_per_node`), a `gpus:` list that is not the server's tp x dp, or two
models on one GPU. Positions are those of the job's `CUDA_VISIBLE_DEVICES` (rollouts/gpus.py); each
backend says which it claims (`BackendSpec.gpu_claim`), and a job that starts one server alone
(`lhd audit`) renumbers them from 0 (`BackendSpec.first_gpus`, issue 30, B5). docs/cluster.md,
"Slurm jobs"."""
from __future__ import annotations

from pathlib import Path

from lhd_train.errors import InputError
from rollouts.backends import ModelSpec
from rollouts.gpus import GpuAssignmentError, GpuClaim, check_disjoint


def node_gpus(models: dict[str, ModelSpec], keys: list[str], sources: dict[str, str | Path], *, on_gpu: bool = True,
              limit: int | None = None, why: str = "") -> tuple[int, list[str]]:
    """GPUs one node needs for the models `keys`, which the job runs at the same time (each claims
    the positions its backend says), and one note per model saying where it runs. `sources` names
    each model's config file for the errors. With `on_gpu` (a GPU partition) the claims are checked:
    disjoint, the right size, and in total at most `limit`; `why` says why the models run together."""
    claims: dict[str, GpuClaim] = {}
    notes = []
    for k in keys:
        spec, name = models[k], k.removeprefix("auditor:")
        try:
            claim = spec.gpu_claim(cuda=on_gpu)
        except GpuAssignmentError as e:
            raise InputError(sources[k], f"models.{name}.{e.field}", e.problem,
                             "distinct whole numbers, comma-separated: positions in the job's CUDA_VISIBLE_DEVICES, "
                             "as many as the server's tensor x data parallel size") from None
        if claim is not None:
            claims[k] = claim
        notes.append(f"{k}: {spec.placement(on_gpu)}")
    if not on_gpu:
        return 0, notes
    # A position past the sum (e.g. `gpus: "4"` alone) still needs the GPUs before it in the job.
    positions = [p for c in claims.values() for p in c.positions]
    total = max([len(positions)] + [p + 1 for p in positions])
    if limit is not None and total > limit:
        parts = " + ".join(f"{k} {len(c.positions)}" for k, c in claims.items())
        raise InputError(sources[keys[0]], "models",
                         f"{why}one node needs {total} GPUs ({parts}), more than the {limit} a node "
                         "has; serve a model behind an `openai` endpoint started by another job, or use smaller "
                         "tensor_parallel_size",
                         f"at most {limit} GPUs per node (--var max_gpus_per_node=N for nodes with N GPUs)")
    try:
        check_disjoint(claims, why)
    except GpuAssignmentError as e:
        key = str(e.key)
        raise InputError(sources[key], f"models.{key.removeprefix('auditor:')}.{e.field}", e.problem,
                         "disjoint GPU sets: each model its own `gpus:` or `device: cuda:N`") from None
    return total, notes
