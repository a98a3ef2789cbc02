"""Which `checkpoint-<step>/` folder `lhd train` resumes from: the newest complete one.

A kill or a full disk while transformers saves a checkpoint leaves files cut short: the adapter
(`adapter_model.safetensors`), the optimizer, scheduler or RNG state (torch's zip files), or
`trainer_state.json` (written last). Resuming from such a folder fails deep inside safetensors or
torch with a traceback, so every file is checked from its own structure first, without loading
it: a safetensors file must be exactly as long as its header says, a torch zip file must end in
its central directory, a JSON file must parse. A damaged newest checkpoint falls back to the one
before it (logged as a warning); when none is complete, `lhd train` stops with one line."""
from __future__ import annotations

import json
import logging
import struct
import zipfile
from pathlib import Path

from lhd_train.errors import DataFileError

log = logging.getLogger(__name__)
PREFIX = "checkpoint-"


def _safetensors_problem(path: Path, size: int) -> str | None:
    """A safetensors file is an 8-byte header length, the JSON header, then the tensor data; its
    last tensor must end where the file ends."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                return f"cut short ({size} bytes, its header alone needs {n + 8})"
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as e:
        return f"not readable ({type(e).__name__})"
    ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    expected = 8 + n + max(ends, default=0)
    return None if size == expected else f"cut short ({size} of {expected} bytes)"


def _torch_problem(path: Path) -> str | None:
    """torch.save writes a zip file; one cut short has lost its central directory (the end). A
    file in the legacy (non-zip) format is not checked."""
    with open(path, "rb") as f:
        if f.read(2) != b"PK":
            return None
    try:
        with zipfile.ZipFile(path):
            return None
    except (zipfile.BadZipFile, OSError):
        return "cut short (its zip directory is missing)"


def file_problem(path: Path) -> str | None:
    """What is wrong with one checkpoint file, or None when it looks whole."""
    size = path.stat().st_size
    if size == 0:
        return "empty"
    if path.suffix == ".safetensors":
        return _safetensors_problem(path, size)
    if path.suffix in (".pt", ".pth", ".bin"):
        return _torch_problem(path)
    if path.suffix == ".json":
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return "not whole JSON (cut short?)"
    return None


def checkpoint_problem(d: Path) -> str | None:
    """Why the checkpoint folder `d` cannot be resumed from, or None when it can. transformers
    writes trainer_state.json last, so it must be there and name its step."""
    try:
        state = json.loads((d / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "trainer_state.json is missing or torn"
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        return "trainer_state.json has no global_step"
    for f in sorted(d.iterdir()):
        problem = file_problem(f) if f.is_file() else None
        if problem is not None:
            return f"{f.name} is {problem}"
    return None


def checkpoints(output_dir: Path) -> list[Path]:
    """Every `checkpoint-<step>` folder, by step."""
    if not output_dir.is_dir():
        return []
    found = [(int(d.name[len(PREFIX):]), d) for d in output_dir.iterdir()
             if d.is_dir() and d.name.startswith(PREFIX) and d.name[len(PREFIX):].isdigit()]
    return [d for _, d in sorted(found)]


def resume_checkpoint(output_dir: Path) -> Path | None:
    """The checkpoint to resume from: None when there is none; the newest complete one, with a
    warning naming each newer one left aside and why; a `DataFileError` (one line) when every
    checkpoint is damaged."""
    found = checkpoints(output_dir)
    damaged: list[tuple[Path, str]] = []
    for d in reversed(found):
        problem = checkpoint_problem(d)
        if problem is None:
            for bad, why in damaged:
                log.warning("%s is incomplete (%s); resuming from %s instead", bad.name, why, d.name)
            return d
        damaged.append((d, problem))
    if not damaged:
        return None
    newest, why = damaged[0]
    older = f"; so are the {len(damaged) - 1} older one(s)" if len(damaged) > 1 else ""
    raise DataFileError(newest, f"this checkpoint is incomplete ({why}){older}: nothing to resume from",
                        repair=f"delete the {PREFIX}* folders of {output_dir} to train from the start")
