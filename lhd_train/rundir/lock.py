"""One writer per run directory: an exclusive `flock` on `<dir>/.lock`, held for a whole stage.

Two writers on one directory once interleaved and duplicated every trial's rounds, so every stage
that writes into a run directory holds this lock and a second one is refused with `RunDirLocked`
(naming the holder), without waiting. `flock` because the kernel releases it however its process
ends, so a crash leaves no stale lock. The lock file is opened without following a link and
refused when not a plain file of its own; the lock is per process and re-entrant. docs/formats.md,
"Threat model" and "The lock"."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from lhd_train.errors import LhdError
from lhd_train.io.files import STORAGE_ERRNOS, storage_error
from lhd_train.io.provenance import utc_now
from lhd_train.rundir.layout import LOCK as LOCK_NAME

# Directories this process holds: resolved path -> (fd, depth).
_HELD: dict[Path, list[int]] = {}


class RunDirLocked(LhdError):
    """Another process is writing into this directory now."""

    def __init__(self, directory: Path, holder: dict[str, object] | None):
        self.directory, self.holder = directory, holder or {}
        h = self.holder
        who = f"PID {h['pid']}" if h.get("pid") else "another process"
        if h.get("stage"):
            who += f" ({h['stage']}"
            who += f", host {h['host']}" if h.get("host") and h.get("host") != socket.gethostname() else ""
            who += f", since {h['since']})" if h.get("since") else ")"
        super().__init__(f"{directory}: in use by {who}; two writers would interleave their rows, so wait for "
                         f"it to finish or stop it (its lock ends with the process: {directory / LOCK_NAME})")


def _read_holder(path: Path) -> dict[str, object] | None:
    """The holder line of a lock file. The holder writes it right after locking, so a reader that
    arrives in between sees an empty file: look again for a moment before giving up."""
    for _ in range(20):
        try:
            text = path.read_text(encoding="utf-8").strip()
            if text:
                data = json.loads(text)
                if isinstance(data, dict):
                    return data
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    return None


@contextmanager
def _lock_one(directory: Path, stage: str) -> Iterator[None]:
    created = not directory.exists()
    path = directory / LOCK_NAME
    key = path.resolve()
    if key in _HELD:  # re-entrant within one process
        _HELD[key][1] += 1
        try:
            yield
        finally:
            _HELD[key][1] -= 1
        return
    while True:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            # The holder line is written into the lock file, and emptied at the end: through a
            # symbolic link that would empty the file it points to, so a link is never followed.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise LhdError(f"{path}: a symbolic link, not a lock file; lhd writes into its lock file and "
                               "never follows a link there, so nothing was written: remove the link") from None
            raise storage_error(e, path, "nothing was written") if e.errno in STORAGE_ERRNOS else LhdError(
                f"{path}: cannot create the lock file ({e.strerror}); is the folder writable?") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:  # a FIFO, a device, a file also named elsewhere
            os.close(fd)
            what = "a hard link to another file" if stat.S_ISREG(st.st_mode) else "not a regular file"
            raise LhdError(f"{path}: {what}; lhd writes into its lock file, so nothing was written: remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunDirLocked(directory, _read_holder(path)) from None
            raise LhdError(f"{path}: cannot lock the run directory ({e.strerror}); its file system may not "
                           "support flock") from None
        # The file may have been removed (and a new one made) between open and flock by a holder
        # cleaning up a directory it created: then this lock guards nothing; take the new file's.
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    holder = {"pid": os.getpid(), "stage": stage, "host": socket.gethostname(),
              "since": utc_now()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    _HELD[key] = [fd, 1]
    try:
        yield
    finally:
        del _HELD[key]
        os.ftruncate(fd, 0)
        # A directory this stage created and left with nothing but the lock (a refused merge, a
        # failed start) is removed, so the failure leaves the disk as it was.
        if created and [p.name for p in directory.iterdir()] == [LOCK_NAME]:
            path.unlink()
            try:
                directory.rmdir()
            except OSError:
                pass
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


@contextmanager
def run_dir_lock(*directories: Path | str | None, stage: str) -> Iterator[None]:
    """Hold the lock of every directory given (created when missing; None entries are skipped),
    for the body of the `with`. Raises `RunDirLocked` naming the holder when one is busy."""
    seen: dict[Path, Path] = {}  # resolved -> as given (messages name the path the user gave)
    for d in directories:
        if d is not None:
            seen.setdefault(Path(d).resolve(), Path(d))
    with ExitStack() as stack:
        for d in seen.values():
            stack.enter_context(_lock_one(d, stage))
        yield
