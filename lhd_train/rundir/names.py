"""The one rule for names that become file or folder names (run names, auditor ids, ...).

A name is joined to a parent folder (`output_dir/run_name`, `audit/<auditor-id>`), so it must
stay inside it: no separators, not `.` or `..`, and not hidden (a leading dot). One validator
for all of them, so a rule fixed for one name is fixed for every name."""
from __future__ import annotations

import re

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
ALLOWED = "letters, digits, '.', '_', '-', starting with a letter or digit"


def name_problem(value: str) -> str | None:
    """Why `value` cannot be a file name, or None when it can."""
    if not isinstance(value, str) or not NAME.match(value):
        return f"{value!r} is not a plain name (allowed: {ALLOWED})"
    return None


def trial_id(seed: int, category: str | None = None, pressure: str | None = None) -> str:
    """The one trial-id rule (docs/formats.md): `s<seed>`, plus the control study's fixed event
    (`-cat-<category>`, `-lvl-<pressure>`), or `-none` for the no-event control."""
    tid = f"s{seed}"
    if "NONE" in (category, pressure):
        return tid + "-none"
    if category:
        tid += f"-cat-{category}"
    if pressure:
        tid += f"-lvl-{pressure}"
    return tid


TRIAL_ID = re.compile(r"^s(?P<seed>\d+)"
                      r"(?:(?P<none>-none)|(?:-cat-(?P<category>[A-Z_]+))?(?:-lvl-(?P<pressure>[A-Z_]+))?)$")


def parse_trial_id(tid: str) -> tuple[int, str | None, str | None] | None:
    """The inverse of `trial_id`: (seed, category, pressure), with "NONE" for the no-event
    control; None for an id this rule did not make (an imported or hand-named trial)."""
    m = TRIAL_ID.match(tid)
    if m is None:
        return None
    if m.group("none"):
        return int(m.group("seed")), "NONE", None
    return int(m.group("seed")), m.group("category"), m.group("pressure")
