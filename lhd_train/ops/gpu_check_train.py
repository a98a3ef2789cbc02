"""Training checks of `lhd_train.ops.gpu_check`: TRL through `lhd_train.finetune.trainer` on the tiny
Llama, in bf16 with gradient checkpointing on CUDA (float32 on CPU, where bf16 is skipped)."""
from __future__ import annotations

import importlib.util
import json
import math
import time
from pathlib import Path
from typing import Any

from lhd_train.finetune.records import read_adapter_record
from lhd_train.ops.gpu_check_base import Ctx, Outcome, verdict

SYSTEM = {"role": "system", "content": "You report progress to your supervisor."}
ANSWER = {"role": "assistant", "content": "The report is complete and accurate."}
HISTORY = ("Background for task {i}, round {r}: the quarterly report lists units sold per region, the prices, "
           "the demand, the budget and the open risks of the project in detail. ")


def recipe(ctx: Ctx, algo: str, data: Path, out: str, trainer: dict[str, Any], extra: dict[str, Any] | None = None):
    """A recipe for the tiny model: a few steps, LoRA on every linear layer."""
    from lhd_train.config.recipe import parse_recipe

    assert ctx.model_dir is not None
    args: dict[str, Any] = {"max_steps": 3, "per_device_train_batch_size": 2, "learning_rate": 1e-3,
                            "lr_scheduler_type": "constant", "logging_steps": 1, "save_strategy": "no", "seed": 0,
                            "dataloader_num_workers": 0, "report_to": "none"}
    if ctx.cuda:
        args.update({"bf16": True, "gradient_checkpointing": True})
    args.update(trainer)
    raw = {"algo": algo, "model": str(ctx.model_dir), "dtype": ctx.dtype, "direction": "honest",
           "data": {"train": str(data)}, "output_dir": str(ctx.work / out),
           "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"}, "trainer": args,
           "wandb": {"enabled": False}, **(extra or {})}
    return parse_recipe(raw, f"gpu_check/{out}")


def save_rows(ctx: Ctx, name: str, rows: list[dict[str, Any]]) -> Path:
    from datasets import Dataset

    path = ctx.work / name
    Dataset.from_list(rows).save_to_disk(str(path))
    return path


def losses_of(adapter: Path) -> list[float]:
    return [e["loss"] for e in json.loads((adapter / "log_history.json").read_text()) if "loss" in e]


def finite(values: list[float]) -> bool:
    return bool(values) and all(math.isfinite(x) for x in values)


def check_trl_lora(ctx: Ctx) -> Outcome:
    from lhd_train.finetune.trainer import train

    rows = [{"messages": [SYSTEM, {"role": "user", "content": f"What is the status of task {i}?"}, ANSWER]}
            for i in range(16)]
    r = recipe(ctx, "sft", save_rows(ctx, "sft-data", rows), "sft-out",
               {"max_steps": 6, "per_device_train_batch_size": 4, "max_length": 256}, {"sft": {"loss_on": "assistant"}})
    t0 = time.perf_counter()
    adapter = train(r, source="gpu_check")
    secs = time.perf_counter() - t0
    meta = read_adapter_record(adapter)
    assert meta is not None  # `train` wrote it
    losses = losses_of(adapter)
    device, bf16 = meta.training.device, bool(meta.training.trainer_args.get("bf16"))
    ctx.adapters.append(adapter)
    detail = (f"{meta.training.global_step} steps on {device}, dtype {meta.dtype}, bf16 {bf16}, losses "
              f"{losses[0]:.3f} -> {losses[-1]:.3f} in {secs:.1f} s" if losses else "no loss logged")
    if not ctx.cuda:
        detail += " (bf16 skipped on cpu)"
    ok = finite(losses) and (adapter / "adapter_model.safetensors").is_file() and (device == "cuda") == ctx.cuda
    return verdict(ok and (bf16 or not ctx.cuda)), detail


