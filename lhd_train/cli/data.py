"""`lhd data bon|dpo|grpo`: training data from an audited run; `lhd data merge` joins the datasets of shard runs."""
from __future__ import annotations

from pathlib import Path

import typer

from lhd_train.console import console

data_app = typer.Typer(help="training data from audited runs: best-of-N SFT, DPO pairs, GRPO prompts",
                       no_args_is_help=True)


def _build_settings(run: Path, out: Path, n: int, direction: str, auditor: Path | None, overrides: list[str],
                    max_contexts: int | None, eval_fraction: float, min_margin: float, concurrency: int,
                    run_auditor: str | None = None):
    from lhd_train.finetune.datasets import BuildSettings

    _check_data_options(direction, eval_fraction, n, max_contexts, concurrency, out)
    return BuildSettings(run, out, n, direction, auditor, tuple(overrides), eval_fraction, max_contexts,
                         min_margin, concurrency=concurrency, run_auditor=run_auditor)


def _check_data_options(direction: str, eval_fraction: float, n: int | None = None, max_contexts: int | None = None,
                        concurrency: int = 1, out: Path | None = None) -> None:
    """Options checked before any model loads, so a typo costs no loading time. `--out` must be a
    folder outside the run's own files (`rundir.outputs`)."""
    from lhd_train.errors import InputError
    from lhd_train.rundir.outputs import check_out_dir

    if out is not None:
        check_out_dir(out, what="dataset")
    if max_contexts is not None and max_contexts < 1:  # 0 used to mean "no limit"
        raise InputError("command line", "--max-contexts", f"{max_contexts} contexts", "an integer >= 1 (omit it "
                         "for every context)")
    if not 1 <= concurrency <= 4096:  # 0 waited forever, -1 crashed
        raise InputError("command line", "--concurrency", f"{concurrency} requests at once", "1 ... 4096")
    if direction not in ("honest", "deceptive"):
        raise InputError("command line", "--direction", f"'{direction}'", "honest, deceptive")
    if not 0 <= eval_fraction < 1:
        raise InputError("command line", "--eval-fraction", f"{eval_fraction} is not a share of the trials",
                         "0 <= x < 1")
    if n is not None and n < 1:
        raise InputError("command line", "--n", f"{n} candidates per context", "an integer >= 1")


def _data_lock(run: Path, out: Path, stage: str):
    """`lhd data` reads a run and writes beside it (often into it): one writer at a time."""
    from lhd_train.rundir.lock import run_dir_lock

    return run_dir_lock(run, out, stage=stage)


_RUN = typer.Argument(..., help="an audited run directory")
_OUT = typer.Option(..., "--out", help="output folder (dataset/, candidates.jsonl, grades.jsonl)")
_RUN_AUDITOR = typer.Option(None, "--run-auditor", help="which of the run's auditors (a folder under audit/) labels "
                            "the original answers; default: the run's headline auditor, as in the report")


@data_app.command("bon")
def data_bon_cmd(
    run: Path = _RUN, out: Path = _OUT,
    overrides: list[str] | None = typer.Argument(None, help="auditor config overrides key=value"),
    n: int = typer.Option(4, "--n", help="candidates sampled per context"),
    direction: str = typer.Option("honest", "--direction", help="honest | deceptive"),
    auditor: Path | None = typer.Option(None, "--auditor", help="auditor config (default: the run's)"),
    max_contexts: int | None = typer.Option(None, "--max-contexts"),
    eval_fraction: float = typer.Option(0.2, "--eval-fraction", help="share of trials held out"),
    concurrency: int = typer.Option(32, "--concurrency"),
    run_auditor: str | None = _RUN_AUDITOR,
) -> None:
    """Best-of-N SFT data: sample N answers per context, grade them, keep the best for the direction."""
    from lhd_train.finetune.datasets import build_bon

    settings = _build_settings(run, out, n, direction, auditor, overrides or [], max_contexts, eval_fraction, 1.0,
                               concurrency, run_auditor)
    with _data_lock(run, out, "lhd data bon"):
        path, stats = build_bon(settings)
    console.print(f"best-of-{n} ({direction}): {stats}\ndataset: {path}")


@data_app.command("dpo")
def data_dpo_cmd(
    run: Path = _RUN, out: Path = _OUT,
    overrides: list[str] | None = typer.Argument(None, help="auditor config overrides key=value"),
    n: int = typer.Option(4, "--n"),
    direction: str = typer.Option("honest", "--direction", help="honest | deceptive"),
    auditor: Path | None = typer.Option(None, "--auditor"),
    min_margin: float = typer.Option(1.0, "--min-margin", help="least severity gap between chosen and rejected"),
    max_contexts: int | None = typer.Option(None, "--max-contexts"),
    eval_fraction: float = typer.Option(0.2, "--eval-fraction"),
    concurrency: int = typer.Option(32, "--concurrency"),
    run_auditor: str | None = _RUN_AUDITOR,
) -> None:
    """DPO pairs from the graded candidates (and the original answer)."""
    from lhd_train.finetune.datasets import build_dpo

    settings = _build_settings(run, out, n, direction, auditor, overrides or [], max_contexts, eval_fraction,
                               min_margin, concurrency, run_auditor)
    with _data_lock(run, out, "lhd data dpo"):
        path, stats = build_dpo(settings)
    console.print(f"DPO pairs ({direction}): {stats}\ndataset: {path}")


@data_app.command("grpo")
def data_grpo_cmd(
    run: Path = _RUN, out: Path = _OUT,
    direction: str = typer.Option("honest", "--direction"),
    max_contexts: int | None = typer.Option(None, "--max-contexts"),
    eval_fraction: float = typer.Option(0.2, "--eval-fraction"),
    run_auditor: str | None = _RUN_AUDITOR,
) -> None:
    """Prompt-only GRPO data; the honesty reward grades completions in their trajectory context."""
    from lhd_train.finetune.datasets import build_grpo

    _check_data_options(direction, eval_fraction, max_contexts=max_contexts, out=out)
    with _data_lock(run, out, "lhd data grpo"):
        path, stats = build_grpo(run, out, eval_fraction, max_contexts, direction,  # type: ignore[arg-type]
                                 run_auditor=run_auditor)
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
