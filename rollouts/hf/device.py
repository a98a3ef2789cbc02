"""Where the `hf` backend runs: the spec's `device` resolved to one explicit device, the worker
thread's CUDA context, the memory that device has free, and freeing cached memory after an
out-of-memory error.

Why explicit: `cuda` alone means "the current device", and the current CUDA device is per thread
(a new thread starts on device 0). The backend decodes in `asyncio.to_thread` workers, so a model
on `cuda:1` must have every kernel launched under `torch.cuda.device("cuda:1")` (xgrammar's
Triton bitmask kernel launches on the current device), and its memory measured on that device.
`cuda:N` counts within the devices this process sees (CUDA_VISIBLE_DEVICES), as torch does.
"""
from __future__ import annotations

import contextlib
import gc
import os
import re
from typing import Any

import torch

from rollouts.backend import BackendError


def resolve_device(requested: str, cuda_count: int, model: str = "") -> str:
    """`auto` → `cuda:0` when a GPU is visible, else `cpu`; `cuda` → `cuda:0`; `cuda:N` checked
    against the `cuda_count` visible devices. Anything else is refused, naming what is allowed."""
    where = f"{model}: " if model else ""
    if requested == "cpu":
        return "cpu"
    if requested == "auto":
        return "cuda:0" if cuda_count > 0 else "cpu"
    m = re.fullmatch(r"cuda(?::(\d+))?", requested)
    if m is None:
        raise BackendError(f"{where}device {requested!r} is not allowed (allowed: auto, cpu, cuda, cuda:N)")
    if cuda_count == 0:
        raise BackendError(f"{where}device {requested!r} requested but CUDA is not available")
    index = int(m.group(1) or 0)
    if index >= cuda_count:
        raise BackendError(f"{where}device {requested!r}: only {cuda_count} CUDA device(s) are visible "
                           f"(cuda:0..cuda:{cuda_count - 1}; CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    return f"cuda:{index}"


def device_context(device: str) -> Any:
    """Make `device` the thread's current CUDA device (no-op on CPU). Enter it in the thread that
    runs kernels: the decode worker, not the event loop."""
    if device.startswith("cuda"):
        return torch.cuda.device(torch.device(device))
    return contextlib.nullcontext()


def _cpu_available() -> int | None:
    """Bytes the OS reports available (Linux MemAvailable, else free pages), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def free_memory(device: str) -> tuple[int | None, int | None]:
    """(free, total) bytes on `device` now: CUDA from `torch.cuda.mem_get_info` on that device;
    CPU the available memory (total None)."""
    if device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info(torch.device(device))
        return int(free), int(total)
    return _cpu_available(), None


def release_cached(device: str) -> None:
    """After an out-of-memory error: collect the failed attempt's tensors and hand the
    allocator's cached blocks back, so the retry starts from the memory really in use."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
