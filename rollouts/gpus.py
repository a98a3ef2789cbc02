"""Which GPUs a model gets: `gpus:` and `device: cuda:N` are positions among the GPUs this process
may use, never absolute ids.

Slurm (or a user) hands a job its GPUs in CUDA_VISIBLE_DEVICES, e.g. "4,5,6,7" on a node whose
devices are not confined. `gpus: "1,2"` then means the 2nd and 3rd of those ("5,6"), so a server
never lands on another job's GPU; with CUDA_VISIBLE_DEVICES unset, positions are device indices.
The same positions let lhd refuse, before anything starts, a config asking for more GPUs than are
visible or giving one GPU to two models."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from rollouts.backend import SpecError


class GpuAssignmentError(SpecError):
    """A `gpus:`/`device:` that cannot be honoured; `key` and `field` name the model entry."""


@dataclass(frozen=True)
class GpuClaim:
    """The GPU positions one model occupies, the spec field that sets them, and how (for errors)."""

    positions: list[int]
    field: str
    how: str


def visible_ids() -> list[str] | None:
    """The inherited CUDA_VISIBLE_DEVICES as a list (ids or UUIDs), or None when it is unset."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return None
    ids = [g.strip() for g in cvd.split(",") if g.strip()]
    return [] if ids == ["-1"] else ids


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


def gpu_count() -> int:
    """How many GPUs this process may use: the entries of CUDA_VISIBLE_DEVICES when it is set,
    else what an already imported CUDA torch or `nvidia-smi -L` reports (0 without a driver)."""
    ids = visible_ids()
    if ids is not None:
        return len(ids)
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch.version, "cuda", None):
        return int(torch.cuda.device_count())
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def parse_positions(text: str, key: str | None = None) -> list[int]:
    """`gpus: "1,2"` -> [1, 2]; anything but distinct non-negative integers is an error."""
    out: list[int] = []
    for part in str(text).split(","):
        part = part.strip()
        if not part.isdigit():
            raise GpuAssignmentError(key, "gpus", f"gpus {text!r}: '{part}' is not a GPU position (0, 1, ...); "
                                     "positions count the GPUs in the inherited CUDA_VISIBLE_DEVICES")
        if int(part) in out:
            raise GpuAssignmentError(key, "gpus", f"gpus {text!r} lists GPU {part} twice")
        out.append(int(part))
    return out


def physical_ids(positions: Sequence[int], key: str | None = None) -> str:
    """CUDA_VISIBLE_DEVICES for a child process given positions: the inherited list's entries at
    those positions, or the positions themselves when nothing is inherited."""
    ids = visible_ids()
    if ids is None:
        return ",".join(str(p) for p in positions)
    beyond = [p for p in positions if p >= len(ids)]
    if beyond:
        raise GpuAssignmentError(key, "gpus", f"GPU position {beyond[0]} asked for, but CUDA_VISIBLE_DEVICES="
                                 f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r} lists {len(ids)} GPU(s) "
                                 f"(positions 0-{len(ids) - 1})")
    return ",".join(ids[p] for p in positions)


def hf_position(device: str, key: str | None = None) -> int | None:
    """The GPU position an in-process model on `device` (already resolved: cpu, cuda, cuda:N) uses."""
    if not device.startswith("cuda"):
        return None
    _, _, index = device.partition(":")
    if index and not index.isdigit():
        raise GpuAssignmentError(key, "device", f"device {device!r}: expected cuda or cuda:N")
    return int(index or 0)


def find_overlaps(claims: Mapping[str, Sequence[int]]) -> list[tuple[int, str, str]]:
    """(gpu, first model, second model) for every GPU position claimed by two models."""
    owner: dict[int, str] = {}
    found: list[tuple[int, str, str]] = []
    for key, positions in claims.items():
        for p in positions:
            if p in owner and owner[p] != key:
                found.append((p, owner[p], key))
            owner.setdefault(p, key)
    return found


def check_disjoint(claims: Mapping[str, GpuClaim], why: str = "") -> None:
    """Refuse a GPU given to two models (the first one found, naming the second model's field)."""
    for gpu, first, second in find_overlaps({k: c.positions for k, c in claims.items()}):
        raise GpuAssignmentError(second, claims[second].field,
                                 f"{why}GPU position {gpu} is given to both '{first}' ({claims[first].how}) and "
                                 f"'{second}' ({claims[second].how}): each model needs its own GPUs")


def check_claims(claims: Mapping[str, GpuClaim], visible: int) -> None:
    """Refuse positions beyond the `visible` GPUs and GPUs shared by two models (one error, the
    first problem found, naming the model entry)."""
    for key, claim in claims.items():
        if any(p >= visible for p in claim.positions):
            have = f"{visible} GPU(s) are visible (positions 0-{visible - 1})" if visible else "no GPU is visible"
            cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise GpuAssignmentError(key, claim.field, f"needs GPU position(s) {sorted(claim.positions)} but {have}"
                                     + (f" (CUDA_VISIBLE_DEVICES={cvd!r})" if cvd is not None else ""))
    check_disjoint(claims)
