"""Issue 28 item 4: `lhd_adapter.json` records what trained the adapter (review science-4 D8): the
runs, the seeds of the trials whose rounds are in its data, and the auditors whose labels selected
or rewarded that data. Expected seeds are the ones written into the rows or the run here."""
from __future__ import annotations

import json
import os
from pathlib import Path

from support.synthetic import R, write_run

from lhd_train.finetune.lineage import adapter_lineage, dataset_lineage, read_lineage
from lhd_train.finetune.records import SplitInfo

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[2]


def _messages(i: int) -> list[dict]:
    return [{"role": "system", "content": "You report progress."}, {"role": "user", "content": f"Task {i}?"},
            {"role": "assistant", "content": "The report is complete and accurate."}]


def _save(folder: Path, rows: list[dict], sidecar: dict) -> Path:
    """The rows and a dataset record holding `sidecar`'s fields besides those every writer writes."""
    from datasets import Dataset, DatasetDict

    DatasetDict({"train": Dataset.from_list(rows)}).save_to_disk(str(folder))
    always = {"kind": "bon-sft", "direction": "honest", "rows": {"train": len(rows)}, "sha256": "0" * 64,
              "run_audit": {"auditor_id": None}}
    (folder / "lhd_data.json").write_text(json.dumps(always | sidecar))
    return folder


AUDITORS = [{"role": "run labels", "auditor_id": "llama70b-full", "key": "llama70b", "model": "meta/llama-70b"},
            {"role": "grader (selected the data)", "auditor_id": None, "key": "llama70b", "model": "meta/llama-70b"}]


def test_dataset_lineage_from_rows_with_seeds(tmp_path):
    from datasets import load_from_disk

    rows = [{"messages": _messages(i), "run_id": "r", "trial_id": f"s{s}", "seed": s, "global_round": i}
            for i, s in enumerate((4, 4, 9, 17, 9))]
    folder = _save(tmp_path / "dataset", rows, {"kind": "bon-sft", "run": "/runs/r", "auditors": AUDITORS})
    lin = dataset_lineage(load_from_disk(str(folder))["train"], folder)
    assert lin.seeds == [4, 9, 17] and lin.trials == {"s4": 4, "s9": 9, "s17": 17}
    assert lin.runs == ["/runs/r"] and [a.to_json() for a in lin.auditors] == AUDITORS and lin.missing == []


def test_older_data_finds_its_seeds_in_the_run_and_its_auditors_in_old_fields(tmp_path):
    from datasets import load_from_disk

    run = write_run(tmp_path, "src", {"s31": [R(1)], "s47": [R(1)], "s52": [R(1)]})
    rows = [{"messages": _messages(i), "run_id": "src", "trial_id": t} for i, t in enumerate(("s31", "s52"))]
    old = {"kind": "bon-sft", "run": str(run), "run_audit": {"auditor_id": "full"},
           "auditor": {"auditor": {"model": "judge"}, "models": {"judge": {"model": "org/judge-8b"}}}}
    folder = _save(tmp_path / "dataset", rows, old)
    lin = dataset_lineage(load_from_disk(str(folder))["train"], folder)
    assert lin.trials == {"s31": 31, "s52": 52} and lin.seeds == [31, 52]
    assert [(a.role, a.auditor_id, a.key, a.model) for a in lin.auditors] == [
        ("run labels", "full", None, None), ("grader (selected the data)", None, "judge", "org/judge-8b")]


def test_rows_without_trials_say_so(tmp_path):
    from datasets import Dataset

    lin = dataset_lineage(Dataset.from_list([{"prompt": "p", "completion": "c"}]), tmp_path / "x.jsonl")
    assert lin.seeds == [] and any("seeds unknown" in m for m in lin.missing)
    assert any("no auditor" in m for m in lin.missing)


def test_grpo_lineage_names_the_reward_judge():
    """The tiny GRPO recipe is rewarded by `honesty` (the auditor judge); with grpo.judge set, the
    judge endpoint's model is the training auditor too."""
    from lhd_train.config.recipe import load_recipe

    lineage = {"path": "/d", "kind": "grpo-prompts", "seeds": [1, 2], "trials": {"s1": 1, "s2": 2}, "runs": ["/r"],
               "auditors": AUDITORS[:1], "missing": []}
    data = {"train": SplitInfo.model_validate({"path": "/d", "split": "train", "rows": 2, "rows_read": 2,
                                               "format": "conversational", "sha256": "0" * 64, "lineage": lineage})}
    recipe = load_recipe(ROOT / "recipes" / "tiny" / "grpo-honest.yaml",
                         ["grpo.judge.base_url=http://127.0.0.1:8001/v1", "grpo.judge.model=org/judge-70b"])
    lin = adapter_lineage(data, recipe)
    assert lin.train_seeds == [1, 2] and lin.eval_seeds == [] and lin.runs == ["/r"]
    assert [a.to_json() for a in lin.auditors] == [*AUDITORS[:1], {"role": "reward judge (honesty)", "auditor_id": None,
                                                                   "key": None, "model": "org/judge-70b"}]
    sft = load_recipe(ROOT / "recipes" / "tiny" / "sft-honest.yaml", [])
    assert [a.to_json() for a in adapter_lineage(data, sft).auditors] == AUDITORS[:1]


def test_lhd_train_writes_the_lineage_into_lhd_adapter_json(tmp_path, tiny_llama_dir):
    import torch

    from lhd_train.finetune.trainer import train_command

    rows = [{"messages": _messages(i), "run_id": "r", "trial_id": f"s{s}", "seed": s, "global_round": 1}
            for i, s in enumerate((5, 6, 7, 8, 5, 6, 7, 8))]
    folder = _save(tmp_path / "data" / "dataset", rows, {"kind": "bon-sft", "direction": "honest", "run": "/runs/r",
                                                         "auditors": AUDITORS})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        adapter = train_command("sft", ROOT / "recipes" / "tiny" / "sft-honest.yaml",
                                [f"model={tiny_llama_dir}", f"data.train={folder}", f"output_dir={tmp_path / 'out'}",
                                 "trainer.max_steps=1", "trainer.save_steps=100"])
    finally:
        torch.set_num_threads(threads)
    lin, why = read_lineage(adapter)
    assert why is None and lin is not None
    assert lin.train_seeds == [5, 6, 7, 8] and lin.runs == ["/runs/r"]
    assert [a.to_json() for a in lin.auditors] == AUDITORS
    assert lin.train_trials == {"s5": 5, "s6": 6, "s7": 7, "s8": 8}
    assert json.loads((adapter / "lhd_adapter.json").read_text())["lineage"]["train_seeds"] == [5, 6, 7, 8]
    assert read_lineage(tmp_path)[0] is None and "not found" in (read_lineage(tmp_path)[1] or "")
