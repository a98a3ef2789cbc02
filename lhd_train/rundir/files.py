"""The one file toolkit: append-only JSONL, atomic replacement, file hashes, UTC timestamps, YAML
and JSON mappings, package versions.

Every stage writes and reads through these, so crash-safety rules (docs/formats.md: a line is one
`write` + flush + fsync; a torn last line is ignored by readers and cut by a resuming writer; a
whole file is replaced through a temp file of its own) hold everywhere at once."""
from __future__ import annotations

import hashlib
import json
import os
import sys
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from lhd_train.errors import DataFileError, InputError

# Packages whose versions are recorded with every run, audit, dataset and adapter.
PACKAGES: tuple[str, ...] = ("lhd", "torch", "transformers", "tokenizers", "trl", "peft", "accelerate", "datasets",
                             "xgrammar", "openai", "vllm", "bitsandbytes", "wandb", "deepspeed")


# ---------------------------------------------------------------- JSONL

def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    """One line per call, flushed and fsynced, so a kill never leaves a half-written row behind
    anything that follows it (a torn last line is dropped by `read_jsonl`/`repair_jsonl`)."""
    line = json.dumps(row, ensure_ascii=False) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: Path, repair: str | None = None) -> list[dict[str, Any]]:
    """The rows of an append-only JSONL file ([] when it does not exist). A final line without its
    newline is a write torn by a crash and is ignored; any other line that is not a JSON object
    is a `DataFileError` naming the line (`repair`, when given, says how to mend that kind of file)."""
    return [row for _, row in read_jsonl_lines(path, repair)]


def read_jsonl_lines(path: Path, repair: str | None = None) -> list[tuple[int, dict[str, Any]]]:
    """`read_jsonl` with each row's line number, for messages that point at a line."""
    if not path.exists():
        return []
    rows: list[tuple[int, dict[str, Any]]] = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):
                break  # torn by a crash mid-write
            try:
                line = raw.decode("utf-8").strip()
                if not line:
                    continue
                row = json.loads(line)
            except ValueError as e:  # UnicodeDecodeError and JSONDecodeError both
                raise DataFileError(path, f"not valid JSON ({getattr(e, 'msg', e)}, column {getattr(e, 'colno', '?')})",
                                    line=n, repair=repair and repair.format(line=n)) from None
            if not isinstance(row, dict):
                raise DataFileError(path, f"a JSON {type(row).__name__}, not an object", line=n,
                                    repair=repair and repair.format(line=n))
            rows.append((n, row))
    return rows


def repair_jsonl(path: Path) -> int:
    """Cut a torn final line so appends start on a clean line. Returns bytes removed."""
    if not path.exists():
        return 0
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return 0
    keep = data.rfind(b"\n") + 1
    with open(path, "r+b") as f:
        f.truncate(keep)
    return len(data) - keep


# ---------------------------------------------------------------- atomic replacement

def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Replace `path` with what `write(tmp)` puts at a temp path of its own next to it (two writers
    never share a temp name; the file's mode comes from the umask), fsynced before the replace,
    so a reader sees the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write(str(tmp))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "x", encoding="utf-8") as f:  # "x": never someone else's file
            f.write(text)

    atomic_write(path, write)


def write_json_atomic(path: Path, obj: Any) -> None:
    """A JSON document (indented, UTF-8) written through `atomic_write_text`."""
    atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False))


# ---------------------------------------------------------------- hashes, time, versions

def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's bytes, read in chunks (model weights are many GB)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def utc_now(timespec: str = "seconds") -> str:
    """ISO-8601 UTC timestamp, the one format of every `*_at` field."""
    return datetime.now(UTC).isoformat(timespec=timespec)


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """Installed versions of `names` (None when not installed), for provenance records."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def python_version() -> str:
    return sys.version.split()[0]


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
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise InputError(path, None, f"not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise InputError(path, None, "the top level must be a mapping")
    return data


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
