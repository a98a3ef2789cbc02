"""Append-only JSONL files and the content-addressed message store (see docs/formats.md)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterator


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    """One line per call, flushed and fsynced, so a kill never leaves a half-written row behind
    anything that follows it (a torn last line is dropped by `read_jsonl`/`repair_jsonl`)."""
    line = json.dumps(row, ensure_ascii=False) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break  # torn by a crash mid-write
            line = line.strip()
            if line:
                rows.append(json.loads(line))
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


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)


def message_id(role: str, content: str) -> str:
    return hashlib.sha256(f"{role}\0{content}".encode()).hexdigest()[:16]


class MessageStore:
    """Each distinct message stored once; calls reference messages by id."""

    def __init__(self, path: Path):
        self.path = path
        repair_jsonl(path)
        self._known: dict[str, dict[str, str]] = {r["id"]: r for r in read_jsonl(path)}

    def put(self, messages: list[dict[str, str]]) -> list[str]:
        ids = []
        for m in messages:
            mid = message_id(m["role"], m["content"])
            if mid not in self._known:
                row = {"id": mid, "role": m["role"], "content": m["content"]}
                append_jsonl(self.path, row)
                self._known[mid] = row
            ids.append(mid)
        return ids

    def get(self, ids: list[str]) -> list[dict[str, str]]:
        return [{"role": self._known[i]["role"], "content": self._known[i]["content"]} for i in ids]

    def __contains__(self, mid: str) -> bool:
        return mid in self._known


def iter_trial_files(run_dir: Path) -> Iterator[Path]:
    for p in sorted((run_dir / "trials").glob("*.jsonl")):
        if not p.name.endswith(".messages.jsonl"):
            yield p
