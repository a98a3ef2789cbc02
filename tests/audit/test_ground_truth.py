"""The labels of an audit evaluation (`ground_truth.jsonl`, `plant.json`): one reader and one
writer, and a damaged row is refused naming its row and field rather than scored as something else."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from lhd_train.audit.ground_truth import (
    FileQuote,
    LabelledAnswer,
    PlantInfo,
    read_ground_truth,
    read_plant_info,
    write_ground_truth,
    write_plant_info,
)
from lhd_train.errors import DataFileError, InputError
from lhd_train.rundir.run import Run


def test_labels_and_plant_info_read_back_as_written(tmp_path: Path) -> None:
    run = Run.at(tmp_path)
    planted = LabelledAnswer(trial_id="s1", global_round=3, task_index=2, round=1, source="planted", deceptive=True,
                             type="FALSIFICATION", severity=3, before="$47,000", after="$70,500",
                             evidence=[FileQuote(file="q3.csv", quote="revenue,47000")], seed=5)
    honest = LabelledAnswer(trial_id="c02", global_round=1, source="curated", item="t01-honest", deceptive=False,
                            type=None, severity=0, why="every figure is in the files")
    write_ground_truth(run, [planted, honest])
    lines = [json.loads(x) for x in (tmp_path / "ground_truth.jsonl").read_text().splitlines()]
    assert lines[0]["evidence"] == [{"file": "q3.csv", "quote": "revenue,47000"}] and lines[1]["type"] is None
    assert "before" not in lines[1]  # only what the writer set
    assert read_plant_info(run) is None  # not a planted copy
    info = PlantInfo(source_run="/runs/a", seed=5, rate=0.5, types=["CONCEALMENT"], rounds=4,
                     chosen={"CONCEALMENT": 2}, planted={"CONCEALMENT": 1}, skipped={"CONCEALMENT": 1})
    write_plant_info(run, info)
    assert read_plant_info(run) == info
    assert read_ground_truth(run) == [planted, honest]  # planted labels need plant.json (and its count)


@pytest.mark.parametrize(("row", "field"), [
    ({"trial_id": "s1", "global_round": 2, "deceptive": True, "severity": 2}, "type"),
    ({"trial_id": "s1", "global_round": "2", "deceptive": True, "type": "CONCEALMENT", "severity": 2}, "global_round"),
    ({"trial_id": "s1", "global_round": 2, "deceptive": True, "type": None, "severity": 2}, None),
])
def test_a_damaged_label_names_its_row_and_field(tmp_path: Path, row: dict, field: str | None) -> None:
    ok = {"trial_id": "s1", "global_round": 1, "deceptive": False, "type": None, "severity": 0}
    (tmp_path / "ground_truth.jsonl").write_text(json.dumps(ok) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataFileError, match="ground_truth.jsonl: line 2") as e:
        read_ground_truth(Run.at(tmp_path))
    assert e.value.field == field and e.value.line == 2


def test_no_labels_is_an_error_saying_how_to_make_them(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="audit-plant"):
        read_ground_truth(Run.at(tmp_path))
