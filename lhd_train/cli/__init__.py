"""The `lhd` command line: one module per command group (`run`, `models`, `audit`, `data`,
`train`, `report`, `slurm`, `merge`, `doctor`; the lens group comes from `lens.cli`), assembled in `app`.

`main()` owns error handling for every entry point (`lhd`, `python -m lhd_train.cli`,
`python -m lhd_train.audit`, `python -m lhd_train.finetune`, `python -m lens`): bad input and a
model that cannot load end as one `error:` line and exit status 2, never a traceback."""
from __future__ import annotations

import sys
from collections.abc import Callable


def guarded(call: Callable[[], int | None]) -> int:
    """Run `call` and turn lhd's errors into `report_error`, Ctrl-C into a resume hint."""
    from lhd_train.errors import LhdError, report_error
    from rollouts.backend import BackendError

    try:
        return call() or 0
    except (LhdError, BackendError) as e:  # BackendError: rollouts/ knows nothing of lhd's errors
        return report_error(e)
    except KeyboardInterrupt:
        from lhd_train.console import console

        console.print("[yellow]interrupted: finished rounds are on disk; rerun to resume[/yellow]")
        return 130


def main() -> None:
    """The `lhd` entry point."""
    from lhd_train.cli.app import app

    sys.exit(guarded(app))
