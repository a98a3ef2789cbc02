"""The one file toolkit: append-only JSONL, atomic replacement, file hashes, YAML and JSON mappings;
the rules it shares with the lens library are `filekit`'s, worded here as lhd's errors.

Every stage writes and reads through these, so crash-safety rules (docs/formats.md: a line is one
`write` + flush + fsync; a torn last line is ignored by readers and cut by the next append; a
whole file is replaced through a temp file of its own) hold everywhere at once. A write that the
disk refuses (full, read-only, no permission, past `ulimit -f`) is a `StorageError`: one line
naming the file and saying what was kept."""
from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

import filekit
from filekit import printable as printable  # re-exported: lhd's toolkit names them
from filekit import sha256_file as sha256_file
from filekit import sha256_text as sha256_text
from lhd_train.errors import DataFileError, InputError, LhdError
from lhd_train.io.strict_yaml import load_yaml

# ---------------------------------------------------------------- refused writes

#: errno -> what the disk said, for the errors a user can fix (free space, permissions, limits)
STORAGE_ERRNOS: dict[int, str] = {
    errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
    errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
    errno.EPERM: "permission denied", errno.EFBIG: "the file would pass the size limit (ulimit -f)",
}


class StorageError(LhdError):
    """The disk refused a write. The message names the file, the reason and what was kept, so a
    full disk reads as one line instead of a traceback, and the user knows a rerun resumes."""

    def __init__(self, path: str | Path, reason: str, kept: str):
        self.path, self.reason, self.kept = str(path), reason, kept
        super().__init__(f"{path}: cannot write ({reason}); {kept}")


def storage_error(exc: OSError, path: str | Path, kept: str) -> LhdError | OSError:
    """`exc` as a `StorageError` when its errno is one of `STORAGE_ERRNOS`, else `exc` itself."""
    reason = STORAGE_ERRNOS.get(exc.errno or 0)
    return StorageError(path, reason, kept) if reason else exc


def check_writable_dir(directory: Path, what: str = "output folder") -> None:
    """Refuse a folder that cannot be written into before any work is done (a read-only run, a
    folder of someone else's): one line instead of a failure after the first model call."""
    d = Path(directory)
    while not d.exists() and d.parent != d:
        d = d.parent
    if not d.is_dir():
        raise InputError(directory, None, f"the {what} is not a folder ({d} is a file)")
    if not os.access(d, os.W_OK | os.X_OK):
        raise StorageError(directory, "the folder is not writable" if d == Path(directory) else
                           f"{d} is not writable", "nothing was written; choose another folder with --out")


# ---------------------------------------------------------------- JSON text

def json_text(obj: Any, indent: int | None = None) -> str:
    """JSON as UTF-8-safe text. A string holding a lone UTF-16 surrogate (a model's broken
    answer, `"\\ud800"` from a server) cannot be encoded as UTF-8; then every non-ASCII
    character is escaped instead (`\\ud800` is valid JSON and reads back to the same string), so
    the row is stored exactly and nothing downstream meets an unencodable character on disk."""
    try:
        text = json.dumps(obj, ensure_ascii=False, indent=indent)
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return json.dumps(obj, ensure_ascii=True, indent=indent)


# ---------------------------------------------------------------- JSONL

def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    """One line per call, with one `write`, flushed and fsynced, so a kill never leaves a
    half-written row behind anything that follows it. A torn last line left by an earlier crash
    (or by a full disk) is cut first, so the new row starts on a line of its own; a write the disk
    refuses is undone to the last whole line and raised as a `StorageError`."""
    data = (json_text(row) + "\n").encode("utf-8")
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise storage_error(e, path, "the rows before this one are kept; rerun to resume once the cause "
                                     "is fixed") from None
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            size = _cut_torn_tail(fd, size)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError as e:
            try:
                os.ftruncate(fd, size)  # no partial row left for a reader to meet
            except OSError:
                pass  # still torn: readers ignore a last line without its newline
            raise storage_error(e, path, f"the rows before this one are kept ({size} bytes, whole lines); "
                                         "rerun to resume once the cause is fixed") from None
    finally:
        os.close(fd)


