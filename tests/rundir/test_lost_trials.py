"""Issue 31, item 1: a finished trial whose rows are gone, or a `.done` marker that is not one,
is refused by every reader (view, export, audit, report, data) as `lhd run` refuses it: one
`error:` line naming the trial and the repair, and no file of the run changed.

Before: the readers listed trials by their rows files only, so a trial whose rows were deleted
vanished from view, export and audit (exit 0) and from the report (a note in summary.md); and a
`.done` marker that was not JSON was read as the oldest marker format (a bare timestamp, with no
round count), so a rows file cut short under it read as a finished trial."""
from __future__ import annotations

import pytest
from test_auditor import make_run
from test_failure_modes import cli, one_error

from lhd_train.errors import DataFileError
from lhd_train.rundir.run import Run
from lhd_train.rundir.store import read_done_marker


def _tree(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != ".lock"}


@pytest.fixture
def two_trials(tmp_path):
    """A run of two finished scripted trials (s7, s8) of four tasks."""
    cfg, tids = make_run(tmp_path, seeds=(7, 8))
    assert tids == ["s7", "s8"]
    return cfg.run_dir


def _readers(run_dir, out):
    return [("view", str(run_dir), "--out", str(out / "v")),
            ("export", str(run_dir), "--out", str(out / "ds")),
            ("audit", str(run_dir), "--no-progress"),
            ("report", str(run_dir), "--out", str(out / "rep")),
            ("data", "grpo", str(run_dir), "--out", str(out / "d"))]


@pytest.mark.parametrize("lost", ["s7", "s8"])  # the run's first trial and its last
def test_every_reader_refuses_a_finished_trial_whose_rows_were_deleted(lost, two_trials, tmp_path, monkeypatch,
                                                                       capsys):
    run_dir = two_trials
    (run_dir / "trials" / f"{lost}.jsonl").unlink()
    before = _tree(run_dir)
    for args in _readers(run_dir, tmp_path / "out"):
        line = one_error(*cli(monkeypatch, capsys, *args), f"{lost}.done", f"marks trial {lost} finished",
                         "is missing", f"restore {lost}.jsonl")
        assert f"delete {lost}.done" in line, (args[0], line)
    assert _tree(run_dir) == before
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.csv"))
    assert lost in Run.open(run_dir).trial_ids()  # the marker keeps the trial in the run's list


@pytest.mark.parametrize("garbage", [b"garbage\n", b"", b"\xff\xfe\x00junk", b"{}", b"[1, 2]"])
def test_every_reader_refuses_a_garbage_marker_over_cut_rows(garbage, two_trials, tmp_path, monkeypatch, capsys):
    run_dir = two_trials
    rows = run_dir / "trials" / "s7.jsonl"
    rows.write_bytes(b"".join(rows.read_bytes().splitlines(True)[:-2]))  # cut short: two rounds lost
    (run_dir / "trials" / "s7.done").write_bytes(garbage)
    before = _tree(run_dir)
    for args in _readers(run_dir, tmp_path / "out"):
        line = one_error(*cli(monkeypatch, capsys, *args), "s7.done", "not a .done marker")
        assert "delete it" in line, (args[0], line)
    assert _tree(run_dir) == before


def test_the_oldest_marker_a_bare_timestamp_still_reads(two_trials):
    done = two_trials / "trials" / "s7.done"
    done.write_text("2025-01-01T00:00:00+00:00\n")
    marker = read_done_marker(done)
    assert marker is not None and marker.finished_at == "2025-01-01T00:00:00+00:00" and marker.rounds is None
    rows, finished = Run.open(two_trials).trial("s7").read()
    assert finished and len(rows) > 0


def test_rows_holds_the_marker_rule_too(two_trials):
    """`TrialStore.rows()` (used by `lhd data`, the report's usage table and the planted copies) is
    held against the marker like `read()`: one rule for every reader."""
    (two_trials / "trials" / "s7.jsonl").unlink()
    with pytest.raises(DataFileError, match="marks trial s7 finished"):
        Run.open(two_trials).trial("s7").rows()
