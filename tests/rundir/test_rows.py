"""The row models of `rundir.rows` are the schema: every writer's rows match them field for field,
and the readers reject a line that does not, naming the file, the line and the field."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.scripted import ScriptedBackend
from test_auditor import SHAPE, answer, audit, auditor_script, make_run
from test_reference_import import write_session

from lhd_train.errors import DataFileError
from lhd_train.interop.reference_import import import_reference
from lhd_train.io.files import read_jsonl
from lhd_train.rundir.layout import RunDir
from lhd_train.rundir.rows import (
    AUDIT_SCHEMA,
    ROW_SCHEMA,
    AuditRow,
    CallRecord,
    ModelRef,
    PerformerRecord,
    ResumableRoundRow,
    RoundRow,
    SupervisorContext,
    undeclared_fields,
)
from lhd_train.rundir.run import Run
from lhd_train.rundir.store import load_audit_rows, load_trial_rows


def _all_rows(run_dir):
    rd = RunDir(run_dir)
    trial_rows = [r for f in rd.rows_files() for r in read_jsonl(f)]
    audit_rows = [r for aid in rd.auditor_ids() for f in sorted(rd.auditor_dir(aid).glob("*.jsonl"))
                  for r in read_jsonl(f)]
    return trial_rows, audit_rows


def test_every_field_our_writers_write_is_declared(tmp_path):
    cfg, _ = make_run(tmp_path, seeds=(7,), satisfactions=SHAPE)
    audit(cfg, ScriptedBackend(auditor_script({2: answer(True, ["CONCEALMENT"], 2, 0.8), 3: "not json"})))
    trial_rows, audit_rows = _all_rows(cfg.run_dir)
    assert len(trial_rows) == 7 and len(audit_rows) == 7
    for row in trial_rows:
        assert row["schema"] == ROW_SCHEMA
        ResumableRoundRow.model_validate(row)
        assert undeclared_fields(RoundRow, row) == []
    for row in audit_rows:
        assert row["schema"] == AUDIT_SCHEMA
        AuditRow.model_validate(row)
        assert undeclared_fields(AuditRow, row) == []


def test_imported_reference_rows_match_the_models(tmp_path):
    run = tmp_path / "imported"
    import_reference(write_session(tmp_path / "ref"), run)
    trial_rows, audit_rows = _all_rows(run)
    assert trial_rows and audit_rows
    assert [undeclared_fields(RoundRow, r) for r in trial_rows] == [[]] * len(trial_rows)
    assert [undeclared_fields(AuditRow, r) for r in audit_rows] == [[]] * len(audit_rows)


#: what every writer of a trajectory row has always written, with a value (and `pack`, which an import may leave null)
REQUIRED = {"run_id": "r", "trial_id": "t", "seed": 1, "pack": "p", "task_title": "T", "models": {}}


def test_undeclared_fields_names_nested_keys():
    row = {**REQUIRED, "task_index": 1, "round": 1, "global_round": 1, "surprise": 1,
           "performer": {"text": "x", "sampling": {"temperature": 0.1, "new_knob": 2}}}
    assert undeclared_fields(RoundRow, row) == ["surprise", "performer.sampling.new_knob"]
    RoundRow.model_validate(row)  # unknown fields are kept, not refused: a newer writer's rows still load


def test_undeclared_fields_names_keys_inside_lists_of_records():
    row = {**REQUIRED, "task_index": 1, "round": 1, "global_round": 1, "performer": {"text": ""},
           "supervisor": {"calls": [{"stage": "evaluation"},
                                    {"stage": "feedback", "new_knob": 1, "sampling": {"top_p": 0.9, "odd": 2}}],
                          "summaries_added": [{"global_round": 1, "text": "t", "mood": "ok"}]}}
    assert undeclared_fields(RoundRow, row) == ["supervisor.calls.1.new_knob", "supervisor.calls.1.sampling.odd",
                                                "supervisor.summaries_added.0.mood"]
    assert RoundRow.model_validate(row).supervisor.calls[1].new_knob == 1  # kept, as every unknown field


def test_model_calls_of_a_stored_run_read_as_records():
    """The v1 fixture's supervisor and auditor calls, the supervisor's prompt budget and the
    auditor's model come back as records a stage reads by attribute."""
    run = Run.open(Path(__file__).parents[1] / "data" / "runs" / "v1-control-study")
    [tid] = run.trial_ids()
    sup = run.trial(tid).rows()[0].supervisor
    assert sup is not None and sup.context is not None
    first = sup.calls[0]
    assert isinstance(first, CallRecord) and (first.stage, first.attempt, first.cut, first.finish_reason) == \
        ("evaluation", 1, True, "length")
    assert first.sampling is not None and first.sampling.max_tokens == 160 and first.prompt_tokens == 2370
    assert [c.stage for c in sup.calls] == ["evaluation", "evaluation", "feedback", "feedback", "feedback"]
    assert isinstance(sup.context, SupervisorContext) and sup.context.fits and sup.context.budget_tokens == 7472
    audit_rows = run.auditor("tiny-full").rows(tid)
    model = audit_rows[0].model
    assert isinstance(model, ModelRef) and (model.key, model.model, model.adapter) == ("tiny", "runs/tiny-llama", None)
    assert all(isinstance(c, CallRecord) and c.stage == "audit" for r in audit_rows for c in r.calls)


