"""Issue 31, item 3: resuming `lhd train` from a newest checkpoint whose adapter file was cut short.

A real TRL run of the tiny model writes checkpoint-2 and checkpoint-4; the test then removes the
finished adapter (so the rerun resumes) and truncates checkpoint-4's `adapter_model.safetensors`
(a kill or a full disk while it was written). Before: the resume crashed inside safetensors with a
traceback. Now it falls back to checkpoint-2, saying so, and trains steps 3 and 4 again; with no
complete checkpoint left it stops with one line naming the damaged one."""
from __future__ import annotations

import json
import logging
import shutil

import pytest
from test_trainer import RECIPES, _one_thread, data, history, llama  # noqa: F401  (fixtures)

from lhd_train.errors import LhdError


def _truncate(path, keep: float = 0.5) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: int(len(raw) * keep)])


@pytest.fixture
def two_checkpoints(llama, data, tmp_path):  # noqa: F811
    """(recipe overrides, output dir) of a finished 4-step SFT run with checkpoint-2 and checkpoint-4,
    its final adapter removed so that a rerun resumes from the newest checkpoint."""
    from lhd_train.finetune.trainer import train_command

    out = tmp_path / "sft"
    common = [f"model={llama}", f"data.train={data['sft']}", f"output_dir={out}", "trainer.max_steps=4",
              "trainer.save_steps=2", "trainer.save_total_limit=null"]
    train_command("sft", RECIPES / "tiny" / "sft-honest.yaml", common)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    shutil.rmtree(out / "adapter")
    return common, out


def test_a_truncated_newest_adapter_falls_back_to_the_previous_checkpoint(two_checkpoints, caplog):
    from lhd_train.finetune.trainer import train_command

    common, out = two_checkpoints
    _truncate(out / "checkpoint-4" / "adapter_model.safetensors")
    with caplog.at_level(logging.WARNING):
        adapter = train_command("sft", RECIPES / "tiny" / "sft-honest.yaml", common)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("checkpoint-4" in m and "adapter_model.safetensors" in m and "checkpoint-2" in m for m in said), said
    meta = json.loads((adapter / "lhd_adapter.json").read_text())
    assert meta["training"]["resumed_from"] == str(out / "checkpoint-2")
    assert meta["training"]["start_step"] == 2 and meta["training"]["global_step"] == 4
    assert [e["step"] for e in history(adapter) if "loss" in e] == [1, 2, 3, 4]  # 1-2 from checkpoint-2, then 3-4


def test_no_complete_checkpoint_left_is_one_line(two_checkpoints):
    from lhd_train.finetune.trainer import train_command

    common, out = two_checkpoints
    for step in (2, 4):
        _truncate(out / f"checkpoint-{step}" / "adapter_model.safetensors")
    with pytest.raises(LhdError) as e:
        train_command("sft", RECIPES / "tiny" / "sft-honest.yaml", common)
    line = str(e.value)
    assert "\n" not in line and "checkpoint-4" in line and "adapter_model.safetensors" in line, line
    assert not (out / "adapter").exists()


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "rng_state.pth"])
def test_other_cut_checkpoint_files_are_caught_before_transformers_reads_them(name, two_checkpoints):
    """Not only the adapter: a cut optimizer, scheduler or RNG state also makes a checkpoint
    incomplete (checked from the file's own structure, without loading it)."""
    from lhd_train.finetune.checkpoints import resume_checkpoint

    _, out = two_checkpoints
    assert resume_checkpoint(out) == out / "checkpoint-4"
    _truncate(out / "checkpoint-4" / name, 0.9)
    assert resume_checkpoint(out) == out / "checkpoint-2"
