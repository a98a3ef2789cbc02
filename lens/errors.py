"""The one error type of the lens package.

It derives from the project's `LhdError`, so the `lhd` command prints it as a one-line
message instead of a traceback.
"""
from __future__ import annotations

try:  # the project's base class; lens stays importable on its own if it is missing
    from lhd_train.errors import LhdError as _Base
except Exception:  # pragma: no cover - only without lhd_train
    _Base = Exception


class LensError(_Base):
    """Bad input or an inconsistent lens/model/probe combination, with a message that says what to do."""
