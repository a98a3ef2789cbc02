"""The pre-registration rule of a read: the plan (primary cell, band, token sets, answers) is
written and hashed before the first forward, and a later read into the same folder must declare
the same plan, so the cell that counts cannot be chosen after seeing the table."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from lhd_train.errors import InputError
from lhd_train.io.files import atomic_write_text, read_json_mapping

PLAN = "plan.json"


def plan_digest(plan: dict[str, Any]) -> str:
    """sha256 of the plan without its time stamp (and without a digest it already holds)."""
    key = {k: v for k, v in plan.items() if k not in ("declared_at", "sha256")}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def declare_plan(out: Path, plan: dict[str, Any]) -> dict[str, Any]:
    """Write `out/plan.json` (with its sha256) before any forward; an existing one must hold the same plan, and
    keeps its first declaration time."""
    path = out / PLAN
    digest = plan_digest(plan)
    old = read_json_mapping(path)
    if old and old.get("sha256") != digest:
        raise InputError(path, "sha256", f"the folder declares another plan (primary {old.get('primary')}, band "
                         f"{old.get('band')}); a read into it must keep that plan",
                         "the same plan, or a new --out to read with another one")
    plan = {**plan, "sha256": digest, "declared_at": old.get("declared_at") or plan["declared_at"]}
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(plan, indent=2, default=str) + "\n")
    return plan
