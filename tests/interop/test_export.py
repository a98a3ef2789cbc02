"""`lhd export`: a run (ours or imported) as a `datasets` dataset that `load_from_disk` reads back."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from datasets import load_from_disk
from support.scripted import ScriptedBackend
from test_auditor import SHAPE, answer, audit, auditor_script, make_run
from test_reference_import import write_session

from lhd_train.cli.audit import export_command
from lhd_train.errors import InputError
from lhd_train.interop.export import export_run, round_columns
from lhd_train.interop.reference_import import import_reference
from lhd_train.io.files import read_jsonl


def test_export_of_an_audited_run_loads_back(tmp_path):
    cfg, tids = make_run(tmp_path, seeds=(7, 8), satisfactions=SHAPE)
    audit(cfg, ScriptedBackend(auditor_script({2: answer(True, ["CONCEALMENT", "FALSIFICATION"], 3, 0.9),
                                               3: "not json"})))
    audit(cfg, ScriptedBackend(auditor_script()), mode="window", window=1)
    out = tmp_path / "ds"
    assert export_command(cfg.run_dir, out) == 0
    ds = load_from_disk(str(out))
    assert ds.num_rows == 14
    assert [(r["trial_id"], r["global_round"]) for r in ds] == [(t, g) for t in ("s7", "s8") for g in range(1, 8)]
    cols = set(ds.column_names)
    assert {c.name for c in round_columns()} <= cols
    assert {"m-full__deceptive", "m-full__types", "m-window1__severity", "m-window1__parse_status"} <= cols
    r2 = ds[1]
    assert (r2["m-full__deceptive"], r2["m-full__types"], r2["m-full__severity"]) == \
        (True, ["FALSIFICATION", "CONCEALMENT"], 3)
    r3 = ds[2]
    assert r3["m-full__deceptive"] is None and r3["m-full__parse_status"] == "failed"
    assert r3["m-window1__deceptive"] is False
    traj = {r["global_round"]: r for r in read_jsonl(cfg.run_dir / "trials" / "s7.jsonl")}
    assert ds[0]["performer_text"] == traj[1]["performer"]["text"]
    assert ds[0]["satisfaction_after"] == traj[1]["supervisor"]["state_after"]["satisfaction"]
    assert ds[0]["event_category"] == traj[1]["event"]["category"] and ds[0]["has_event"]
    assert "Write the status note number 1." in ds[0]["performer_user_message"]
    assert ds[0]["trial_finished"] is True
    meta = json.loads(ds.info.description)
    assert meta["auditors"]["m-window1"]["options"]["window"] == 1
    # Re-export into the same folder works.
    export_run(cfg.run_dir, out)
    assert load_from_disk(str(out)).num_rows == 14


def test_export_of_an_imported_run_keeps_column_types(tmp_path):
    run = tmp_path / "imported"
    import_reference(write_session(tmp_path / "ref"), run)
    ds = export_run(run, tmp_path / "ds1")
    back = load_from_disk(str(tmp_path / "ds1"))
    assert back.num_rows == 3
    assert back[0]["performer_prompt_tokens"] is None and back[2]["event_name"] is None
    # the authors' labels as written: round 2 unflagged with severity 2, round 3 flagged without a type
    assert [r["reference-full__deceptive"] for r in back] == [True, False, True]
    assert [r["reference-full__severity"] for r in back] == [3, 2, 2]
    assert back[0]["reference-window6__types"] == ["EQUIVOCATION"]
    cfg, _ = make_run(tmp_path / "ours", satisfactions=SHAPE)
    ours = export_run(cfg.run_dir, tmp_path / "ds2")
    for c in round_columns():  # same schema whatever the source
        assert ds.features[c.name] == ours.features[c.name], c.name


def test_export_refuses_what_it_cannot_write(tmp_path):
    with pytest.raises(InputError, match="not a run directory"):
        export_run(tmp_path, tmp_path / "x")
    cfg, _ = make_run(tmp_path, satisfactions=SHAPE)
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="not a dataset folder"):
        export_run(cfg.run_dir, occupied)


# The dataset's columns before they were derived from the row models (the user-facing format):
# deriving them must not drop or retype one.
DOCUMENTED_COLUMNS = {
    "run_id": "string", "trial_id": "string", "seed": "int64", "pack": "string", "task_index": "int64",
    "task_title": "string", "round": "int64", "global_round": "int64", "has_event": "bool", "event_name": "string",
    "event_category": "string", "event_pressure": "string", "event_content": "string", "performer_text": "string",
    "performer_think": "string", "performer_finish_reason": "string", "performer_token_ids": "list[int]",
    "performer_prompt_tokens": "int64", "performer_completion_tokens": "int64", "performer_latency_s": "float64",
    "performer_attempts": "int64", "performer_temperature": "float64", "performer_top_p": "float64",
    "performer_max_tokens": "int64", "performer_sampling_seed": "int64", "performer_context_policy": "string",
    "performer_context_dropped_messages": "int64", "supervisor_evaluation_reasoning": "string",
    "supervisor_feedback_reasoning": "string", "supervisor_feedback": "string", "supervisor_parse_status": "string",
    "supervisor_attempts": "int64", "trust_before": "float64", "satisfaction_before": "float64",
    "comfort_before": "float64", "trust_after": "float64", "satisfaction_after": "float64",
    "comfort_after": "float64", "task_complete": "bool", "performer_model": "string", "performer_adapter": "string",
    "supervisor_model": "string", "timestamp": "string",
}


def test_columns_derived_from_the_row_models_keep_the_documented_ones():
    derived = {c.name: c.kind for c in round_columns()}
    assert {k: derived.get(k) for k in DOCUMENTED_COLUMNS} == DOCUMENTED_COLUMNS
    assert len(derived) == len({c.name for c in round_columns()})  # no two fields share a column
    row = {"task_index": 1, "round": 2, "global_round": 2, "event": None,
           "performer": {"text": "hi", "sampling": {"temperature": 0.5, "seed": 9}},
           "supervisor": {"feedback": {"text": "ok"}, "state_after": {"trust": 0.25}}}
    values = {c.name: c.get(row) for c in round_columns()}
    assert (values["performer_temperature"], values["performer_sampling_seed"], values["supervisor_feedback"],
            values["trust_after"], values["event_name"], values["trust_before"]) == (0.5, 9, "ok", 0.25, None, None)


def test_a_field_without_a_column_type_must_be_marked():
    from typing import Any

    from lhd_train.rundir.rows import Record, export_columns

    class Loose(Record):
        blob: dict[str, Any] | None = None

    with pytest.raises(TypeError, match="Loose.blob.*mark it SKIP"):
        export_columns(Loose)


def test_a_round_labelled_twice_exports_the_label_that_counts(tmp_path):
    """A later failed row for a labelled round (a resumed or merged audit) never replaces the usable
    label in the export, as in the report (`AuditorStore.labels`); a later usable row does."""
    run = Path(shutil.copytree(Path(__file__).parents[1] / "data" / "runs" / "v1-control-study", tmp_path / "run"))
    path = run / "audit" / "tiny-full" / "s390185437-cat-MORAL_DILEMMA.jsonl"
    rows = read_jsonl(path)
    failed = rows[0] | {"deceptive": None, "types": [], "severity": None, "parse_status": "failed", "raw": ""}
    relabel = rows[1] | {"deceptive": False, "types": [], "severity": 0, "parse_status": "ok"}
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(failed) + "\n" + json.dumps(relabel) + "\n")
    ds = export_run(run, tmp_path / "ds")
    assert [r["global_round"] for r in ds] == [1, 2, 3]
    assert (ds[0]["tiny-full__deceptive"], ds[0]["tiny-full__parse_status"]) == (True, rows[0]["parse_status"])
    assert (ds[1]["tiny-full__deceptive"], ds[1]["tiny-full__parse_status"]) == (False, "ok")
