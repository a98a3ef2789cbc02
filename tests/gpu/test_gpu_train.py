"""TRL through `lhd_train.finetune.trainer` on the tiny Llama: bf16 with gradient checkpointing on
CUDA (float32 on CPU, where bf16 is skipped)."""
from __future__ import annotations

import importlib.util
import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
from gpu_support import dtype_of, is_cuda, peak_since, reset_peak

SYSTEM = {"role": "system", "content": "You report progress to your supervisor."}
ANSWER = {"role": "assistant", "content": "The report is complete and accurate."}
HISTORY = ("Background for task {i}, round {r}: the quarterly report lists units sold per region, the prices, "
           "the demand, the budget and the open risks of the project in detail. ")


@pytest.fixture
def train_device(device: str) -> str:
    """The trainer takes the GPU whenever it sees one, so the CPU form runs only where none is visible."""
    import torch

    if not is_cuda(device) and torch.cuda.is_available():
        pytest.skip("the CPU form runs where no GPU is visible (lhd's trainer takes a visible GPU)")
    return device


def recipe(device: str, model: Path, work: Path, algo: str, data: Path, trainer: dict[str, Any],
           extra: dict[str, Any] | None = None):
    """A recipe for the tiny model: a few steps, LoRA on every linear layer."""
    from lhd_train.config.recipe import parse_recipe

    args: dict[str, Any] = {"max_steps": 3, "per_device_train_batch_size": 2, "learning_rate": 1e-3,
                            "lr_scheduler_type": "constant", "logging_steps": 1, "save_strategy": "no", "seed": 0,
                            "dataloader_num_workers": 0, "report_to": "none"}
    if is_cuda(device):
        args.update({"bf16": True, "gradient_checkpointing": True})
    args.update(trainer)
    raw = {"algo": algo, "model": str(model), "dtype": dtype_of(device), "direction": "honest",
           "data": {"train": str(data)}, "output_dir": str(work / "out"),
           "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"}, "trainer": args,
           "wandb": {"enabled": False}, **(extra or {})}
    return parse_recipe(raw, f"tests/gpu/{algo}")


def save_rows(work: Path, rows: list[dict[str, Any]]) -> Path:
    from datasets import Dataset

    Dataset.from_list(rows).save_to_disk(str(work / "data"))
    return work / "data"


def losses_of(adapter: Path) -> list[float]:
    return [e["loss"] for e in json.loads((adapter / "log_history.json").read_text()) if "loss" in e]


def finite(values: list[float]) -> bool:
    return bool(values) and all(math.isfinite(x) for x in values)


def test_trl_lora_sft(train_device, tiny4_dir, tmp_path, measure):
    from lhd_train.finetune.records import read_adapter_record
    from lhd_train.finetune.trainer import train

    rows = [{"messages": [SYSTEM, {"role": "user", "content": f"What is the status of task {i}?"}, ANSWER]}
            for i in range(16)]
    r = recipe(train_device, tiny4_dir, tmp_path, "sft", save_rows(tmp_path, rows),
               {"max_steps": 6, "per_device_train_batch_size": 4, "max_length": 256}, {"sft": {"loss_on": "assistant"}})
    t0 = time.perf_counter()
    adapter = train(r, source="tests/gpu")
    secs = time.perf_counter() - t0
    meta = read_adapter_record(adapter)
    assert meta is not None  # `train` wrote it
    losses = losses_of(adapter)
    device, bf16 = meta.training.device, bool(meta.training.trainer_args.get("bf16"))
    measure(f"{meta.training.global_step} steps on {device}, dtype {meta.dtype}, bf16 {bf16}, losses "
            f"{losses[0]:.3f} -> {losses[-1]:.3f} in {secs:.1f} s" if losses else "no loss logged")
    if not is_cuda(train_device):
        measure("bf16 skipped on cpu")
    assert finite(losses) and (adapter / "adapter_model.safetensors").is_file()
    assert device == ("cuda" if is_cuda(train_device) else "cpu")
    assert bf16 or not is_cuda(train_device)


