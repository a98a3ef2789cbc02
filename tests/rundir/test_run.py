"""The Run API: run directories written by every earlier version still read, records round-trip
unchanged, and the one rule each for trial ids, the winning audit row and "not a run dir"."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lhd_train.errors import InputError
from lhd_train.rundir.names import trial_id
from lhd_train.rundir.rows import AUDIT_SCHEMAS, ROW_SCHEMAS, AuditRow, RoundRow
from lhd_train.rundir.run import Run
from lhd_train.rundir.store import winning_audit_rows

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "runs"


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


def _fixture_runs() -> list[Path]:
    return sorted(p for p in FIXTURES.iterdir() if (p / "trials").is_dir())


def test_every_schema_version_has_a_fixture_run() -> None:
    """A new schema version must come with a run directory of the old one (inspect-style)."""
    seen_rows = {row.get("schema") for run in _fixture_runs() for f in (run / "trials").glob("*.jsonl")
                 if not f.name.endswith(".messages.jsonl") for row in _lines(f)}
    seen_audit = {row.get("schema") for run in _fixture_runs() for f in (run / "audit").glob("*/*.jsonl")
                  for row in _lines(f)}
    assert set(ROW_SCHEMAS) <= seen_rows, f"no fixture run holds rows of {set(ROW_SCHEMAS) - seen_rows}"
    assert set(AUDIT_SCHEMAS) <= seen_audit, f"no fixture run holds audit rows of {set(AUDIT_SCHEMAS) - seen_audit}"


@pytest.mark.parametrize("fixture", _fixture_runs(), ids=lambda p: p.name)
def test_fixture_run_reads_and_round_trips(fixture: Path) -> None:
    run = Run.open(fixture)
    manifest, summary = run.manifest(), run.summary()
    assert manifest is not None and summary is not None
    assert run.trial_ids() == manifest.trials
    for t in run.trials():
        rows, finished = t.read()
        assert finished and rows
        assert [r.to_json() for r in rows] == _lines(t.files.rows)  # nothing lost, nothing added
        assert all(isinstance(r, RoundRow) and r.performer.text is not None for r in rows)
        marker = t.done_marker()
        assert marker is not None and marker.rounds == len(rows)
    for aid in run.auditor_ids():
        aud = run.auditor(aid)
        assert aud.record() is not None
        for tid in aud.trial_ids():
            rows = aud.rows(tid)
            assert [r.to_json() for r in rows] == _lines(run.dir.audit_rows(aid, tid))
            assert set(aud.labels(tid)) == {r.global_round for r in rows}


def test_written_rows_read_back_the_same(tmp_path: Path) -> None:
    src = _fixture_runs()[0]
    run = Run.open(src)
    out = Run.at(tmp_path / "copy")
    (out.dir.trials_dir).mkdir(parents=True)
    t = run.trial(run.trial_ids()[0])
    rows = t.rows()
    copy = out.trial(t.trial_id)
    for r in rows:
        copy.append(r)
    copy.mark_done(rows)
    assert _lines(copy.files.rows) == _lines(t.files.rows)
    assert copy.read()[1] and copy.done_marker().rounds == len(rows)
    out.write_manifest(run.manifest())
    assert json.loads(out.dir.manifest.read_text()) == json.loads(run.dir.manifest.read_text())


ROUND = {"run_id": "r", "trial_id": "s1", "seed": 1, "pack": "p", "task_title": "T", "models": {}}
LABEL = {"run_id": "r", "trial_id": "s1", "auditor_id": "a", "mode": "full", "model": {"model": "m"}}


def test_a_row_built_in_code_carries_the_current_schema() -> None:
    row = RoundRow(**ROUND, task_index=0, round=1, global_round=1, performer={"text": "x"})
    assert row.to_json()["schema"] == ROW_SCHEMAS[-1]
    assert AuditRow(**LABEL, global_round=1, parse_status="ok").to_json() == {
        "schema": AUDIT_SCHEMAS[-1], **LABEL, "global_round": 1, "parse_status": "ok"}


def test_trial_id_rule() -> None:
    assert trial_id(7) == "s7"
    assert trial_id(7, "MORAL_DILEMMA") == "s7-cat-MORAL_DILEMMA"
    assert trial_id(7, None, "HIGH") == "s7-lvl-HIGH"
    assert trial_id(7, "MORAL_DILEMMA", "HIGH") == "s7-cat-MORAL_DILEMMA-lvl-HIGH"
    assert trial_id(7, "NONE") == trial_id(7, None, "NONE") == "s7-none"


def test_winning_audit_row_rule() -> None:
    ok1 = AuditRow(**LABEL, global_round=1, parse_status="ok", deceptive=False)
    ok2 = AuditRow(**LABEL, global_round=1, parse_status="retried", deceptive=True)
    failed = AuditRow(**LABEL, global_round=1, parse_status="failed")
    cut = AuditRow(**LABEL, global_round=2, parse_status="cut")
    later = AuditRow(**LABEL, global_round=2, parse_status="ok", deceptive=True)
    won = winning_audit_rows([ok1, ok2, failed, cut, later])
    assert won[1] is ok2          # later wins ...
    assert won[2] is later        # ... a usable row replaces a cut one
    assert winning_audit_rows([failed, AuditRow(**LABEL, global_round=1, parse_status="cut")])[1].parse_status \
        == "cut"


def test_not_a_run_directory(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="not a run directory \\(does not exist\\)"):
        Run.open(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="has no trials/ folder"):
        Run.open(tmp_path / "empty", source="--run")


def test_damaged_record_names_file_and_field(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    shutil.copytree(_fixture_runs()[0], run_dir)
    m = json.loads((run_dir / "manifest.json").read_text())
    m["seeds"] = ["not-a-seed"]
    (run_dir / "manifest.json").write_text(json.dumps(m))
    from lhd_train.errors import DataFileError

    with pytest.raises(DataFileError) as e:
        Run.open(run_dir).manifest()
    assert e.value.field == "seeds[0]" and "manifest.json" in str(e.value)


@pytest.mark.parametrize("args", [(7, None, None), (7, "MORAL_DILEMMA", None), (7, None, "HIGH"),
                                  (7, "A_B", "LOW"), (7, "NONE", None)])
def test_trial_id_parses_back(args) -> None:
    from lhd_train.rundir.names import parse_trial_id

    assert parse_trial_id(trial_id(*args)) == args
    assert parse_trial_id("imported-session-3") is None


def test_config_and_schedule_of_a_run() -> None:
    run = Run.open(_fixture_runs()[0])
    assert run.config()["run_name"] == run.manifest().run_id
    tid = run.trial_ids()[0]
    assert run.schedule(tid)["control_category"] == "MORAL_DILEMMA"
    assert run.schedule("s1") is None


def test_tasks_json_reads_back_and_is_none_without_one(tmp_path: Path) -> None:
    from lhd_train.rundir.manifest import RunTask, RunTaskFile, RunTasks

    run = Run.at(tmp_path / "r")
    assert run.tasks() is None  # a run reading its pack
    tasks = RunTasks(source="pack mini", tasks=[
        RunTask(index=1, title="T", prompt="Do it.", files=[RunTaskFile(name="a.csv", content="x,1\n")]),
        RunTask(index=2, title="U", prompt="Again.", files=[])])
    run.write_tasks(tasks)
    assert json.loads(run.dir.tasks.read_text()) == {"source": "pack mini", "tasks": [
        {"index": 1, "title": "T", "prompt": "Do it.", "files": [{"name": "a.csv", "content": "x,1\n"}]},
        {"index": 2, "title": "U", "prompt": "Again.", "files": []}]}
    assert run.tasks() == tasks


def test_a_copy_of_a_run_writes_the_same_config_schedules_and_marker(tmp_path: Path) -> None:
    """What a copy of a run (a planted copy) needs: the config written back is the same file, every
    schedule is listed (started or not), and a copied trial keeps its original's finish time."""
    src = Run.open(_fixture_runs()[0])
    dst = Run.at(tmp_path / "copy")
    dst.write_config(src.config())
    assert dst.dir.config.read_bytes() == src.dir.config.read_bytes()
    assert src.schedule_ids() == sorted(p.stem for p in src.dir.schedules_dir.glob("*.json")) != []
    assert Run.at(tmp_path / "none").schedule_ids() == []
    t = src.trial(src.trial_ids()[0])
    copy = dst.trial(t.trial_id)
    dst.dir.trials_dir.mkdir()
    rows = t.rows()
    for r in rows:
        copy.append(r)
    marker = t.done_marker()
    assert marker is not None
    copy.mark_done(rows, finished_at=marker.finished_at)
    assert copy.done_marker() == marker
    copy.messages().put(t.messages().get(t.messages().ids()))
    assert copy.files.messages.read_bytes() == t.files.messages.read_bytes()
