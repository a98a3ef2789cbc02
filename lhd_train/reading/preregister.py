"""The one pre-registration rule of every read: the plan (what the primary result is, the layer
band, the settings that change a number) is written to `plan.json` before the first forward pass,
with the SHA-256 of its content. A folder that already declares another plan is refused, so a
result is never read under a plan chosen after seeing it; a rerun with the same plan resumes and
keeps the first `declared_at`."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from lens.errors import LensError
from lens.files import finite, utc_now, write_json
from lhd_train.io.files import read_json_mapping

PLAN = "plan.json"
#: fields of a plan that are bookkeeping, not part of what was declared
UNHASHED = ("declared_at", "sha256")


def plan_digest(plan: dict[str, Any]) -> str:
    """SHA-256 of the plan's declared content (key order and bookkeeping fields do not count)."""
    key = {k: v for k, v in plan.items() if k not in UNHASHED}
    return hashlib.sha256(json.dumps(finite(key), sort_keys=True, default=str).encode()).hexdigest()


def declare(out_dir: str | Path, plan: dict[str, Any]) -> dict[str, Any]:
    """Write `plan` to `out_dir/plan.json` (with its digest and `declared_at`) and return it as written; an
    existing plan.json with another digest is a `LensError` naming what it declares."""
    path = Path(out_dir) / PLAN
    digest = plan_digest(plan)
    old = read_json_mapping(path)
    if old and old.get("sha256") != digest:
        raise LensError(f"{path}: declares another plan (primary {old.get('primary')}); a read into this folder "
                        "must keep it (choose a new --out to read with another plan)")
    plan = {**plan, "sha256": digest, "declared_at": old.get("declared_at") or plan.get("declared_at") or utc_now()}
    write_json(path, plan)
    return plan
