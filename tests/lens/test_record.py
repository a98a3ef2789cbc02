"""lens.json as a typed record: files written before `LensRecord` read back whole, a save writes
the record it read, and a bad field is a LensError naming the file, the field and what is allowed."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lens.errors import LensError
from lens.record import LensRecord, read_lens_record
from lens.store import Lens, load_lens, merge_lenses, save_lens

RECORDS = Path(__file__).parents[1] / "data" / "records"
# v1: the first writer's shape (no estimator, attn or model_files; written as its code did);
# v2: written by the code before this record (`lhd lens fit --estimator self --shard 1/2`, `lhd lens merge`)
OLD = ["lens-v1-shard.json", "lens-v2-self-shard.json", "lens-v2-merged/lens.json"]


@pytest.mark.parametrize("name", OLD)
def test_old_sidecars_read_back_whole(name):
    data = json.loads((RECORDS / name).read_text(encoding="utf-8"))
    record = read_lens_record(RECORDS / name)
    assert record.to_json() == data  # every key kept, none added
    assert (record.sha256, record.n_prompts, record.source_layers) == (data["sha256"], data["n_prompts"], [0, 1])
    assert record.corpus["slice"] == data["corpus"]["slice"] and record.shape == [data["d_model"]] * 2
    assert record.estimator == data.get("estimator", "all")  # a lens from before estimators is an `all` lens


def test_an_old_lens_folder_loads_and_saves_as_it_was(tmp_path):
    folder = RECORDS / "lens-v2-merged"
    data = json.loads((folder / "lens.json").read_text(encoding="utf-8"))
    lens = load_lens(folder)  # the sha256 of the weights is checked against the sidecar
    assert lens.n_prompts == 5 == sum(part["n_prompts"] for part in data["merged_from"])
    assert [p["sha256"] for p in lens.meta.merged_from] == [p["sha256"] for p in data["merged_from"]]
    weights = load_file(str(folder / "lens.safetensors"))
    assert sorted(weights) == ["layer.0", "layer.1"] and lens.d_model == data["d_model"]
    save_lens(lens, tmp_path / "again", dtype=data["dtype"])
    again = json.loads((tmp_path / "again" / "lens.json").read_text(encoding="utf-8"))
    assert {k: v for k, v in again.items() if k != "saved_at"} == {k: v for k, v in data.items() if k != "saved_at"}
    assert isinstance(lens.meta, LensRecord)


@pytest.mark.parametrize(("change", "message"), [
    ({"dtype": "float8"}, r"lens\.json: field 'dtype': 'float8' is not allowed"
     r" \(allowed: float16, bfloat16, float32\)"),
    ({"sha256": None}, r"lens\.json: field 'sha256': must be a string"),
    ({"d_model": "64"}, r"lens\.json: field 'd_model': must be an integer"),
    ({"merged_from": {"n_prompts": 2}}, r"lens\.json: field 'merged_from': must be a list"),
])
def test_a_bad_field_names_the_file_and_the_field(tmp_path, change, message):
    folder = shutil.copytree(RECORDS / "lens-v2-merged", tmp_path / "lens")
    data = json.loads((folder / "lens.json").read_text(encoding="utf-8"))
    (folder / "lens.json").write_text(json.dumps({**data, **change}), encoding="utf-8")
    with pytest.raises(LensError, match=message):
        load_lens(folder)


def test_a_missing_field_save_lens_always_wrote_is_refused(tmp_path):
    folder = shutil.copytree(RECORDS / "lens-v2-merged", tmp_path / "lens")
    data = json.loads((folder / "lens.json").read_text(encoding="utf-8"))
    del data["shape"]
    (folder / "lens.json").write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(LensError, match=r"lens\.json: field 'shape': is required"):
        load_lens(folder)


def test_a_lens_from_before_estimators_merges_as_an_all_lens():
    old = Lens({0: torch.ones(2, 2)}, {"n_prompts": 1, "sha256": "a"})  # no `estimator` key, as v1 wrote
    merged = merge_lenses([old, Lens({0: 3 * torch.ones(2, 2)}, {"n_prompts": 3, "sha256": "b", "estimator": "all"})])
    assert torch.equal(merged.J[0], 2.5 * torch.ones(2, 2))  # (1·1 + 3·3) / 4
    assert "estimator" not in merged.meta.to_json()  # written as the first lens was
    with pytest.raises(LensError, match="estimator"):
        merge_lenses([old, Lens({0: torch.ones(2, 2)}, {"n_prompts": 1, "sha256": "c", "estimator": "self"})])
