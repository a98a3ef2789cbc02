"""Where `lhd` prints its tables and messages: the command layer's consoles (`lhd_train/cli/`, the
error boundary). Library code logs instead and never imports this module (tests/test_layout.py).

rich cuts a table to 80 columns when its output is not a terminal, abbreviating every column
name ("stat…", "roun…"), which makes the log of a cluster job unreadable. Tables printed to a
file or pipe therefore get all the width they need; on a terminal rich keeps fitting them to it,
and COLUMNS, when set, is obeyed everywhere."""
from __future__ import annotations

import os

from rich.console import Console

LOG_WIDTH = 10_000  # wider than any table: rich sizes a table to its content, not to this


def table_console(stderr: bool = False) -> Console:
    console = Console(stderr=stderr)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(stderr=stderr, width=LOG_WIDTH)
    return console


# Messages (progress notes, paths written, errors) go to stderr; tables and JSON to stdout.
console = Console(stderr=True)
