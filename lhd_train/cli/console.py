"""Where `lhd` prints its tables and messages: the command layer's consoles (`lhd_train/cli/`, the
error boundary). Library code logs instead and never imports this module (tests/test_layout.py).

rich cuts a table to 80 columns when its output is not a terminal, abbreviating every column
name ("stat…", "roun…"), which makes the log of a cluster job unreadable. Tables printed to a
file or pipe therefore get all the width they need; on a terminal rich keeps fitting them to it,
and COLUMNS, when set, is obeyed everywhere."""
from __future__ import annotations

import os
import re

from rich.console import Console
from rich.markup import escape

LOG_WIDTH = 10_000  # wider than any table: rich sizes a table to its content, not to this


def table_console(stderr: bool = False) -> Console:
    console = Console(stderr=stderr)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(stderr=stderr, width=LOG_WIDTH)
    return console


# Messages (progress notes, paths written, errors) go to stderr; tables and JSON to stdout.
console = Console(stderr=True)


# C0 controls but tab and newline, DEL, C1 controls, and the bidirectional overrides and isolates
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def shown(text: str) -> str:
    """Text from a model or a remote server (docs/formats.md, "Threat model") as the terminal should
    show it: every control character as a visible escape (`\\x1b`), so an escape sequence can
    neither move the cursor, retitle the window, write the clipboard nor hide what follows."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                        else f"\\u{ord(m.group()):04x}", text)


def shown_markup(text: str) -> str:
    """`shown`, for a rich `console.print` with markup: its `[...]` are printed, not obeyed."""
    return escape(shown(text))
