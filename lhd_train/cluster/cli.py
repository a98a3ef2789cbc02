"""Typer commands of the cluster tools. `register(app, data_app)` adds them to the `lhd` app:

    lhd slurm render STAGE CONFIG [--var k=v ...] [--dry-run] [--out FILE]
    lhd slurm vars STAGE
    lhd slurm status RUN [--shards N] [--json] [--no-slurm]
    lhd merge RUN_DIRS... --out RUN [--run-name NAME]
    lhd data merge PARTS... --out DIR
    lhd doctor [--config CONFIG] [--path DIR] [--json]

`python -m lhd_train.cluster ...` runs the same commands without the main CLI."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer, data_app: Optional[typer.Typer] = None) -> None:
    from lhd_train.cluster.slurm import STAGES

    slurm_app = typer.Typer(help="sbatch scripts for every stage (rollout, audit, data, train, lens, merge)",
                            no_args_is_help=True)
    app.add_typer(slurm_app, name="slurm")

    @slurm_app.command("render")
    def slurm_render_cmd(
        stage: str = typer.Argument(..., help=" | ".join(STAGES)),
        config: Path = typer.Argument(..., help="run config (rollout, audit, data, merge), recipe (train), "
                                                "model/run config (lens)"),
        var: Optional[list[str]] = typer.Option(None, "--var", help="KEY=VALUE, value as YAML; repeat "
                                                "(see `lhd slurm vars STAGE`)"),
        dry_run: bool = typer.Option(False, "--dry-run", help="print the commands the job(s) would run instead"),
        out: Optional[Path] = typer.Option(None, "--out", help="write the script here (and create its logs dir)"),
    ) -> None:
        """Print the filled sbatch script of a stage (or, with --dry-run, the commands it runs)."""
        from lhd_train.cluster.slurm import dry_run_commands, parse_vars, render_slurm

        values = parse_vars(var or [])
        if dry_run:
            typer.echo("\n".join(dry_run_commands(stage, config, **values)))
            return
        text = render_slurm(stage, config, **values)
        if out is None:
            typer.echo(text, nl=False)
            return
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        logs = values.get("logs_dir", "logs/slurm")
        Path(str(logs)).mkdir(parents=True, exist_ok=True)
        typer.echo(f"wrote {out}; submit from here with: sbatch {out}", err=True)

    @slurm_app.command("vars")
    def slurm_vars_cmd(stage: str = typer.Argument(..., help=" | ".join(STAGES))) -> None:
        """The variables a stage's template takes, with their defaults."""
        from lhd_train.cluster.slurm import COMMON, STAGE_VARS
        from lhd_train.errors import InputError

        if stage not in STAGE_VARS:
            raise InputError("command line", "STAGE", f"unknown stage '{stage}'", ", ".join(STAGES))
        for k, v in sorted({**COMMON, **STAGE_VARS[stage]}.items()):
            typer.echo(f"{k} = {json.dumps(v)}")

    @slurm_app.command("status")
    def slurm_status_cmd(
        run: Path = typer.Argument(..., help="the run config, or the (merged) run directory runs/<run_name>"),
        shards: Optional[int] = typer.Option(None, "--shards", min=1, help="shard count (default: the shard "
                                             "directories on disk, else the rollout array's size)"),
        as_json: bool = typer.Option(False, "--json", help="rows as JSON"),
        no_slurm: bool = typer.Option(False, "--no-slurm", help="read the run directories only"),
    ) -> None:
        """Pending, running, finished or failed: every shard and stage of a run, from squeue/scontrol/sacct
        (jobs named by `lhd slurm render`) and from the run directories."""
        from lhd_train.cluster.status import print_status, run_status, status_json

        st = run_status(run, shards, use_slurm=not no_slurm)
        if as_json:
            typer.echo(json.dumps(status_json(st), indent=1))
        else:
            print_status(st)

    @app.command("merge")
    def merge_cmd(
        run_dirs: list[Path] = typer.Argument(..., help="shard run directories (runs/<name>-shard<i>of<n>)"),
        out: Path = typer.Option(..., "--out", help="the merged run directory (created, or extended)"),
        run_name: Optional[str] = typer.Option(None, "--run-name", help="default: the --out folder's name"),
    ) -> None:
        """Join sharded run directories into one run; refuses mismatched configs and shared trials."""
        from lhd_train.cluster.merge import merge_runs

        r = merge_runs(list(run_dirs), out, run_name)
        typer.echo(f"{r['out']}: {len(r['trials'])} trials from {len(r['sources'])} source(s); "
                   f"{len(r['added_trials'])} added, {len(r['updated_trials'])} updated, "
                   f"{r['audit_rows_added']} audit rows added, {r['files_copied'] + r['files_written']} files written"
                   + ("" if r["changed"] else " (nothing changed)"))

    if data_app is not None:
        @data_app.command("merge")
        def data_merge_cmd(
            parts: list[Path] = typer.Argument(..., help="dataset folders built from shard runs"),
            out: Path = typer.Option(..., "--out", help="output folder (dataset/ and dataset.json)"),
        ) -> None:
            """Join datasets built from shard runs (splits are by trial, so the union is exact)."""
            from lhd_train.cluster.merge import merge_datasets

            r = merge_datasets(list(parts), out)
            typer.echo(f"dataset: {r['out']} ({r['rows']}) from {r['parts']} parts")

    @app.command("doctor")
    def doctor_cmd(
        config: Optional[Path] = typer.Option(None, "--config", help="also check that its models are in HF_HOME"),
        path: Path = typer.Option(Path("."), "--path", help="where checkpoints and runs go (free disk)"),
        as_json: bool = typer.Option(False, "--json", help="rows as JSON"),
    ) -> None:
        """Python, torch/CUDA, GPUs, package versions and known incompatibilities, disk, cached models."""
        from lhd_train.cluster.doctor_checks import doctor, print_rows

        rows = doctor(config, path)
        if as_json:
            typer.echo(json.dumps([{"check": c, "status": s, "detail": d} for c, s, d in rows], indent=1))
            code = 1 if any(s == "fail" for _, s, _ in rows) else 0
        else:
            code = print_rows(rows)
        if code:
            raise typer.Exit(code)


def standalone_app() -> typer.Typer:
    app = typer.Typer(help="lhd cluster tools", no_args_is_help=True, add_completion=False,
                      pretty_exceptions_enable=False)
    data_app = typer.Typer(help="datasets", no_args_is_help=True)
    app.add_typer(data_app, name="data")
    register(app, data_app)
    return app
