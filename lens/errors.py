"""The one error type of the lens package.

It derives from the project's `LhdError`, so the `lhd` command prints it as a one-line
message instead of a traceback.
"""
from __future__ import annotations

from lhd_train.errors import LhdError


class LensError(LhdError):
    """Bad input or an inconsistent lens/model/probe combination, with a message that says what to do."""
