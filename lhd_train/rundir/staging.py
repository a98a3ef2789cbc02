"""Whole folders built aside and put in place at the end: an import, a merged dataset.

A stage that fills a folder file by file leaves half of it behind when it is refused, killed or
meets a full disk, and the next try then finds a folder it does not recognise. `staged_dir`
builds in a hidden sibling folder (same file system, so the final step is a rename) and swaps it
in only when the body finished; on any failure the sibling is removed and the target is as it
was. A kill -9 can leave a sibling `.NAME.staging-<host>-<pid>-*` behind: it never blocks a retry
(each try has a name of its own) and the next successful try on the same host removes it once
its process is gone. A process id means nothing on another host of a shared cluster file system,
so a sibling of another host is left alone (it may be a job still running there)."""
from __future__ import annotations

import os
import shutil
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lhd_train.io.files import storage_error
from lhd_train.rundir.layout import LOCK

STAGING = ".staging-"


def _siblings(target: Path, kind: str) -> list[Path]:
    return sorted(target.parent.glob(f".{target.name}{kind}*")) if target.parent.is_dir() else []


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


@contextmanager
def staged_dir(target: Path, copy_existing: bool = False) -> Iterator[Path]:
    """Yield an empty (or, with `copy_existing`, a copy of `target`) hidden sibling folder; when the
    body returns, it replaces `target`. Raises `StorageError` (nothing changed) when the disk
    refuses the copy or the swap."""
    target = Path(target)
    stage = target.with_name(f".{target.name}{STAGING}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            if copy_existing and target.is_dir():
                shutil.copytree(target, stage, symlinks=True, ignore=shutil.ignore_patterns(LOCK))  # not the lock
            else:
                stage.mkdir()
        except OSError as e:
            raise storage_error(e, stage, f"{target} is unchanged") from None
        yield stage
        swap_in(stage, target)
    finally:
        _remove(stage)
    for old in _siblings(target, STAGING):  # left by an earlier try that was killed
        if _dead_here(old.name.rsplit(STAGING, 1)[-1]):
            _remove(old)


def _dead_here(tag: str) -> bool:
    """Whether the try that named its folder `<host>-<pid>-<random>` ran on this host and its
    process is gone (`<pid>-<random>`: an older name, without its host, taken for this host's)."""
    parts = tag.rsplit("-", 2)
    host, pid = (parts[0], parts[1]) if len(parts) == 3 else (socket.gethostname(), parts[0])
    return host == socket.gethostname() and not _alive(pid)


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def swap_in(stage: Path, target: Path) -> None:
    """Put the folder `stage` at `target`: a rename when `target` is absent; otherwise `target`
    is moved aside first and removed after (between the two renames a kill leaves the old
    folder at `.NAME.old-*`, never a mix of both)."""
    old = target.with_name(f".{target.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        if target.exists():
            os.rename(target, old)
        os.rename(stage, target)
    except OSError as e:
        if old.exists() and not target.exists():
            os.rename(old, target)
        raise storage_error(e, target, f"{target} is unchanged") from None
    _remove(old)
