"""`lhd doctor`: Python, torch/CUDA, GPUs, package versions, disk, cached models, a config's GPU plan
and vLLM's verdict on its vllm models."""
from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer()


@app.command("doctor")
def doctor_cmd(
    config: Path | None = typer.Option(None, "--config", help="also check its models: in HF_HOME, their `gpus:` "
                                       "against the visible GPUs, and each vllm model with vLLM's own parser and "
                                       "ModelConfig (config.json only, no weights)"),
    path: Path = typer.Option(Path("."), "--path", help="where checkpoints and runs go (free disk)"),
    gpu_gib: float | None = typer.Option(None, "--gpu-gib", min=1, help="memory of the GPUs the config's vllm "
                                         "servers will run on, for the KV-cache estimate (default: the first "
                                         "visible GPU, else an H100 80GB)"),
    as_json: bool = typer.Option(False, "--json", help="rows as JSON"),
) -> None:
    """Python, torch/CUDA, GPUs, package versions and known incompatibilities, disk, cached models."""
    from lhd_train.ops.doctor_checks import FAIL, doctor

    rows = doctor(config, path, gpu_gib)
    if as_json:
        typer.echo(json.dumps([{"check": c, "status": s, "detail": d} for c, s, d in rows], indent=1))
    else:
        print_rows(rows)
    if any(s == FAIL for _, s, _ in rows):
        raise typer.Exit(1)


def print_rows(rows: list[tuple[str, str, str]]) -> None:
    """The checks as a table on stdout (full width in logs and pipes, see lhd_train.cli.console)."""
    from rich.table import Table

    from lhd_train.cli.console import table_console
    from lhd_train.ops.doctor_checks import FAIL, OK, WARN

    table = Table(title="lhd doctor")
    for col in ("check", "status", "detail"):
        table.add_column(col, overflow="fold")
    colour = {OK: "green", WARN: "yellow", FAIL: "red"}
    for check, status, detail in rows:
        table.add_row(check, f"[{colour.get(status, 'white')}]{status}[/]", detail)
    table_console().print(table)
