"""Past one GPU: sharded runs and their merge, slurm scripts for every stage, environment checks.

Plain functions for the CLI (`lhd run --shard`, `lhd merge`, `lhd slurm render`, `lhd doctor`);
`lhd_train.cluster.cli.register(app)` adds the typer commands. Nothing here imports vllm."""
from lhd_train.cluster.doctor_checks import doctor
from lhd_train.cluster.merge import merge_datasets, merge_runs
from lhd_train.cluster.shard import parse_shard, shard_config, shard_items, shard_run_name
from lhd_train.cluster.slurm import STAGES, dry_run_commands, render_slurm

__all__ = ["STAGES", "doctor", "dry_run_commands", "merge_datasets", "merge_runs", "parse_shard", "render_slurm",
           "shard_config", "shard_items", "shard_run_name"]