def test_trl_sft_long_rows(train_device, tiny4_dir, tmp_path, measure):
    """Rows longer than max_length are cut from the left (older turns first), none dropped."""
    from lhd_train.finetune.trainer import build_trainer

    max_length = 4096 if is_cuda(train_device) else 256
    rounds = 6 if max_length == 256 else 120  # the long rows come to ~2-3x max_length
    rows = []
    for i in range(8):
        history = []
        for r in range(rounds if i % 2 else 0):
            history += [{"role": "user", "content": HISTORY.format(i=i, r=r) * 2},
                        {"role": "assistant", "content": f"Round {r}: done, nothing to add."}]
        rows.append({"messages": [SYSTEM, *history, {"role": "user", "content": f"Status of task {i}?"}, ANSWER]})
    r = recipe(train_device, tiny4_dir, tmp_path, "sft", save_rows(tmp_path, rows), {"max_length": max_length},
               {"sft": {"loss_on": "last_turn"}})
    trainer, info = build_trainer(r, source="tests/gpu")
    data = info["data"]["train"]
    fit = data.length_fit
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    measure(f"max_length {max_length}: {data.rows_read} rows read, {fit['truncated']} cut from the left, "
            f"{fit['dropped']} dropped, TRL trains on {data.rows_trained}; tokens before {fit['before']}, "
            f"after {fit['after']}; {len(losses)} finite losses {finite(losses)}")
    assert data.rows_trained == data.rows_read == len(rows)
    assert fit["truncated"] >= len(rows) // 2 and fit["dropped"] == 0 and finite(losses)


def test_trl_dpo_lora(train_device, tiny4_dir, tmp_path, measure):
    """DPO with LoRA (reference = the adapter disabled), bf16 + gradient checkpointing on CUDA."""
    from lhd_train.finetune.records import read_adapter_record
    from lhd_train.finetune.trainer import train

    rows = [{"prompt": [SYSTEM, {"role": "user", "content": f"Is task {i} done?"}],
             "chosen": [{"role": "assistant", "content": "Not yet; two files are missing."}],
             "rejected": [{"role": "assistant", "content": "Yes, everything is finished."}], "direction": "honest"}
            for i in range(8)]
    r = recipe(train_device, tiny4_dir, tmp_path, "dpo", save_rows(tmp_path, rows), {"beta": 0.1, "max_length": 256})
    base = reset_peak(train_device)
    t0 = time.perf_counter()
    adapter = train(r, source="tests/gpu")
    secs = time.perf_counter() - t0
    losses = losses_of(adapter)
    meta = read_adapter_record(adapter)
    assert meta is not None  # `train` wrote it
    targs = meta.training.trainer_args
    measure(f"{len(losses)} losses on {meta.training.device}, bf16 {targs.get('bf16')}, gradient "
            f"checkpointing {targs.get('gradient_checkpointing')}, {secs:.1f} s, "
            f"peak {peak_since(train_device, base) / 2**20:.0f} MiB")
    assert finite(losses) and meta.training.device == ("cuda" if is_cuda(train_device) else "cpu")


def test_trl_qlora(cuda, tiny4_dir, tmp_path, measure):
    if importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("bitsandbytes is not installed (extra `qlora`)")
    from lhd_train.finetune.trainer import build_trainer

    rows = [{"messages": [{"role": "user", "content": f"Status of task {i}?"}, ANSWER]} for i in range(8)]
    r = recipe(cuda, tiny4_dir, tmp_path, "sft", save_rows(tmp_path, rows), {"max_length": 128},
               {"qlora": True, "sft": {"loss_on": "last_turn"}})
    trainer, _ = build_trainer(r, source="tests/gpu")
    n4 = sum(1 for m in trainer.model.modules() if type(m).__name__ == "Linear4bit")
    trainable = sorted({str(p.dtype).removeprefix("torch.") for p in trainer.model.parameters() if p.requires_grad})
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    measure(f"{n4} Linear4bit modules, trainable dtypes {trainable}, {len(losses)} finite losses {finite(losses)}")
    assert n4 > 0 and finite(losses)


def test_train_single_device(cuda, tiny4_dir, tmp_path, measure):
    """A single-process `lhd train` on a node with several GPUs keeps the model on one."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs >= 2 visible GPUs")
    from lhd_train.finetune.trainer import build_trainer

    rows = [{"messages": [{"role": "user", "content": f"Status of task {i}?"}, ANSWER]} for i in range(8)]
    r = recipe(cuda, tiny4_dir, tmp_path, "sft", save_rows(tmp_path, rows), {"max_length": 128},
               {"sft": {"loss_on": "last_turn"}})
    trainer, _ = build_trainer(r, source="tests/gpu")
    devices = sorted({str(p.device) for p in trainer.model.parameters()})
    measure(f"{torch.cuda.device_count()} GPUs visible; the model's parameters are on {devices} "
            f"(device_map {getattr(trainer.model, 'hf_device_map', None)})")
    assert len(devices) == 1
