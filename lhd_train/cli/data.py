"""`lhd data bon|dpo|grpo`: training data from an audited run, options from `BuildSettings` (one model for
the flags, their checks and the Slurm data stage); `lhd data merge` joins the datasets of shard runs."""
from __future__ import annotations

from pathlib import Path

import typer

from lhd_train.cli.console import console
from lhd_train.cli.options import settings_command
from lhd_train.config.data import BuildSettings

#: options of `lhd data bon|dpo` that prompt-only GRPO data does not use (nothing is sampled or graded)
GRPO_UNUSED = ("n", "min_margin", "on_task_min", "concurrency", "overrides", "auditor_config", "original_from_run")
GRPO_ONLY = ("judge_window", "judge_tokenizer", "completion_tokens")

data_app = typer.Typer(help="training data from audited runs: best-of-N SFT, DPO pairs, GRPO prompts",
                       no_args_is_help=True)


def _data_lock(run: Path, out: Path, stage: str):
    """`lhd data` reads a run and writes beside it (often into it): one writer at a time."""
    from lhd_train.rundir.lock import run_dir_lock

    return run_dir_lock(run, out, stage=stage)


def _check_out(s: BuildSettings) -> None:
    """`--out` must be a folder outside the run's own files (`rundir.outputs`), checked before any
    model loads; every other option is checked by `BuildSettings` itself."""
    from lhd_train.rundir.outputs import check_out_dir

    check_out_dir(s.out, what="dataset")


def _preflight(s: BuildSettings) -> None:
    """`lhd run`'s check before any server starts, on the models `lhd data` starts together (the
    performer, the supervisor, the auditor): their GPUs visible and not shared, no CPU vLLM for cuda,
    and vLLM's own verdict on each vllm model. Without it a bad config showed only when a server
    exited, after the 72B had loaded."""
    from lhd_train.config.run import preflight
    from lhd_train.finetune.datasets import data_specs

    specs, source = data_specs(s)
    for note in preflight(specs, source):
        console.print(f"[yellow]{note}[/yellow]")


@data_app.command("bon")
@settings_command(BuildSettings, exclude=("min_margin", *GRPO_ONLY))
def data_bon_cmd(s: BuildSettings) -> None:
    """Best-of-N SFT data: sample N answers per context, grade them, keep the best for the direction."""
    from lhd_train.finetune.datasets import build_bon

    _check_out(s)
    _preflight(s)
    with _data_lock(s.run_dir, s.out, "lhd data bon"):
        path, stats = build_bon(s)
    console.print(f"best-of-{s.n} ({s.direction}): {stats}\ndataset: {path}")


@data_app.command("dpo")
@settings_command(BuildSettings, exclude=GRPO_ONLY)
def data_dpo_cmd(s: BuildSettings) -> None:
    """DPO pairs from the graded candidates (and the original answer)."""
    from lhd_train.finetune.datasets import build_dpo

    _check_out(s)
    _preflight(s)
    with _data_lock(s.run_dir, s.out, "lhd data dpo"):
        path, stats = build_dpo(s)
    console.print(f"DPO pairs ({s.direction}): {stats}\ndataset: {path}")


@data_app.command("grpo")
@settings_command(BuildSettings, exclude=GRPO_UNUSED)
def data_grpo_cmd(s: BuildSettings) -> None:
    """Prompt-only GRPO data; the honesty reward grades completions in their trajectory context."""
    from lhd_train.finetune.datasets import build_grpo

    _check_out(s)
    with _data_lock(s.run_dir, s.out, "lhd data grpo"):
        path, stats = build_grpo(s.run_dir, s.out, s.eval_fraction, s.max_contexts, s.direction,
                                 run_auditor=s.run_auditor, judge_window=s.judge_window,
                                 judge_tokenizer=s.judge_tokenizer, completion_tokens=s.completion_tokens)
    console.print(f"GRPO prompts: {stats}\ndataset: {path}")


@data_app.command("merge")
def data_merge_cmd(
    parts: list[Path] = typer.Argument(..., help="dataset folders built from shard runs"),
    out: Path = typer.Option(..., "--out", help="output folder (dataset/ and dataset.json)"),
) -> None:
    """Join datasets built from shard runs (splits are by trial, so the union is exact)."""
    from lhd_train.ops.merge import merge_datasets
    from lhd_train.rundir.outputs import check_out_dir

    check_out_dir(out, what="merged dataset")
    r = merge_datasets(list(parts), out)
    typer.echo(f"dataset: {r['out']} ({r['rows']}) from {r['parts']} parts")
