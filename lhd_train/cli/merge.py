"""`lhd merge`: join sharded run directories into one run (`lhd data merge` is in `cli.data`)."""
from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer()


@app.command("merge")
def merge_cmd(
    run_dirs: list[Path] = typer.Argument(..., help="shard run directories (runs/<name>-shard<i>of<n>)"),
    out: Path = typer.Option(..., "--out", help="the merged run directory (created, or extended)"),
    run_name: str | None = typer.Option(None, "--run-name", help="default: the --out folder's name"),
) -> None:
    """Join sharded run directories into one run; refuses mismatched configs and shared trials."""
    from lhd_train.ops.merge import merge_runs

    r = merge_runs(list(run_dirs), out, run_name)
    typer.echo(f"{r['out']}: {len(r['trials'])} trials from {len(r['sources'])} source(s); "
               f"{len(r['added_trials'])} added, {len(r['updated_trials'])} updated, "
               f"{r['audit_rows_added']} audit rows added, {r['files_copied'] + r['files_written']} files written"
               + ("" if r["changed"] else " (nothing changed)"))
