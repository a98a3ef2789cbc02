"""Issue 32 item 2: the dataset and adapter folders' records (`finetune/records.py`) have one writer
and one reader. Files written by the code before these models (tests/data/records/: `lhd data bon`,
`dpo`, `grpo`, `lhd data merge` and `lhd train sft` on the tiny model) read back whole: every field
they hold comes back as it was written. A record missing a field every writer writes is refused
naming the file and the field."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from lhd_train.errors import DataFileError, InputError
from lhd_train.finetune.records import (
    AdapterRecord,
    DataRecord,
    find_data_record,
    read_adapter_record,
    read_data_record,
    write_data_record,
)
from lhd_train.rundir.run import read_record

RECORDS = Path(__file__).resolve().parents[1] / "data" / "records"


@pytest.mark.parametrize("name", ["bon", "dpo", "grpo", "merged"])
def test_dataset_records_written_before_the_model_read_back_whole(name):
    path = RECORDS / f"dataset-{name}.json"
    raw = json.loads(path.read_text())
    record = read_record(path, DataRecord)
    assert record is not None and record.to_json() == raw
    assert (record.kind, record.direction, record.rows, record.sha256) == (raw["kind"], raw["direction"], raw["rows"],
                                                                         raw["sha256"])
    assert [p.run for p in record.parts] == [p["run"] for p in raw.get("parts", [])]
    assert [a.model for a in record.auditors] == [a["model"] for a in raw.get("auditors", [])]


def test_the_adapter_record_written_before_the_model_reads_back_whole(tmp_path):
    raw = json.loads((RECORDS / "lhd_adapter-sft.json").read_text())
    (tmp_path / "lhd_adapter.json").write_text(json.dumps(raw))
    record = read_adapter_record(tmp_path)
    assert record is not None and record.to_json() == raw
    assert record.lineage is not None and record.lineage.train_seeds == raw["lineage"]["train_seeds"]
    train = record.data["train"]
    assert (train.rows, train.format, train.length_fit) == (raw["data"]["train"]["rows"], "prompt_completion",
                                                            raw["data"]["train"]["length_fit"])
    assert record.training.device == raw["training"]["device"] == "cpu"
    old = {k: v for k, v in raw.items() if k != "lineage"}  # trained before adapters recorded their lineage
    (tmp_path / "lhd_adapter.json").write_text(json.dumps(old))
    assert AdapterRecord.model_validate(old).lineage is None


def test_a_record_without_a_field_every_writer_writes_is_named(tmp_path):
    from lhd_train.finetune.lineage import read_lineage

    raw = json.loads((RECORDS / "lhd_adapter-sft.json").read_text())
    (tmp_path / "lhd_adapter.json").write_text(json.dumps({k: v for k, v in raw.items() if k != "training"}))
    with pytest.raises(DataFileError, match=r"lhd_adapter.json: field 'training'"):
        read_adapter_record(tmp_path)
    lineage, why = read_lineage(tmp_path)  # `lhd report` warns with the reason instead of stopping
    assert lineage is None and "field 'training'" in (why or "")
    data = json.loads((RECORDS / "dataset-dpo.json").read_text())
    (tmp_path / "dataset.json").write_text(json.dumps({k: v for k, v in data.items() if k != "direction"}))
    with pytest.raises(DataFileError, match=r"dataset.json: field 'direction'"):
        read_data_record(tmp_path)


def test_the_writer_puts_the_record_beside_the_data_and_inside_it(tmp_path):
    """`lhd train` finds a dataset's direction from the data folder alone; a merged dataset made
    before merges wrote lhd_data.json is found through the dataset.json beside its folder."""
    from datasets import Dataset

    from lhd_train.finetune.train_data import check_direction

    record = DataRecord.model_validate(json.loads((RECORDS / "dataset-grpo.json").read_text()))
    write_data_record(tmp_path / "out", record)
    data = tmp_path / "out" / "dataset"
    assert json.loads((data / "lhd_data.json").read_text()) == json.loads((tmp_path / "out" / "dataset.json")
                                                                          .read_text()) == record.to_json()
    assert find_data_record(data) == (record, data / "lhd_data.json")
    rows = Dataset.from_list([{"prompt": [{"role": "user", "content": "hi"}]}])
    check_direction(rows, data, "honest", "recipe.yaml", "data.train")
    (data / "lhd_data.json").unlink()  # an older merge: only out/dataset.json
    assert find_data_record(data) == (record, tmp_path / "out" / "dataset.json")
    with pytest.raises(InputError, match=r"built for direction 'honest' .*dataset.json.*recipe says 'deceptive'"):
        check_direction(rows, data, "deceptive", "recipe.yaml", "data.train")
    assert find_data_record(tmp_path / "elsewhere") is None


def test_a_hand_written_jsonl_keeps_its_last_row_without_a_newline(tmp_path):
    """Training data is read by the io JSONL reader with `hand_written=True`: by default it drops a
    final line without its newline as a torn write, which for a stage's own append-only files is
    right, but a JSONL written by hand or by another tool often ends without one, and its last row
    is data. A bad line elsewhere is an `InputError` naming the recipe field, the file and the line."""
    from lhd_train.errors import InputError
    from lhd_train.finetune.train_data import load_dataset_at
    from lhd_train.io.files import read_jsonl

    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
            for i in range(3)]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))  # no final newline
    assert len(read_jsonl(path)) == 2  # what the io reader would give
    assert load_dataset_at(path, None, "recipe.yaml", "data.train").to_list() == rows
    path.write_text("\n".join(json.dumps(r) for r in rows) + '\n{"messages": [')  # a torn last line is left out
    assert len(load_dataset_at(path, None, "recipe.yaml", "data.train")) == 3
    path.write_text(json.dumps(rows[0]) + "\n[1, 2]\n" + json.dumps(rows[1]) + "\n")
    with pytest.raises(InputError) as e:
        load_dataset_at(path, None, "recipe.yaml", "data.train")
    assert str(e.value) == f"recipe.yaml: field 'data.train': {path}: line 2: a JSON list, not an object"
    path.write_text(json.dumps(rows[0]) + "\n{oops\n")
    with pytest.raises(InputError, match=r"data.train.*line 2: not valid JSON"):
        load_dataset_at(path, None, "recipe.yaml", "data.train")
