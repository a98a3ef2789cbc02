"""Past one GPU: the merge of sharded runs (the shard rule is `lhd_train.rundir.shard`), slurm scripts
for every stage and their variables, environment checks.

Plain functions for the CLI (`lhd run --shard`, `lhd merge`, `lhd slurm render`, `lhd doctor`);
the typer commands are in `lhd_train/cli/` (slurm.py, merge.py, doctor.py, data.py). Nothing here
imports vllm."""
from lhd_train.ops.doctor_checks import doctor
from lhd_train.ops.merge import merge_datasets, merge_runs
from lhd_train.ops.slurm import dry_run_commands, render_slurm
from lhd_train.ops.slurm_vars import STAGES

__all__ = ["STAGES", "doctor", "dry_run_commands", "merge_datasets", "merge_runs", "render_slurm"]