def _cut_torn_tail(fd: int, size: int) -> int:
    """Cut the bytes after the last newline of an open file; the new size."""
    keep, pos = 0, size
    while pos > 0:
        start = max(0, pos - (1 << 16))
        block = os.pread(fd, pos - start, start)
        nl = block.rfind(b"\n")
        if nl >= 0:
            keep = start + nl + 1
            break
        pos = start
    os.ftruncate(fd, keep)
    return keep


def read_jsonl(path: Path, repair: str | None = None) -> list[dict[str, Any]]:
    """The rows of an append-only JSONL file ([] when it does not exist). A final line without its
    newline is a write torn by a crash and is ignored; any other line that is not a JSON object
    is a `DataFileError` naming the line (`repair`, when given, says how to mend that kind of file).
    Readers never change the file."""
    return [row for _, row in read_jsonl_lines(path, repair)]


def read_jsonl_lines(path: Path, repair: str | None = None,
                     hand_written: bool = False) -> list[tuple[int, dict[str, Any]]]:
    """`read_jsonl` with each row's line number, for messages that point at a line. `hand_written`:
    a final line without its newline is a row when it parses (a file written by hand or another
    tool often ends so); only one that does not parse is taken for a torn write."""
    if not path.exists():
        return []

    def bad(problem: str, line: int) -> DataFileError:
        return DataFileError(path, problem, line=line, repair=repair and repair.format(line=line))

    return filekit.jsonl_rows(path, bad, hand_written)


def repair_jsonl(path: Path) -> int:
    """Cut a torn final line so appends start on a clean line (writers only, under the run lock;
    `append_jsonl` does it too). Returns bytes removed."""
    if not path.exists():
        return 0
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return 0
    keep = data.rfind(b"\n") + 1
    try:
        with open(path, "r+b") as f:
            f.truncate(keep)
    except OSError as e:
        raise storage_error(e, path, "nothing was changed; readers ignore the torn last line") from None
    return len(data) - keep


# ---------------------------------------------------------------- atomic replacement

def _refused(exc: OSError, path: Path, existed: bool) -> LhdError | OSError:
    return storage_error(exc, path, f"the previous {path.name} is kept unchanged" if existed else "nothing was written")


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Replace `path` with what `write(tmp)` puts at a temp path of its own next to it, fsynced, so a
    reader sees the old file or the new one (`filekit.atomic_write`). A write the disk refuses leaves
    the old file as it was and is raised as a `StorageError`."""
    filekit.atomic_write(path, write, _refused)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    filekit.atomic_write_bytes(path, data, _refused)


def atomic_write_text(path: Path, text: str) -> None:
    """Text as UTF-8 through `atomic_write`; a lone surrogate is written as U+FFFD (`printable`)."""
    filekit.atomic_write_text(path, text, _refused)


def write_json_atomic(path: Path, obj: Any) -> None:
    """A JSON document (indented, UTF-8) written through `atomic_write_text`."""
    atomic_write_bytes(path, json_text(obj, indent=2).encode("utf-8"))


# ---------------------------------------------------------------- YAML / JSON mappings

def read_yaml_mapping(path: str | Path, what: str = "file", missing_ok: bool = False) -> dict[str, Any]:
    """A YAML file whose top level is a mapping, or an InputError naming the file ({} for a
    missing file when `missing_ok`)."""
    path = Path(path)
    if not path.is_file():
        if missing_ok:
            return {}
        raise InputError(path, None, f"{what} not found")
    try:
        data = load_yaml(path.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as e:
        raise InputError(path, None, f"not valid YAML: {yaml_problem(e)}") from None
    if not isinstance(data, dict):
        raise InputError(path, None, "the top level must be a mapping")
    return data


def yaml_problem(e: BaseException) -> str:
    """A YAML error as one line: the problem and its line and column (the file is named by the caller)."""
    mark = getattr(e, "problem_mark", None)
    if isinstance(e, yaml.MarkedYAMLError) and e.problem and mark is not None:
        return f"{e.problem} (line {mark.line + 1}, column {mark.column + 1})"
    return " ".join(str(e).split())


def read_json_mapping(path: Path) -> dict[str, Any]:
    """A JSON object from `path`: {} when the file is missing or holds no object; an InputError
    naming the file when it is not valid JSON."""
    path = Path(path)
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(path, None, f"not valid JSON: {e}") from None
    return data if isinstance(data, dict) else {}
