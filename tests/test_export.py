"""`lhd export`: a run (ours or imported) as a `datasets` dataset that `load_from_disk` reads back."""
from __future__ import annotations

import json

import pytest
from datasets import load_from_disk
from support.scripted import ScriptedBackend
from test_audit import SHAPE, answer, audit, auditor_script, make_run
from test_reference_import import write_session

from lhd_train.cli.audit import export_command
from lhd_train.errors import InputError
from lhd_train.rundir.export import ROUND_COLUMNS, export_run
from lhd_train.rundir.files import read_jsonl
from lhd_train.rundir.reference_import import import_reference


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
    assert {name for name, _, _ in ROUND_COLUMNS} <= cols
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
    for name, _, _ in ROUND_COLUMNS:  # same schema whatever the source
        assert ds.features[name] == ours.features[name], name


def test_export_refuses_what_it_cannot_write(tmp_path):
    with pytest.raises(InputError, match="not a run directory"):
        export_run(tmp_path, tmp_path / "x")
    cfg, _ = make_run(tmp_path, satisfactions=SHAPE)
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="not a dataset folder"):
        export_run(cfg.run_dir, occupied)
