"""`lhd slurm render|vars|status`: sbatch scripts for every stage, and where a run's jobs stand."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from lhd_train.ops.slurm_vars import STAGES

if TYPE_CHECKING:
    from lhd_train.ops.status import RunStatus

slurm_app = typer.Typer(help="sbatch scripts for every stage (rollout, audit, data, train, lens, merge)",
                        no_args_is_help=True)


@slurm_app.command("render")
def slurm_render_cmd(
    stage: str = typer.Argument(..., help=" | ".join(STAGES)),
    config: Path = typer.Argument(..., help="run config (rollout, audit, data, merge), recipe (train), "
                                            "model/run config (lens)"),
    var: list[str] | None = typer.Option(None, "--var", help="KEY=VALUE, value as YAML; repeat "
                                         "(see `lhd slurm vars STAGE`)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the commands the job(s) would run instead"),
    out: Path | None = typer.Option(None, "--out", help="write the script here (and create its logs dir)"),
) -> None:
    """Print the filled sbatch script of a stage (or, with --dry-run, the commands it runs)."""
    from lhd_train.ops.slurm import dry_run_commands, parse_vars, render_job

    values = parse_vars(var or [])
    if dry_run:
        typer.echo("\n".join(dry_run_commands(stage, config, **values)))
        return
    text, summary = render_job(stage, config, **values)
    for line in summary:
        typer.echo(line, err=True)
    if out is None:
        typer.echo(text, nl=False)
        return
    from lhd_train.errors import InputError
    from lhd_train.io.files import atomic_write_text

    if out.is_dir():
        raise InputError("command line", "--out", f"{out} is a folder; the script is a file", "a file path")
    atomic_write_text(out, text)
    logs = values.get("logs_dir", "logs/slurm")
    Path(str(logs)).mkdir(parents=True, exist_ok=True)
    typer.echo(f"wrote {out}; submit from here with: sbatch {out}", err=True)


@slurm_app.command("vars")
def slurm_vars_cmd(stage: str = typer.Argument(..., help=" | ".join(STAGES))) -> None:
    """The variables a stage's template takes, with their defaults."""
    from lhd_train.config.flags import cli_fields
    from lhd_train.ops.slurm_vars import stage_model

    model = stage_model(stage)
    for k, v in sorted(model().model_dump(include=set(cli_fields(model))).items()):
        typer.echo(f"{k} = {json.dumps(v)}")


@slurm_app.command("status")
def slurm_status_cmd(
    run: Path = typer.Argument(..., help="the run config, or the (merged) run directory runs/<run_name>"),
    shards: int | None = typer.Option(None, "--shards", help="shard count (default: the shard "
                                      "directories on disk, else the rollout array's size)"),
    as_json: bool = typer.Option(False, "--json", help="rows as JSON"),
    no_slurm: bool = typer.Option(False, "--no-slurm", help="read the run directories only"),
) -> None:
    """Pending, running, finished or failed: every shard and stage of a run, from squeue/scontrol/sacct
    (jobs named by `lhd slurm render`) and from the run directories."""
    from lhd_train.errors import InputError
    from lhd_train.ops.status import run_status, status_json

    if shards is not None and shards < 1:  # checked here, not by click, so it is one `error:` line
        raise InputError("command line", "--shards", f"{shards} is not a shard count", "1 or more")
    st = run_status(run, shards, use_slurm=not no_slurm)
    if as_json:
        typer.echo(json.dumps(status_json(st), indent=1))
    else:
        print_status(st)


def print_status(st: RunStatus) -> None:
    """`lhd slurm status`'s table (full width in logs and pipes, see lhd_train.cli.console)."""
    from rich.table import Table

    from lhd_train.cli.console import table_console

    colours = {"finished": "green", "running": "cyan", "pending": "yellow", "failed": "red", "incomplete": "magenta"}
    t = Table(title=f"{st.run_name}  ({st.run_dir})")
    for c in ("stage", "part", "status", "detail", "job", "slurm state"):
        t.add_column(c)
    for r in st.rows:
        colour = colours.get(r.status)
        status = f"[{colour}]{r.status}[/{colour}]" if colour else r.status
        t.add_row(r.stage, r.part, status, r.detail, r.job, r.slurm_state)
    console = table_console()
    console.print(t)
    if not st.rows:
        console.print("nothing found: no shard run directories, no merged run and no jobs with this run's names")
    if st.note:
        console.print(st.note)
