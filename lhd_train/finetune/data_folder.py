"""A dataset folder (`lhd data ... --out DIR`) holds the work of one setting only.

`candidates.jsonl` and `grades.jsonl` are caches a rerun resumes from, so a rerun with other
settings (`--n 3` into a folder made with `--n 2`, another run or auditor config) would mix the
two: it would keep the old candidates and record the new settings (issue 22). The first build
writes `settings.json`; a later one with different settings is refused, naming the field."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lhd_train.errors import InputError
from lhd_train.io.files import read_json_mapping, read_jsonl, write_json_atomic

SETTINGS_FILE = "settings.json"


def _norm(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def claim_folder(out: Path, settings: dict[str, Any]) -> None:
    """Record `settings` in a new folder, or check them against the folder's own. Refuses a
    difference in one line naming the field; a folder whose candidates were sampled with another
    `n` (made before settings.json existed) is refused too."""
    out = Path(out)
    path = out / SETTINGS_FILE
    settings = _norm(settings)
    if path.is_file():
        before = read_json_mapping(path)
        for key in sorted(set(before) | set(settings)):
            if before.get(key) != settings.get(key):
                raise InputError(path, key, f"this dataset folder was made with {key}={json.dumps(before.get(key))}, "
                                 f"now {key}={json.dumps(settings.get(key))}; its cached candidates and grades "
                                 "would mix the two: use another --out, or the same settings")
        return
    n = settings.get("n")
    cand = out / "candidates.jsonl"
    if n is not None and cand.is_file():
        sizes = {len(r.get("texts") or []) for r in read_jsonl(cand)}
        if sizes - {n}:
            raise InputError(cand, "n", f"this dataset folder holds candidates sampled with n={max(sizes - {n})}, "
                             f"now n={n}: use another --out, or the same --n")
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, settings)
