"""Which `checkpoint-<step>/` folder `lhd train` resumes from: the newest complete one.

A kill or a full disk while transformers saves a checkpoint leaves files cut short (the adapter, the
optimizer, scheduler or RNG state, or `trainer_state.json`, written last). Resuming from one fails
deep inside safetensors or torch with a traceback, so each file is opened first without loading it:
safetensors checks that its tensors cover the file exactly, a torch zip file must end in its central
directory, JSON must parse. A damaged newest checkpoint falls back to the one before it (a warning);
when none is complete, `lhd train` stops with one line."""
from __future__ import annotations

import json
import logging
import zipfile
from pathlib import Path

from lhd_train.errors import DataFileError

log = logging.getLogger(__name__)
PREFIX = "checkpoint-"


def file_problem(path: Path) -> str | None:
    """What is wrong with one checkpoint file, or None when it looks whole."""
    from safetensors import SafetensorError, safe_open

    if path.stat().st_size == 0:
        return "empty"
    try:
        if path.suffix == ".safetensors":
            with safe_open(str(path), "pt"):
                pass
        elif path.suffix in (".pt", ".pth", ".bin"):  # torch.save writes a zip file (a legacy pickle: not checked)
            with open(path, "rb") as f:
                if f.read(2) == b"PK":
                    zipfile.ZipFile(path).close()
        elif path.suffix == ".json":
            json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, SafetensorError, zipfile.BadZipFile) as e:
        return f"cut short or damaged ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
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
