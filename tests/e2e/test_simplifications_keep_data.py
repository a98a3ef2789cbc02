"""Issue 40 item 4: the threat model's simplifications keep data safe, and bad settings stay one line.

- A `RUN/.lock` that is a symbolic link to an outside file: `lhd audit` used to empty that file
  (the holder line is written into the lock and truncated at the end). The lock is now opened with
  `O_NOFOLLOW`, and a link, a hard link or a FIFO there is refused before anything is written.
- A 20 MB `task_pack:` value took ~46 s in PyYAML's pure-Python scanner and then ended in
  `OSError: File name too long`; it is now one line naming the field, in seconds.
- A prompt-set file nested past Python's recursion limit ended in `RecursionError`; it is now one
  line naming the file."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import yaml
from test_failure_modes import RUN, cli, lone, one_error, snapshot, write_config  # noqa: F401 - lone: a fixture

PRECIOUS = b"a file outside the run that a lock must never touch\n" * 3


@pytest.fixture
def run_copy(lone, tmp_path) -> Path:  # noqa: F811 - the fixture imported above
    shutil.copytree(lone, tmp_path / "runs" / RUN)
    return tmp_path / "runs" / RUN


def _symlink(lock: Path, outside: Path) -> None:
    lock.symlink_to(outside)


def _hardlink(lock: Path, outside: Path) -> None:
    os.link(outside, lock)


def _fifo(lock: Path, outside: Path) -> None:
    os.mkfifo(lock)


@pytest.mark.parametrize("plant", [_symlink, _hardlink, _fifo], ids=lambda f: f.__name__[1:])
def test_a_linked_lock_file_loses_nothing(plant, run_copy, tmp_path, monkeypatch, capsys):
    outside = tmp_path / "outside.txt"
    outside.write_bytes(PRECIOUS)
    lock = run_copy / ".lock"
    lock.unlink(missing_ok=True)
    plant(lock, outside)
    before = snapshot(run_copy)
    line = one_error(*cli(monkeypatch, capsys, "audit", str(run_copy), "auditor.model=tiny", "--no-progress"),
                     str(lock))
    assert "nothing was written" in line
    assert outside.read_bytes() == PRECIOUS
    assert snapshot(run_copy) == before
    if plant is _symlink:
        assert lock.is_symlink() and os.readlink(lock) == str(outside)  # left as found


def test_a_20_mb_task_pack_value_is_one_line_in_seconds(tmp_path, monkeypatch, capsys, tiny_llama_dir):
    cfg = write_config(tmp_path / "run.yaml", tiny_llama_dir, tmp_path / "runs")
    data = yaml.safe_load(cfg.read_text())
    data["task_pack"] = "p" * 20_000_000
    cfg.write_text(yaml.safe_dump(data, width=2**31))
    t0 = time.perf_counter()
    line = one_error(*cli(monkeypatch, capsys, "run", str(cfg), "--no-progress"), str(cfg), "'task_pack'",
                     "20,000,000 characters")
    assert time.perf_counter() - t0 < 15  # before: ~46 s in the YAML scanner, then an OSError
    assert len(line) < 300  # the value itself is not echoed
    assert not (tmp_path / "runs").exists()


def test_a_deeply_nested_prompt_set_is_one_line_naming_the_file(tmp_path, monkeypatch, capsys, tiny_llama_dir):
    deep = tmp_path / "deep.json"
    deep.write_text('{"items": ' + "[" * 100_000 + "]" * 100_000 + "}")
    (tmp_path / "lens").mkdir()
    line = one_error(*cli(monkeypatch, capsys, "lens", "eval", str(tiny_llama_dir), "--readout",
                          f"jacobian={tmp_path / 'lens'}", "--out", str(tmp_path / "out"), "--prompt-set", str(deep)),
                     str(deep))
    assert "nested" in line
    assert not (tmp_path / "out").exists()
