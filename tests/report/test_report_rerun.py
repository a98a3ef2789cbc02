"""Issue 31, item 2: `lhd report RUN --out DIR` can be rerun into DIR.

Before: the report's own `trials/` page folder made DIR match the run-directory rule (a folder
with `trials/`), so the second `lhd report ... --out DIR` was refused with "DIR is a run
directory" and a suggested path inside the report. Now the report writes a marker file
(`lhd_report.json`); a folder holding it is a report, never a run, and a rerun into it replaces
the whole report (pages of a run no longer in it are gone)."""
from __future__ import annotations

import json

from support.synthetic import R, write_run
from test_failure_modes import cli, one_error

from lhd_train.rundir.layout import REPORT_MARKER


def _run(root, name: str):
    rounds = [R(1 + i // 2, None, (0.3 - 0.05 * i, 0.2, 0.1), (i % 2 == 0, ["FALSIFICATION"] if i % 2 == 0 else [], 2),
                text=f"answer {i}") for i in range(4)]
    return write_run(root, name, {"s1": rounds, "s2": rounds})


def test_a_report_can_be_rerun_into_its_own_folder_and_replaces_it(tmp_path, monkeypatch, capsys):
    a, b = _run(tmp_path / "runs", "a"), _run(tmp_path / "runs", "b")
    out = tmp_path / "rep"
    code, text = cli(monkeypatch, capsys, "report", str(a), str(b), "--out", str(out))
    assert code == 0, text
    assert sorted(p.name for p in (out / "trials").iterdir()) == ["a", "b"]
    first = (out / REPORT_MARKER).read_text() if (out / REPORT_MARKER).exists() else None
    code, text = cli(monkeypatch, capsys, "report", str(a), "--out", str(out))  # before: "is a run directory"
    assert code == 0, text
    assert first is not None and json.loads(first)["runs"] == [str(a), str(b)]
    assert sorted(p.name for p in (out / "trials").iterdir()) == ["a"]  # b's pages went with the old report
    assert json.loads((out / REPORT_MARKER).read_text())["runs"] == [str(a)]
    assert "b (" not in (out / "summary.md").read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".rep")]  # no staging folder left behind


def test_a_report_folder_is_not_a_run(tmp_path, monkeypatch, capsys):
    a = _run(tmp_path / "runs", "a")
    out = tmp_path / "rep"
    assert cli(monkeypatch, capsys, "report", str(a), "--out", str(out))[0] == 0
    one_error(*cli(monkeypatch, capsys, "view", str(out)), str(out), "not a run directory", "lhd report")


def test_a_run_directory_is_still_refused_as_out(tmp_path, monkeypatch, capsys):
    a = _run(tmp_path / "runs", "a")
    before = sorted(str(p) for p in a.rglob("*"))
    line = one_error(*cli(monkeypatch, capsys, "report", str(a), "--out", str(a)), "is a run directory")
    assert str(a / "report") in line  # a folder beside the run's files, not a path inside a path
    assert sorted(str(p) for p in a.rglob("*")) == before


def test_a_folder_of_other_files_is_refused_not_replaced(tmp_path, monkeypatch, capsys):
    """Only a folder the report marked is replaced whole: a folder of a user's files is refused
    (the swap would remove them), before anything is read or written."""
    a = _run(tmp_path / "runs", "a")
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    one_error(*cli(monkeypatch, capsys, "report", str(a), "--out", str(out)), str(out), REPORT_MARKER,
              "a new or empty folder")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    (out / "notes.txt").unlink()  # an empty folder is fine
    assert cli(monkeypatch, capsys, "report", str(a), "--out", str(out))[0] == 0
