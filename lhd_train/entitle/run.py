"""`lhd entitle run`: build the items, generate and label every answer, write the summary.

The directory is locked for the whole run (one writer). Its first run writes `entitle.json`
(settings, model, sampling, versions, the item report) and `items.jsonl` before any answer; a
rerun with the same --out checks that the settings, the items and the weights are the same (a
difference is refused: two experiments would mix in one file), generates only the answers not yet
written (and those that failed), and recomputes `summary.json` from `answers.jsonl`."""
from __future__ import annotations

import asyncio
import json
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lhd_train.bench.prompts import Prompts
from lhd_train.bench.taskpack import load_pack, pack_sha256
from lhd_train.entitle.conditions import conditions
from lhd_train.entitle.generate import Plan, generate_all, jobs
from lhd_train.entitle.items import build_items
from lhd_train.entitle.metrics import summarise
from lhd_train.entitle.settings import RESULT_FIELDS, EntitleRunCommand, resolve_target, with_adapter
from lhd_train.entitle.store import ERROR, EntitleDir
from lhd_train.errors import InputError
from lhd_train.io.files import json_text
from lhd_train.io.provenance import package_versions, python_version, utc_now
from lhd_train.rundir.lock import run_dir_lock
from lhd_train.rundir.outputs import check_out_dir
from rollouts.backend import Backend
from rollouts.model_files import changed_parts, weights_fingerprint

SCHEMA = "lhd.entitle/1"


@dataclass
class RunResult:
    out: Path
    items: int
    generated: int
    errors: int
    summary: dict[str, Any]


def _check_same(d: EntitleDir, old: dict[str, Any], now: dict[str, Any], weights: dict[str, Any]) -> None:
    """Refuse a rerun whose settings or weights differ from the directory's first run."""
    before = old.get("settings") or {}
    for key in RESULT_FIELDS:
        if before.get(key) != now["settings"].get(key):
            raise InputError(d.manifest, f"settings.{key}", f"this directory was made with {before.get(key)!r}, the "
                             f"command asks for {now['settings'].get(key)!r}; one directory holds one experiment",
                             "the same settings, or a new --out")
    for key, fp in weights.items():
        changed = changed_parts((old.get("weights") or {}).get(key), fp)
        if changed:
            raise InputError(d.manifest, f"weights.{key}", f"the {' and '.join(changed)} changed since the first "
                             "answers were made; choose a new --out")


def run_entitle(s: EntitleRunCommand, backend: Backend | None = None) -> RunResult:
    """Run (or resume) the experiment of `s` (module doc). `backend`: one already built (tests);
    otherwise built from MODEL_OR_CONFIG and closed at the end."""
    check_out_dir(s.out, what="entitle directory")
    target = resolve_target(s)
    pack = load_pack(target.pack)
    items, report = build_items(pack, s.facts or 20, s.seed, s.per_task)
    if not items:
        raise InputError("command line", "--pack", f"pack {pack.name}: no fact could be used "
                         f"({report.to_json()['dropped']})", "a pack with CSV rows or 'Key: number' lines")
    spec = with_adapter(target.spec, target.adapter)
    weights = {k: fp for k, fp in (("model", weights_fingerprint(spec.model)),
                                   ("adapter", weights_fingerprint(target.adapter))) if fp}
    d = EntitleDir(s.out)
    plan = Plan(seed=s.seed, samples=s.samples, temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens,
                max_attempts=s.max_attempts, adapter=target.adapter)
    conds = conditions(s.control)
    with run_dir_lock(d.path, stage="lhd entitle run"):
        record: dict[str, Any] = {
            "schema": SCHEMA, "settings": s.model_dump(mode="json"), "pack": {"name": pack.name,
                                                                             "sha256": pack_sha256(pack)},
            "items": report.to_json(), "conditions": [c.key for c in conds],
            "sampling": {"greedy": plan.greedy(None).to_dict(), "sampled": plan.sampled(None).to_dict()
                         if s.samples else None},
            "model": {"spec": spec.model_dump(mode="json"), "adapter": target.adapter}, "weights": weights,
            "run_config": target.config, "prompts": target.prompts_dir or "built-in",
            "packages": package_versions(), "python": python_version(), "host": platform.node(),
            "created_at": utc_now(),
        }
        if d.exists():
            old = d.read_manifest()
            _check_same(d, old, record, weights)
            if d.item_records() != [json.loads(json_text(i.to_json())) for i in items]:
                raise InputError(d.items_path, None, "the items built now differ from the ones on disk (the pack "
                                 "changed?); choose a new --out")
            session: dict[str, Any] = {"at": utc_now(), "host": platform.node(), "packages": package_versions()}
            record = {**old, "resumes": [*(old.get("resumes") or []), session]}
        else:
            d.write_items([i.to_json() for i in items])
        done = {k for k, r in d.latest().items() if r.label != ERROR}
        todo = jobs(pack, items, conds, plan, Prompts(target.prompts_dir), done)
        built = backend is None
        errors = 0
        if todo:
            if backend is None:
                from rollouts.backends import build_backend

                backend = build_backend(spec, name="entitle", log_dir=str(d.path / "logs"))
            record["backend"] = backend.describe()
            d.write_manifest(record)
            errors = asyncio.run(_generate(backend, todo, plan, d, s, close=built))
        elif not d.exists():
            d.write_manifest(record)
        summary = summarise(d.latest().values())
        summary["items"] = report.to_json()
        d.write_summary(summary)
    return RunResult(d.path, len(items), sum(len(j.samples) for j in todo), errors, summary)


async def _generate(backend: Backend, todo: list[Any], plan: Plan, d: EntitleDir, s: EntitleRunCommand,
                    close: bool) -> int:
    from tqdm.auto import tqdm

    bar = tqdm(total=sum(len(j.samples) for j in todo), desc="answers", unit="answer", disable=not s.progress,
               dynamic_ncols=True)
    try:
        return await generate_all(backend, todo, plan, d.append, s.concurrency, bar.update)
    finally:
        bar.close()
        if close:
            await backend.aclose()
