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
    as_json: bool = typer.Option(False, "--json", help="rows as JSON"),
) -> None:
    """Python, torch/CUDA, GPUs, package versions and known incompatibilities, disk, cached models."""
    from lhd_train.ops.doctor_checks import doctor, print_rows

    rows = doctor(config, path)
    if as_json:
        typer.echo(json.dumps([{"check": c, "status": s, "detail": d} for c, s, d in rows], indent=1))
        code = 1 if any(s == "fail" for _, s, _ in rows) else 0
    else:
        code = print_rows(rows)
    if code:
        raise typer.Exit(code)
