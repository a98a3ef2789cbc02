"""Past one GPU: sharded runs and their merge, slurm scripts for every stage, environment checks.

Plain functions for the CLI (`lhd run --shard`, `lhd merge`, `lhd slurm render`, `lhd doctor`);
the typer commands are in `lhd_train/cli/` (slurm.py, merge.py, doctor.py, data.py). Nothing here
imports vllm."""
from lhd_train.config.slurm import STAGES
from lhd_train.ops.doctor_checks import doctor
from lhd_train.ops.merge import merge_datasets, merge_runs
from lhd_train.ops.shard import parse_shard, shard_config, shard_items, shard_run_name
from lhd_train.ops.slurm import dry_run_commands, render_slurm

__all__ = ["STAGES", "doctor", "dry_run_commands", "merge_datasets", "merge_runs", "parse_shard", "render_slurm",
           "shard_config", "shard_items", "shard_run_name"]