@pytest.mark.parametrize("change, field", [
    (lambda r: r["performer"].__setitem__("latency_s", "slow"), "performer.latency_s"),
    (lambda r: r.__setitem__("round", True), "round"),
    (lambda r: r.pop("global_round"), "global_round"),
    (lambda r: r["supervisor"]["state_after"].__setitem__("trust", "high"), "supervisor.state_after.trust"),
    (lambda r: r["supervisor"]["calls"][1].__setitem__("prompt_tokens", "many"), "supervisor.calls[1].prompt_tokens"),
])
def test_a_damaged_trajectory_line_names_its_line_and_field(tmp_path, change, field):
    cfg, tids = make_run(tmp_path, seeds=(7,), satisfactions=SHAPE)
    path = next(RunDir(cfg.run_dir).rows_files())
    rows = read_jsonl(path)
    change(rows[2])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    with pytest.raises(DataFileError) as err:
        load_trial_rows(path)
    assert err.value.field == field and err.value.line == 3 and str(path) in str(err.value)


def test_a_resume_needs_the_supervisor_state(tmp_path):
    cfg, _ = make_run(tmp_path, seeds=(7,), satisfactions=SHAPE)
    path = next(RunDir(cfg.run_dir).rows_files())
    rows = read_jsonl(path)
    del rows[0]["task_complete"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    assert len(load_trial_rows(path)) == 7  # readers of finished runs do not need it
    with pytest.raises(DataFileError) as err:
        load_trial_rows(path, ResumableRoundRow)
    assert err.value.field == "task_complete" and err.value.line == 1 and "is required" in str(err.value)


def test_a_damaged_audit_line_names_its_field(tmp_path):
    cfg, tids = make_run(tmp_path, seeds=(7,), satisfactions=SHAPE)
    audit(cfg, ScriptedBackend(auditor_script()))
    rd = RunDir(cfg.run_dir)
    path = rd.audit_rows(rd.auditor_ids()[0], tids[0])
    rows = read_jsonl(path)
    rows[0]["severity"] = "3"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    with pytest.raises(DataFileError) as err:
        load_audit_rows(path)
    assert err.value.field == "severity" and err.value.line == 1


def test_a_long_bad_value_is_shortened_in_the_error(tmp_path):
    cfg, _ = make_run(tmp_path, seeds=(7,), satisfactions=SHAPE)
    path = next(RunDir(cfg.run_dir).rows_files())
    rows = read_jsonl(path)
    rows[0]["performer"] = "x" * 5000  # a whole answer where the performer record belongs
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    with pytest.raises(DataFileError) as err:
        load_trial_rows(path)
    assert err.value.field == "performer" and "must be an object (got str)" in str(err.value)
    assert "x" * 20 not in str(err.value)


def test_collections_read_as_empty_and_are_written_only_when_set():
    """A writer that left a list out, or wrote null (the importer writes `calls: null`), gives an
    empty list; a record built without one writes no key for it, as before."""
    row = RoundRow.model_validate({**REQUIRED, "task_index": 1, "round": 1, "global_round": 1,
                                   "performer": {"text": "x", "message_ids": None, "token_ids": None},
                                   "supervisor": {"calls": None}})
    assert (row.performer.message_ids, row.performer.new_message_ids, row.supervisor.calls,
            row.supervisor.summaries_added) == ([], [], [], [])
    assert row.performer.token_ids is None  # not known: the one list that keeps None
    written = row.to_json()  # a null is written back as null: a copied row is written as it was
    assert written["supervisor"] == {"calls": None} and written["performer"]["message_ids"] is None
    audit = AuditRow.model_validate({"run_id": "r", "trial_id": "t", "global_round": 1, "auditor_id": "a",
                                     "mode": "full", "parse_status": "failed", "types": None, "evidence": None,
                                     "original": None, "calls": None, "model": {"model": "m"}})
    assert (audit.types, audit.evidence, audit.original, audit.calls, audit.context_rounds) == ([], [], {}, [], [])
    built = RoundRow(**REQUIRED, task_index=1, round=1, global_round=1, performer=PerformerRecord(text="x"))
    assert set(built.to_json()) == {"schema", *REQUIRED, "task_index", "round", "global_round", "performer"}
    assert built.to_json()["performer"] == {"text": "x"}


@pytest.mark.parametrize("field", [*(f for f in REQUIRED if f != "pack"), "performer.text"])
def test_a_row_without_a_field_every_writer_writes_is_refused_naming_it(tmp_path, field):
    row = {**REQUIRED, "task_index": 1, "round": 1, "global_round": 1, "performer": {"text": "x"}}
    if field == "performer.text":
        del row["performer"]["text"]
    else:
        del row[field]
    path = tmp_path / "s1.jsonl"
    path.write_text(json.dumps(row) + "\n", encoding="utf-8")
    with pytest.raises(DataFileError) as err:
        load_trial_rows(path)
    assert err.value.field == field and err.value.line == 1 and f"field '{field}': is required" in str(err.value)


def test_the_v1_fixture_reads_with_its_records_complete():
    """The oldest run directory kept (tests/data/runs/v1-control-study) has every required field."""
    run = Run.open(Path(__file__).parents[1] / "data" / "runs" / "v1-control-study")
    [tid] = run.trial_ids()
    rows = run.trial(tid).rows()
    assert [(r.run_id, r.trial_id, r.seed, r.pack) for r in rows] == [
        ("fixture-v1", tid, 390185437, "lhd_startup_consulting")] * 3
    assert all(r.task_title and r.performer.text and r.models.performer is not None for r in rows)
    labels = run.auditor("tiny-full").rows(tid)
    assert [(a.auditor_id, a.mode, a.parse_status) for a in labels][0] == ("tiny-full", "full", "ok")
    assert [(a.parse_status, a.original, a.reference_raw) for a in labels] == [  # written null / not written
        ("ok", {}, {}),
        ("repaired", {"deceptive": True, "types": ["FALSIFICATION", "FALSIFICATION"], "severity": 2,
                      "confidence": 1.0}, {}),
        ("retried", {}, {})]
    manifest = run.manifest()
    assert manifest is not None and manifest.resumes == [] and manifest.seeds == [390185437]
    record = run.auditor("tiny-full").record()
    assert record is not None and record.auditor_id == "tiny-full"
