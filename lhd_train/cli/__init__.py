"""The `lhd` command line: one module per command group (`run`, `models`, `audit`, `data`,
`train`, `report`, `slurm`, `merge`, `doctor`, `lens`, `entitle`), assembled in `app`.

`main()` runs the app inside the one error boundary of every entry point (`lhd`, `python -m
lhd_train.cli`, also under `accelerate launch`):
`lhd_train.cli.boundary.guarded`, re-exported here. Bad input, a model that cannot load, a refused
write and a failing chat template end as one `error:` line and exit status 2, never a traceback."""
from __future__ import annotations

import sys

from lhd_train.cli.boundary import guarded

__all__ = ["guarded", "main"]


def main() -> None:
    """The `lhd` entry point."""
    from lhd_train.cli.app import app

    sys.exit(guarded(app))
