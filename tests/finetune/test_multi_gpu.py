"""Training on the job's own GPUs, and QLoRA on several (issue 30, B2 and B3).

- No shipped accelerate config pins a GPU id: accelerate's own launcher code, given each config, leaves
  the job's CUDA_VISIBLE_DEVICES as it was (a pinned `gpu_ids: "0"` made it overwrite it with 0).
- A DDP config ships, a `qlora: true` recipe uses it, and QLoRA trains under DDP: here two CPU
  processes under torchrun (gloo), each with a 4-bit bitsandbytes base (the CPU kernels).
- A 4-bit base under DeepSpeed ZeRO-3 or FSDP is refused before any model loads, by `lhd train` and
  by `lhd slurm render train`.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lhd_train.errors import InputError

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs" / "accelerate").glob("*.yaml"))
QLORA_RECIPE = ROOT / "recipes" / "llama-3.1-8b-instruct" / "sft-honest-qlora.yaml"


def _accelerate_env(config: Path, monkeypatch) -> dict[str, str]:
    """The environment accelerate's launcher gives the training processes for `config`."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import launch as acc_launch

    args = launch_command_parser().parse_args(["--config_file", str(config), "-m", "lhd_train.cli", "train"])
    args, defaults, _ = _validate_launch_command(args)
    if args.use_deepspeed:  # as accelerate's launch_command prepares it (deepspeed itself is not needed here)
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        return acc_launch.prepare_deepspeed_cmd_env(args)[1]
    if args.multi_gpu or args.use_fsdp:
        return acc_launch.prepare_multi_gpu_env(args)
    return acc_launch.prepare_simple_launcher_cmd_env(args)[1]


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_no_accelerate_config_moves_the_job_to_another_gpu(config, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")  # the GPU Slurm gave this job
    env = _accelerate_env(config, monkeypatch)
    assert env.get("CUDA_VISIBLE_DEVICES") == "5", f"{config.name} makes accelerate use GPU(s) " \
        f"{env.get('CUDA_VISIBLE_DEVICES')}"


def test_a_ddp_config_ships_and_the_qlora_recipe_is_rendered_on_it():
    import yaml

    from lhd_train.config.recipe import load_recipe
    from lhd_train.ops.slurm import plan_stage

    ddp = yaml.safe_load((ROOT / "configs" / "accelerate" / "ddp.yaml").read_text())
    assert ddp["distributed_type"] == "MULTI_GPU" and "gpu_ids" not in ddp
    recipe = load_recipe(QLORA_RECIPE)
    assert recipe.qlora and recipe.accelerate_config == "configs/accelerate/ddp.yaml"
    p, _ = plan_stage("train", QLORA_RECIPE)
    assert p.gpus == 8 and "--config_file configs/accelerate/ddp.yaml" in p.commands[0]
    # 1 row x 2 accumulation steps x 8 processes, as the recipe's comment says
    assert "global batch 16 rows per optimizer step" in " ".join(p.notes)


@pytest.mark.parametrize("launcher,env", [
    ("DeepSpeed ZeRO-3", {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}),
    ("FSDP2", {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}),
])
def test_a_4bit_base_is_refused_under_zero3_and_fsdp(launcher, env, monkeypatch, tmp_path):
    from lhd_train.config.recipe import load_recipe
    from lhd_train.finetune.trainer_args import trainer_arguments

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    recipe = load_recipe(QLORA_RECIPE)
    with pytest.raises(InputError) as err:
        trainer_arguments(recipe, tmp_path, True, "bfloat16", str(QLORA_RECIPE), None)
    assert err.value.field == "qlora" and launcher in str(err.value) and "ddp.yaml" in str(err.value)
    trainer_arguments(load_recipe(QLORA_RECIPE, ["qlora=false"]), tmp_path, True, "bfloat16", "r", None)  # LoRA: fine
    for k in env:
        monkeypatch.delenv(k)
    trainer_arguments(recipe, tmp_path, True, "bfloat16", "r", None)  # QLoRA under DDP or one process: fine


@pytest.mark.parametrize("accelerate", ["zero3", "fsdp2"])
def test_slurm_refuses_a_4bit_base_on_a_sharding_config(accelerate):
    from lhd_train.ops.slurm import plan_stage

    with pytest.raises(InputError) as err:
        plan_stage("train", QLORA_RECIPE, accelerate=accelerate)
    assert "qlora: true" in str(err.value) and "--var accelerate=ddp" in str(err.value)
    plan_stage("train", QLORA_RECIPE, accelerate=accelerate, overrides=["qlora=false"])


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes (lhd[qlora])")
def test_qlora_trains_under_ddp(tiny_llama_dir, tmp_path):
    """Two processes under torchrun (gloo on CPU), the QLoRA recipe with the tiny model (its rows
    fitted first by `lhd train --fit-only`, as the Slurm job does): each rank
    loads the base in 4 bits, DDP averages the adapter's gradients, rank 0 writes the adapter. On a
    GPU node the same recipe runs with NCCL and `distributed_type: MULTI_GPU` (device check)."""
    from datasets import Dataset

    rows = [{"messages": [{"role": "user", "content": f"Status of task {i}?"},
                          {"role": "assistant", "content": "The report is complete and accurate."}]}
            for i in range(8)]
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "data"))
    out = tmp_path / "out"
    overrides = [f"model={tiny_llama_dir}", "revision=null", "dtype=float32", f"data.train={tmp_path / 'data'}",
                 f"output_dir={out}", "wandb.enabled=false", "trainer.max_steps=2", "trainer.max_length=64",
                 'trainer.save_strategy="no"', "trainer.logging_steps=1", "lora.target_modules=all-linear",
                 "trainer.num_train_epochs=1"]
    path = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
    # issue 38: the rows are fitted in one process before the launch (as the Slurm job does)
    fit = [sys.executable, "-m", "lhd_train.cli", "train", "sft", str(QLORA_RECIPE), *overrides, "--fit-only"]
    proc = subprocess.run(fit, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and (out / "fitted").is_dir(), proc.stderr[-3000:]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "lhd_train.cli", "train", "sft", str(QLORA_RECIPE), *overrides]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    # both ranks loaded the fitted rows (lhd_train.finetune.fit_rows.fit_once), neither fitted them
    assert proc.stderr.count("fitted rows loaded from") == 2, proc.stderr[-6000:]
    meta = json.loads((out / "adapter" / "lhd_adapter.json").read_text())
    assert meta["lora"]["qlora"] is True and meta["training"]["world_size"] == 2
    assert meta["training"]["global_step"] == 2
    losses = [e["loss"] for e in json.loads((out / "adapter" / "log_history.json").read_text()) if "loss" in e]
    assert losses and all(x == x and abs(x) < 1e4 for x in losses)


