"""The lens's file toolkit: atomic replacement, JSON and CSV result files, JSONL input, hashes.

The rules are `filekit`'s, shared with lhd (a file is replaced through a fsynced temp file of its
own, a torn last JSONL line is ignored, a CSV cell never starts a formula); here a write the disk
refuses is a `LensError` naming the file and saying the old one was kept."""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import filekit
from filekit import sha256_file as sha256_file  # re-exported: the lens's toolkit names them
from filekit import sha256_text as sha256_text
from lens.errors import LensError, LensFileError


def _refused(exc: OSError, path: Path, existed: bool) -> LensError:
    return LensError(f"{path}: cannot write ({exc.strerror or exc}); the previous file, if any, is kept")


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Replace `path` with what `write(tmp)` puts at a temp path next to it (`filekit.atomic_write`)."""
    filekit.atomic_write(path, write, _refused)


def atomic_write_text(path: Path, text: str) -> None:
    """UTF-8 text through `atomic_write` (a lone surrogate of a model's text is written as U+FFFD)."""
    filekit.atomic_write_text(path, text, _refused)


def finite(o: Any) -> Any:
    """`o` as plain JSON values, recursively: numpy scalars and arrays as numbers and lists, NaN/inf as None."""
    if hasattr(o, "tolist"):  # a numpy array or scalar
        o = o.tolist()
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [finite(v) for v in o]
    return o


def write_json(path: Path, obj: Any) -> None:
    """`obj` as indented JSON (`finite`; anything else, such as a path, as its text), written atomically."""
    atomic_write_text(path, json.dumps(finite(obj), indent=2, default=str) + "\n")


def write_csv(df: Any, path: Path) -> Path:
    """A pandas DataFrame as a CSV table (no index), text cells and column names made safe, written atomically."""
    atomic_write_text(Path(path), filekit.safe_frame(df).to_csv(index=False))
    return Path(path)


def read_jsonl_rows(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """Each JSON object of a JSONL file with its line number (`filekit.jsonl_rows`, a file written by hand: a
    final line without its newline counts when it parses); a line that is not a JSON object is a
    `LensFileError` naming the line."""
    return filekit.jsonl_rows(path, lambda problem, line: LensFileError(path, problem, line=line), hand_written=True)


def utc_now() -> str:
    """ISO-8601 UTC timestamp to the second, the format of every `*_at` field."""
    return datetime.now(UTC).isoformat(timespec="seconds")
