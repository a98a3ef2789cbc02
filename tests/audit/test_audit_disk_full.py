"""Issue 31, item 5 (audit): an audit whose disk fills up ends with the disk's one line.

Before: each round's error said the disk was full, but the audit went on asking the model for
every remaining round and ended with "some rounds have no row yet (model unreachable); run the
same command again" (exit 3). Now the first refused write stops the audit: no further model
calls, exit 2, one `error:` line naming the audit file, the reason and what was kept."""
from __future__ import annotations

import errno
import os

from support.scripted import ScriptedBackend
from test_auditor import auditor_script, make_run
from test_failure_modes import cli, one_error


def test_a_full_disk_stops_the_audit_with_one_line(tmp_path, monkeypatch, capsys):
    import rollouts.backends

    cfg, (tid,) = make_run(tmp_path)
    rounds = len((cfg.run_dir / "trials" / f"{tid}.jsonl").read_text().splitlines())
    backend = ScriptedBackend(auditor_script())
    monkeypatch.setattr(rollouts.backends, "build_backend", lambda *a, **k: backend)
    rows_file = cfg.run_dir / "audit" / "m-full" / f"{tid}.jsonl"
    real, refused = os.write, []

    def write(fd, data):  # the disk is full for the audit rows (auditor.json was written before)
        if os.readlink(f"/proc/self/fd/{fd}") == str(rows_file):
            refused.append(fd)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    code, out = cli(monkeypatch, capsys, "audit", str(cfg.run_dir), "--no-progress")
    line = one_error(code, out, str(rows_file), "disk is full", "rerun")
    assert "unreachable" not in out, out
    assert len(backend.requests) < rounds, len(backend.requests)  # stopped asking once the disk refused a row
    monkeypatch.setattr(os, "write", real)
    assert not rows_file.exists() or rows_file.read_bytes() == b""  # nothing torn left behind
    # the disk has room again: the same command finishes the audit
    code, out = cli(monkeypatch, capsys, "audit", str(cfg.run_dir), "--no-progress")
    assert code == 0, out
    assert len(rows_file.read_text().splitlines()) == rounds, line
    assert refused
