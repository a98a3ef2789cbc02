"""Checkpoints of the long lens jobs (`lhd lens fit`, `lhd lens tune`).

Written atomically (a kill leaves the previous checkpoint or none, never half of one), and read back
only when the settings that shape the result are those saved, and the model's files are those the
run started on: a resume must never mix two runs in one lens."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from lens.errors import LensError
from lens.files import atomic_write
from rollouts.model_files import changed_parts


def save_checkpoint(path: Path, payload: dict[str, Any], settings: dict[str, Any]) -> None:
    """`payload` (tensors, numbers, lists) with `settings` as JSON, so `load_checkpoint` can compare them."""
    obj = {**payload, "settings": json.dumps(settings, sort_keys=True)}
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def load_checkpoint(path: Path, settings: dict[str, Any], *, job: str) -> dict[str, Any]:
    """The saved payload, once its settings equal `settings` (the `model_files` fingerprint compared by part).

    `job` names the run in the errors ("fit", "tuned-lens training"), each of which says how to go on."""
    redo = f"delete it to start the {job} again, or pass --no-resume"
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
        saved = json.loads(obj["settings"])
    except Exception as exc:  # noqa: BLE001 - a torn or foreign file fails in many ways
        why = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
        raise LensError(f"{path}: not a readable {job} checkpoint ({why}); {redo}") from None
    if not isinstance(saved, dict):
        raise LensError(f"{path}: not a readable {job} checkpoint (its settings are not a mapping); {redo}")
    changed = changed_parts({"parts": saved.get("model_files")} if saved.get("model_files") else None,
                            {"parts": settings.get("model_files")} if settings.get("model_files") else None)
    if changed:
        raise LensError(f"{path}: the model's {' and '.join(changed)} changed since this checkpoint was written; "
                        f"resuming would mix two models in one lens: restore them, or use another --out or "
                        "--no-resume")
    diff = {k: (saved.get(k), settings.get(k)) for k in set(saved) | set(settings)
            if saved.get(k) != settings.get(k) and k != "model_files"}
    if diff:
        lines = "; ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in sorted(diff.items()))
        raise LensError(f"{path}: cannot resume with different settings ({lines}); use another --out or --no-resume")
    return obj


def checkpoint_due(every: int, minutes: float, done_since: int, seconds_since: float) -> bool:
    """Every `every` units of work (prompts, steps) if set, and whenever `minutes` of wall time have passed.

    Time is the default cadence: a fit's checkpoint holds both fp32 sums, `2·n_src·d²·4` bytes (4.2 GB
    for an 8B model), and a tuned lens's its translators with Adam's two moments (6.2 GB), so a write
    every few units would be hundreds of GB per run."""
    if every > 0 and done_since >= every:
        return True
    return minutes > 0 and seconds_since >= 60 * minutes


def incomplete(path: Path, exc: BaseException, *, job: str) -> LensError:
    """The error for a checkpoint that loads but lacks a field its job needs."""
    return LensError(f"{path}: not a complete {job} checkpoint (field {exc}); delete it to start the {job} again, "
                     "or pass --no-resume")
