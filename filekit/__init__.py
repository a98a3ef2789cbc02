"""The file rules lhd and the lens library share, below both (it imports neither): atomic replacement,
JSONL reading with the torn-line rule, safe CSV cells, hashes (docs/formats.md).

A file is replaced through a temp file of its own, fsynced before the rename and the folder after,
so a reader sees the old file or the new one, never half of one. A final JSONL line without its
newline is a write torn by a crash and is ignored. A CSV text cell that would start a spreadsheet
formula gets a leading `'`; a lone UTF-16 surrogate is shown as U+FFFD. Each caller words its own
errors: a refused write goes to its `refused(exc, path, existed)`, a bad JSONL line to its
`bad(problem, line)`, so lhd raises `StorageError` / `DataFileError` and lens `LensError`."""
from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

Refused = Callable[[OSError, Path, bool], BaseException]

# ---------------------------------------------------------------- text and CSV cells

_SURROGATE = re.compile("[\ud800-\udfff]")

#: a text cell starting with one of these runs as a formula in a spreadsheet; it is written with a leading `'`
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def printable(text: str) -> str:
    """`text` with each lone surrogate shown as U+FFFD, for output that must be valid UTF-8."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)


def safe_cell(value: Any) -> Any:
    """A text cell that cannot start a formula (and is valid UTF-8); anything else unchanged."""
    if not isinstance(value, str):
        return value
    value = printable(value)
    return "'" + value if value.startswith(FORMULA_START) else value


def safe_frame(df: Any) -> Any:
    """A copy of a pandas DataFrame whose text cells (and column names) pass through `safe_cell`."""
    out = df.copy()
    for col in out.columns:
        if out[col].dtype == object or str(out[col].dtype) in ("string", "str"):
            out[col] = out[col].map(safe_cell)
    out.columns = [safe_cell(c) for c in out.columns]
    return out


# ---------------------------------------------------------------- atomic replacement

def atomic_write(path: Path, write: Callable[[str], None], refused: Refused) -> None:
    """Replace `path` with what `write(tmp)` puts at a temp path of its own next to it (two writers never
    share a temp name). An OSError leaves the old file as it was and is raised as `refused(exc, path, existed)`."""
    path = Path(path)
    existed = path.exists()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(str(tmp))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException as e:
        try:
            if os.path.exists(tmp):
                os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise refused(e, path, existed) from None
        raise


def _fsync_dir(directory: Path) -> None:
    """Make a rename durable (best effort: some file systems refuse to fsync a folder)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, refused: Refused) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "xb") as f:  # "x": never someone else's file
            f.write(data)

    atomic_write(path, write, refused)


def atomic_write_text(path: Path, text: str, refused: Refused) -> None:
    """Text as UTF-8 through `atomic_write`; a lone surrogate is written as U+FFFD (`printable`)."""
    atomic_write_bytes(path, printable(text).encode("utf-8"), refused)


# ---------------------------------------------------------------- JSONL

def jsonl_rows(path: Path, bad: Callable[[str, int], BaseException],
               hand_written: bool = False) -> list[tuple[int, dict[str, Any]]]:
    """Each JSON object of a JSONL file with its line number. A final line without its newline is a torn
    write and is ignored (`hand_written`: only when it does not parse); any other line that is not a JSON
    object is raised as `bad(problem, line)`."""
    rows: list[tuple[int, dict[str, Any]]] = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            torn = not raw.endswith(b"\n")  # by a crash mid-write, unless hand written
            if torn and not hand_written:
                break
            try:
                line = raw.decode("utf-8").strip()
                if not line:
                    continue
                row = json.loads(line)
            except (ValueError, RecursionError) as e:  # UnicodeDecodeError, JSONDecodeError, nesting too deep
                if torn:
                    break
                raise bad(f"not valid JSON ({getattr(e, 'msg', e)}, column {getattr(e, 'colno', '?')})", n) from None
            if not isinstance(row, dict):
                raise bad(f"a JSON {type(row).__name__}, not an object", n)
            rows.append((n, row))
    return rows


# ---------------------------------------------------------------- hashes

def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's bytes, read in chunks (model weights are many GB)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