def check_sft_long_rows(ctx: Ctx) -> Outcome:
    """H5: rows longer than max_length are cut from the left (older turns first), none dropped."""
    from lhd_train.finetune.trainer import build_trainer

    max_length = 256 if ctx.small or not ctx.cuda else 4096
    rounds = 6 if max_length == 256 else 120  # the long rows come to ~2-3x max_length
    rows = []
    for i in range(8):
        history = []
        for r in range(rounds if i % 2 else 0):
            history += [{"role": "user", "content": HISTORY.format(i=i, r=r) * 2},
                        {"role": "assistant", "content": f"Round {r}: done, nothing to add."}]
        rows.append({"messages": [SYSTEM, *history, {"role": "user", "content": f"Status of task {i}?"}, ANSWER]})
    r = recipe(ctx, "sft", save_rows(ctx, "sft-long", rows), "sft-long-out", {"max_length": max_length},
               {"sft": {"loss_on": "last_turn"}})
    trainer, info = build_trainer(r, source="gpu_check")
    data = info["data"]["train"]
    fit = data.length_fit
    if fit is None:
        return "SKIP", "needs lhd_train.finetune.fit_rows (left-truncation of long rows) in build_trainer"
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    detail = (f"max_length {max_length}: {data.rows_read} rows read, {fit['truncated']} cut from the left, "
              f"{fit['dropped']} dropped, TRL trains on {data.rows_trained}; tokens before {fit['before']}, "
              f"after {fit['after']}; {len(losses)} finite losses {finite(losses)}")
    ok = data.rows_trained == data.rows_read == len(rows) and fit["truncated"] >= len(rows) // 2
    return verdict(ok and fit["dropped"] == 0 and finite(losses)), detail


def check_dpo_lora(ctx: Ctx) -> Outcome:
    """DPO with LoRA (reference = the adapter disabled), bf16 + gradient checkpointing on CUDA."""
    from lhd_train.finetune.trainer import train

    rows = [{"prompt": [SYSTEM, {"role": "user", "content": f"Is task {i} done?"}],
             "chosen": [{"role": "assistant", "content": "Not yet; two files are missing."}],
             "rejected": [{"role": "assistant", "content": "Yes, everything is finished."}], "direction": "honest"}
            for i in range(8)]
    r = recipe(ctx, "dpo", save_rows(ctx, "dpo-data", rows), "dpo-out", {"beta": 0.1, "max_length": 256})
    base = ctx.reset_peak()
    t0 = time.perf_counter()
    adapter = train(r, source="gpu_check")
    secs = time.perf_counter() - t0
    losses = losses_of(adapter)
    meta = read_adapter_record(adapter)
    assert meta is not None  # `train` wrote it
    targs = meta.training.trainer_args
    ctx.adapters.append(adapter)
    detail = (f"{len(losses)} losses on {meta.training.device}, bf16 {targs.get('bf16')}, gradient "
              f"checkpointing {targs.get('gradient_checkpointing')}, {secs:.1f} s, "
              f"peak {ctx.peak_since(base) / 2**20:.0f} MiB")
    return verdict(finite(losses) and (meta.training.device == "cuda") == ctx.cuda), detail


def check_qlora(ctx: Ctx) -> Outcome:
    if not ctx.cuda:
        return "SKIP", "needs CUDA (bitsandbytes 4-bit)"
    if importlib.util.find_spec("bitsandbytes") is None:
        return "SKIP", "bitsandbytes is not installed (extra `qlora`)"
    from lhd_train.finetune.trainer import build_trainer

    rows = [{"messages": [{"role": "user", "content": f"Status of task {i}?"}, ANSWER]} for i in range(8)]
    r = recipe(ctx, "sft", save_rows(ctx, "qlora-data", rows), "qlora-out", {"max_length": 128},
               {"qlora": True, "sft": {"loss_on": "last_turn"}})
    trainer, _ = build_trainer(r, source="gpu_check")
    n4 = sum(1 for m in trainer.model.modules() if type(m).__name__ == "Linear4bit")
    trainable = sorted({str(p.dtype).removeprefix("torch.") for p in trainer.model.parameters() if p.requires_grad})
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return verdict(n4 > 0 and finite(losses)), (f"{n4} Linear4bit modules, trainable dtypes {trainable}, "
                                                 f"{len(losses)} finite losses {finite(losses)}")


def check_single_device(ctx: Ctx) -> Outcome:
    """M3: a single-process `lhd train` on a node with several GPUs keeps the model on one."""
    if ctx.gpus() < 2:
        return "SKIP", "needs >= 2 visible GPUs"
    from lhd_train.finetune.trainer import build_trainer

    rows = [{"messages": [{"role": "user", "content": f"Status of task {i}?"}, ANSWER]} for i in range(8)]
    r = recipe(ctx, "sft", save_rows(ctx, "single-data", rows), "single-out", {"max_length": 128},
               {"sft": {"loss_on": "last_turn"}})
    trainer, _ = build_trainer(r, source="gpu_check")
    devices = sorted({str(p.device) for p in trainer.model.parameters()})
    return verdict(len(devices) == 1), (f"{ctx.gpus()} GPUs visible; the model's parameters are on {devices} "
                                        f"(device_map {getattr(trainer.model, 'hf_device_map', None)})")
