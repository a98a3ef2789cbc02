"""`lhd entitle run`: build the items, generate and label every answer as a round of the
experiment's run directory (`entitle.store`), write the ground truth and the summary.

The directory is locked for the whole run (one writer). Its first run writes `entitle.json`
(settings, model, sampling, versions, the item report), `items.jsonl` and the run's manifest
before any answer; a rerun with the same --out checks that the settings, the items and the weights
are the same (a difference is refused: two experiments would mix in one directory), generates only
the answers not yet stored (those of failed requests among them), and recounts
`ground_truth.jsonl` and `entitle_summary.json` from the trials."""
from __future__ import annotations

import asyncio
import json
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lhd_train.bench.prompts import Prompts
from lhd_train.bench.taskpack import TaskPack, load_pack, pack_sha256
from lhd_train.entitle.conditions import conditions
from lhd_train.entitle.generate import Plan, generate_all, jobs
from lhd_train.entitle.items import BuildReport, Item, build_items
from lhd_train.entitle.metrics import summarise
from lhd_train.entitle.settings import RESULT_FIELDS, EntitleRunCommand, pack_names, resolve_target, with_adapter
from lhd_train.entitle.store import EntitleDir, trial_id_of
from lhd_train.entitle.truth import write_truth
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


def build_all_items(packs: list[TaskPack], facts: int, seed: int,
                    per_task: int | None) -> tuple[list[Item], dict[str, Any]]:
    """`facts` items spread evenly over `packs` (a pack with fewer usable facts gives what it has
    and the others share the rest), and each pack's build report."""
    if len(packs) == 1:
        one, report = build_items(packs[0], facts, seed, per_task)
        return one, report.to_json()
    room = {p.name: len(build_items(p, facts, seed, per_task)[0]) for p in packs}
    shares = dict.fromkeys(room, 0)
    left = facts
    while left and any(shares[n] < room[n] for n in room):
        for name in room:  # one fact per pack per pass, in pack order
            if left and shares[name] < room[name]:
                shares[name] += 1
                left -= 1
    items: list[Item] = []
    reports: dict[str, Any] = {}
    for pack in packs:
        got, report = build_items(pack, shares[pack.name], seed, per_task) if shares[pack.name] else ([], BuildReport())
        items += got
        reports[pack.name] = report.to_json()
    return items, reports


def planned_ids(items: list[Item], conds: list[Any], samples: int) -> list[str]:
    """Every answer id the settings ask for, in plan order (the control question only where the
    item has a control fact)."""
    from lhd_train.entitle.store import answer_id

    return [answer_id(i.fact_id, c.files, c.pressure, k) for i in items for c in conds
            if not (c.files == "control" and i.control is None) for k in range(samples + 1)]


def run_entitle(s: EntitleRunCommand, backend: Backend | None = None) -> RunResult:
    """Run (or resume) the experiment of `s` (module doc). `backend`: one already built (tests);
    otherwise built from MODEL_OR_CONFIG and closed at the end."""
    if not EntitleDir(s.out).exists():  # a resume's --out is the experiment's own run directory
        check_out_dir(s.out, what="entitle experiment")
    target = resolve_target(s)
    packs = [load_pack(name) for name in pack_names(target.pack)]
    items, report = build_all_items(packs, s.facts or 20, s.seed, s.per_task)
    if not items:
        raise InputError("command line", "--pack", f"{target.pack}: no fact could be used ({report})",
                         "a pack with CSV rows or 'Key: number' lines")
    spec = with_adapter(target.spec, target.adapter)
    weights = {k: fp for k, fp in (("model", weights_fingerprint(spec.model)),
                                   ("adapter", weights_fingerprint(target.adapter))) if fp}
    d = EntitleDir(s.out)
    plan = Plan(seed=s.seed, samples=s.samples, temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens,
                max_attempts=s.max_attempts, adapter=target.adapter)
    conds = conditions(s.control)
    by_name = {p.name: p for p in packs}
    with run_dir_lock(d.path, stage="lhd entitle run"):
        record: dict[str, Any] = {
            "schema": SCHEMA, "settings": s.model_dump(mode="json"),
            "pack": {"name": ",".join(by_name), "sha256": pack_sha256(packs[0]) if len(packs) == 1 else None},
            "packs": {p.name: pack_sha256(p) for p in packs},
            "items": report, "conditions": [c.key for c in conds],
            "sampling": {"greedy": plan.greedy(None).to_dict(), "sampled": plan.sampled(None).to_dict()
                         if s.samples else None},
            "model": {"spec": spec.model_dump(mode="json"), "adapter": target.adapter}, "weights": weights,
            "run_config": target.config, "prompts": target.prompts_dir or "built-in",
            "packages": package_versions(), "python": python_version(), "host": platform.node(),
            "created_at": utc_now(),
        }
        planned = planned_ids(items, conds, s.samples)
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
            d.write_run_manifest([trial_id_of(a) for a in planned], list(by_name), record["created_at"])
        done = d.answered()
        prompts = Prompts(target.prompts_dir)
        todo = [j for name, pack in by_name.items()
                for j in jobs(pack, [i for i in items if i.pack == name], conds, plan, prompts, done)]
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
        summary = finish(d, planned)
    return RunResult(d.path, len(items), sum(len(j.samples) - len(j.done) for j in todo), errors, summary)


def finish(d: EntitleDir, planned: list[str] | None = None) -> dict[str, Any]:
    """Recount the ground truth and the summary from the stored answers (the caller holds the
    lock); `planned`: every answer id the settings ask for (default: the plan rebuilt from
    entitle.json's items and settings), so the missing ones are counted."""
    rows = list(d.latest().values())
    if planned is None:
        planned = planned_of(d)
    write_truth(d, rows)
    summary = summarise(rows, planned=planned)
    summary["items"] = (d.record().model_extra or {}).get("items")
    d.write_summary(summary)
    return summary


def planned_of(d: EntitleDir) -> list[str]:
    """The answer ids `d`'s settings ask for, from its items.jsonl and entitle.json."""
    settings = d.record().settings
    items = [Item.from_json(i) for i in d.item_records()]
    return planned_ids(items, conditions(bool(settings.get("control", True))), int(settings.get("samples") or 0))


async def _generate(backend: Backend, todo: list[Any], plan: Plan, d: EntitleDir, s: EntitleRunCommand,
                    close: bool) -> int:
    from tqdm.auto import tqdm

    bar = tqdm(total=sum(len(j.samples) for j in todo), desc="answers", unit="answer", disable=not s.progress,
               dynamic_ncols=True)
    try:
        return await generate_all(backend, todo, plan, lambda row: d.append(row, s.seed, s.top_p),
                                   s.concurrency, bar.update)
    finally:
        bar.close()
        if close:
            await backend.aclose()
