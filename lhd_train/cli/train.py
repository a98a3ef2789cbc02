"""`lhd train ALGO RECIPE`: a LoRA adapter with TRL (the algorithms: `config.algos.ALGOS`)."""
from __future__ import annotations

from pathlib import Path

import typer

from lhd_train.cli.console import console
from lhd_train.config.algos import ALGOS

app = typer.Typer()


@app.command("train")
def train_cmd(
    algo: str = typer.Argument(..., help=" | ".join(ALGOS)),
    recipe: Path = typer.Argument(..., help="recipe YAML (recipes/...)"),
    overrides: list[str] | None = typer.Argument(None, help="key.sub=value overrides"),
    fit_only: bool = typer.Option(False, "--fit-only", help="only fit the rows to the trainer's length and save "
                                  "them (one process, no model): run before a multi-GPU launch"),
) -> None:
    """Fine-tune a LoRA adapter with TRL from a recipe; resumes from the last checkpoint."""
    from lhd_train.finetune.trainer import train_command

    if fit_only:
        console.print(f"fitted rows: {train_command(algo, recipe, overrides or [], fit=True)}")
        return
    console.print(f"adapter: {train_command(algo, recipe, overrides or [])}")
