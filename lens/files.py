"""The lens's file toolkit: atomic replacement, JSON and CSV result files, JSONL input, hashes.

A file is replaced through a temp file of its own, fsynced before the rename, so a reader sees
the old file or the new one, never half of one (the rule of docs/formats.md). A write the disk
refuses is a `LensError` naming the file and saying the old one was kept."""
from __future__ import annotations

import hashlib
import json
import math
import os
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from lens.errors import LensError, LensFileError

#: a text cell starting with one of these runs as a formula in a spreadsheet; it is written with a leading `'`
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Replace `path` with what `write(tmp)` puts at a temp path next to it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(str(tmp))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise LensError(f"{path}: cannot write ({e.strerror or e}); the previous file, if any, is kept") from None
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """UTF-8 text through `atomic_write` (a lone surrogate of a model's text is written as `?`)."""
    data = text.encode("utf-8", "replace")

    def write(tmp: str) -> None:
        with open(tmp, "xb") as f:  # "x": never someone else's file
            f.write(data)

    atomic_write(path, write)


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


def safe_cell(value: Any) -> Any:
    """A text cell that cannot start a spreadsheet formula; anything else unchanged."""
    return "'" + value if isinstance(value, str) and value.startswith(FORMULA_START) else value


def write_csv(df: Any, path: Path) -> Path:
    """A pandas DataFrame as a CSV table (no index), text cells and column names made safe, written atomically."""
    out = df.copy()
    for col in out.columns:
        if out[col].dtype == object or str(out[col].dtype) in ("string", "str"):
            out[col] = out[col].map(safe_cell)
    out.columns = [safe_cell(c) for c in out.columns]
    atomic_write_text(Path(path), out.to_csv(index=False))
    return Path(path)


def read_jsonl_rows(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """Each JSON object of a JSONL file with its line number. A final line without its newline that does
    not parse is a write torn by a crash and is ignored; any other line that is not a JSON object is a
    `LensFileError` naming the line."""
    rows: list[tuple[int, dict[str, Any]]] = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8").strip()
                row = json.loads(line) if line else None
            except (ValueError, RecursionError) as e:
                if not raw.endswith(b"\n"):
                    break
                raise LensFileError(path, f"not valid JSON ({getattr(e, 'msg', e)})", line=n) from None
            if row is None:
                continue
            if not isinstance(row, dict):
                raise LensFileError(path, f"a JSON {type(row).__name__}, not an object", line=n)
            rows.append((n, row))
    return rows


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's bytes, read in chunks (weights are many GB)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def utc_now() -> str:
    """ISO-8601 UTC timestamp to the second, the format of every `*_at` field."""
    return datetime.now(UTC).isoformat(timespec="seconds")
