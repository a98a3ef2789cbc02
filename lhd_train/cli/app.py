"""The `lhd` typer app, assembled from one module per command group.

Each group module defines its commands on a typer app of its own (the Slurm, merge and doctor
commands call into `lhd_train.ops`); the `lens` library's commands are `lhd lens` (`cli/lens.py`)."""
from __future__ import annotations

import os

import typer

from lhd_train.cli import audit, audit_eval, data, doctor, entitle, lens, merge, models, report, run, slurm, train

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

app = typer.Typer(help="lhd: long-horizon deception workbench", no_args_is_help=True, add_completion=False,
                  pretty_exceptions_enable=False)
for group in (run, models, audit, audit_eval, train, report):
    app.add_typer(group.app)
app.add_typer(data.data_app, name="data")
app.add_typer(slurm.slurm_app, name="slurm")
for group in (merge, doctor):
    app.add_typer(group.app)
app.add_typer(lens.app, name="lens", help="Jacobian lens: fit, probe sets, margin readouts")
app.add_typer(entitle.app, name="entitle")