MULTI_GPU_RECIPES = [r for r in sorted((ROOT / "recipes").glob("*/*.yaml"))
                     if "single_gpu" not in str(__import__("yaml").safe_load(r.read_text()).get("accelerate_config"))]


def test_multi_gpu_recipes_set_a_ddp_timeout_and_slurm_fits_rows_before_the_launch():
    """issue 38: every recipe on a distributed accelerate config waits up to `ddp_timeout` in a
    collective (transformers' default 1800 s); the rows are fitted before `srun accelerate launch`."""
    import yaml

    from lhd_train.ops.slurm import render_slurm

    assert {r.parent.name + "/" + r.name for r in MULTI_GPU_RECIPES} == {
        "qwen3-8b/sft-honest.yaml", "llama-3.1-8b-instruct/sft-honest-qlora.yaml"}
    for recipe in MULTI_GPU_RECIPES:
        assert yaml.safe_load(recipe.read_text())["trainer"].get("ddp_timeout", 0) >= 3600, recipe
        script = render_slurm("train", recipe)
        fit = next(x for x in script.splitlines() if x.startswith(f"lhd train sft {recipe} "))
        assert fit.endswith(" --fit-only") and script.index(fit) < script.index("\nsrun --nodes"), script[-1500:]


def test_the_rendezvous_port_comes_from_the_job_id():
    """Two multi-GPU jobs on one node (e.g. two of 4 GPUs) took accelerate's 29500 both; the port
    is now computed from SLURM_JOB_ID in the job (checked by running the rendered line in bash)."""
    from lhd_train.ops.slurm import render_slurm

    script = render_slurm("train", QLORA_RECIPE, gpus_per_node=4)
    line = next(x for x in script.splitlines() if x.startswith("export MAIN_PROCESS_PORT="))
    ports = [subprocess.run(["bash", "-c", f"{line.split('#')[0]}; echo $MAIN_PROCESS_PORT"], capture_output=True,
                            text=True, env={"SLURM_JOB_ID": job, "PATH": os.environ["PATH"]}).stdout.strip()
             for job in ("4100123", "4100124")]
    assert ports == [str(15000 + 4100123 % 15000), str(15000 + 4100124 % 15000)], ports
    assert '--main_process_port "$MAIN_PROCESS_PORT"' in script
    fixed = render_slurm("train", QLORA_RECIPE, gpus_per_node=4, main_port=29600)
    assert "export MAIN_PROCESS_PORT=29600" in fixed
