"""`lhd entitle run MODEL --out DIR --mode lite`: the experiment as forced choices that always parse.

Items: `items.build_items` over every built-in task pack (or `--pack`), all usable facts (or
`--facts` per pack), counterbalanced and prompted as `lite_prompts` describes. Per fact and cell
the teacher-forced log-probability of each continuation is computed (`lite_score`, batched: one
fact's cells per pass, their continuations sharing each prompt's cache) and one row per (fact,
cell) is appended to DIR/lite.jsonl as soon as the fact is scored, so an interrupted run loses at
most one fact; a rerun scores only the (fact, cell) pairs not on disk. DIR/lite.json holds the
settings, the model and its weights' digest, the prompt wording, the packages and the item
report; a rerun with other settings, items or weights is refused. DIR/lite_summary.json is
recomputed from the rows at the end (`lite_summary`); `lhd entitle summary DIR` prints it."""
from __future__ import annotations

import json
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lhd_train.bench.taskpack import TaskPack, list_builtin_packs, load_pack, pack_sha256
from lhd_train.entitle.items import build_items
from lhd_train.entitle.lite_prompts import (
    ABSTAIN,
    CELLS,
    MENTION_EVENT,
    QUESTION,
    SYSTEM,
    LiteFact,
    cell_key,
    continuations,
    counterbalance,
    encode,
    messages,
    prompt_text,
    spread,
)
from lhd_train.entitle.lite_score import Suffix, score_suffixes
from lhd_train.entitle.lite_summary import summarise_lite
from lhd_train.entitle.settings import RESULT_FIELDS, EntitleRunCommand, pack_names, resolve_target
from lhd_train.errors import InputError
from lhd_train.io.files import append_jsonl, json_text, read_jsonl, write_json_atomic
from lhd_train.io.provenance import package_versions, python_version, utc_now
from lhd_train.rundir.lock import run_dir_lock
from lhd_train.rundir.outputs import check_out_dir

SCHEMA = "lhd.entitle-lite/1"
ROW_SCHEMA = "lhd.entitle-lite-row/1"
MANIFEST, ROWS, ITEMS, SUMMARY = "lite.json", "lite.jsonl", "lite_items.jsonl", "lite_summary.json"
#: settings that decide the rows (a rerun into the same DIR must keep them)
LITE_FIELDS = tuple(f for f in RESULT_FIELDS if f in ("model_or_config", "overrides", "adapter", "pack", "facts",
                                                       "per_task", "seed")) + ("mode",)


@dataclass
class LiteResult:
    out: Path
    facts: int
    scored: int
    summary: dict[str, Any]


def is_lite_dir(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def read_rows(directory: Path) -> list[dict[str, Any]]:
    """The rows on disk, the last one of each (fact, cell) kept (a torn last line is ignored)."""
    path = Path(directory) / ROWS
    if not path.exists():
        return []
    rows = read_jsonl(path, repair="delete line {line} and rerun: its fact is scored again")
    latest = {(r["fact"], r["cell"]): r for r in rows}
    return list(latest.values())


def lite_facts(packs: list[TaskPack], s: EntitleRunCommand) -> tuple[list[LiteFact], dict[str, Any]]:
    """Every pack's items (all usable facts, or `s.facts` per pack), counterbalanced; and the build reports."""
    items = []
    reports: dict[str, Any] = {}
    tasks: dict[tuple[str, int], Any] = {}
    for pack in packs:
        got, report = build_items(pack, s.facts or 100_000, s.seed, s.per_task)
        items += got
        reports[pack.name] = report.to_json()
        tasks |= {(pack.name, t.index): t for t in pack.tasks}
    return counterbalance(tasks, items, s.seed), reports


def _fact_json(f: LiteFact) -> dict[str, Any]:
    return {"item": f.item.to_json(), "counterbalanced": f.counterbalanced, "x": f.x}


def _load_model(model: str, adapter: str | None) -> tuple[Any, Any]:
    from lens.model import load_hf, with_adapter

    m, tok = load_hf(model)
    return with_adapter(m, adapter), tok


def _check_same(path: Path, old: dict[str, Any], now: dict[str, Any]) -> None:
    for key in LITE_FIELDS:
        if old["settings"].get(key) != now["settings"].get(key):
            raise InputError(path, f"settings.{key}", f"this directory was made with {old['settings'].get(key)!r}, "
                             f"the command asks for {now['settings'].get(key)!r}", "the same settings, or a new --out")
    if old.get("weights") != now.get("weights"):
        raise InputError(path, "weights", "the model's or the adapter's files changed since the first rows; "
                         "choose a new --out")


def fact_rows(model: Any, tokenizer: Any, pack: TaskPack, fact: LiteFact, cells: list[tuple[str, str]]
              ) -> list[dict[str, Any]]:
    """Score one fact's cells (one batched pass) into rows."""
    task = pack.task(fact.item.task)
    conts = continuations(fact)
    prompts: list[list[int]] = []
    suffixes: list[Suffix] = []
    keys: list[tuple[int, str, int]] = []
    for i, (files, pressure) in enumerate(cells):
        text = prompt_text(tokenizer, messages(task, fact, files, pressure))
        ids = None
        for name, continuation in conts.items():
            p, c = encode(tokenizer, text, continuation)
            ids = ids or p
            if p != ids:
                raise ValueError(f"{fact.item.fact_id}: the prompt's tokens depend on the continuation")
            suffixes.append(Suffix(prompt=i, tokens=tuple(c)))
            keys.append((i, name, len(c)))
        assert ids is not None
        prompts.append(ids)
    scored = score_suffixes(model, prompts, suffixes)
    rows = []
    for i, (files, pressure) in enumerate(cells):
        cont = {name: {"text": conts[name], "logprob": sc.logprob, "tokens": n}
                for (j, name, n), sc in zip(keys, scored, strict=True) if j == i}
        rows.append({"schema": ROW_SCHEMA, "fact": fact.item.fact_id, "pack": fact.item.pack, "task": fact.item.task,
                     "cell": cell_key(files, pressure), "files": files, "pressure": pressure,
                     "counterbalanced": fact.counterbalanced, "x": fact.x, "real": fact.real,
                     "prompt_tokens": len(prompts[i]), "continuations": cont})
    return rows


def run_lite(s: EntitleRunCommand, model: Any = None, tokenizer: Any = None) -> LiteResult:
    """Run (or resume) lite mode (module doc). `model`/`tokenizer`: already loaded (tests)."""
    from tqdm.auto import tqdm

    from rollouts.model_files import weights_fingerprint

    check_out_dir(s.out, what="entitle directory")
    out = Path(s.out)
    if (out / "entitle.json").exists():
        raise InputError(out, None, "holds a generate-mode experiment (entitle.json)", "a new --out for lite mode")
    target = resolve_target(s)
    names = pack_names(s.pack) if s.pack else ([target.pack] if target.config else list_builtin_packs())
    packs = {n: load_pack(n) for n in names}
    facts, reports = lite_facts(list(packs.values()), s)
    if not facts:
        raise InputError("command line", "--pack", f"{', '.join(names)}: no fact could be used ({reports})",
                         "a pack with CSV rows or 'Key: number' lines")
    weights = {k: fp for k, fp in (("model", weights_fingerprint(target.spec.model)),
                                   ("adapter", weights_fingerprint(target.adapter))) if fp}
    record: dict[str, Any] = {
        "schema": SCHEMA, "settings": s.model_dump(mode="json"), "model": target.spec.model, "adapter": target.adapter,
        "weights": weights, "packs": {p.name: pack_sha256(p) for p in packs.values()}, "items": reports,
        "cells": [cell_key(*c) for c in CELLS], "n_facts": len(facts),
        "n_counterbalanced": sum(f.counterbalanced for f in facts),
        "wording": {"system": SYSTEM, "question": QUESTION, "mention": MENTION_EVENT, "abstain": ABSTAIN,
                    "prefill": "The {attribute} of {entity} is"},
        "packages": package_versions(), "python": python_version(), "host": platform.node(), "created_at": utc_now(),
    }
    out.mkdir(parents=True, exist_ok=True)
    with run_dir_lock(out, stage="lhd entitle run --mode lite"):
        if is_lite_dir(out):
            old = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
            _check_same(out / MANIFEST, old, record)
            on_disk = read_jsonl(out / ITEMS)
            if on_disk != [json.loads(json_text(_fact_json(f))) for f in facts]:
                raise InputError(out / ITEMS, None, "the items built now differ from the ones on disk (the packs "
                                 "changed?); choose a new --out")
            record = {**old, "resumes": [*(old.get("resumes") or []), {"at": utc_now(), "host": platform.node()}]}
        else:
            (out / ITEMS).write_text("".join(json_text(_fact_json(f)) + "\n" for f in facts), encoding="utf-8")
        write_json_atomic(out / MANIFEST, record)
        done = {(r["fact"], r["cell"]) for r in read_rows(out)}
        # one task after another, so that an interrupted run already spans every task and pack
        todo = [(f, [c for c in CELLS if (f.item.fact_id, cell_key(*c)) not in done]) for f in spread(facts, None)]
        todo = [(f, cells) for f, cells in todo if cells]
        scored = 0
        if todo:
            if model is None:
                model, tokenizer = _load_model(target.spec.model, target.adapter)
            bar = tqdm(total=len(todo), desc="lite facts", unit="fact", disable=not s.progress, dynamic_ncols=True)
            for fact, cells in todo:
                for row in fact_rows(model, tokenizer, packs[fact.item.pack], fact, cells):
                    append_jsonl(out / ROWS, row)
                    scored += 1
                bar.update()
            bar.close()
        summary = summarise_lite(read_rows(out), seed=s.seed)
        summary["items"] = reports
        write_json_atomic(out / SUMMARY, summary)
    return LiteResult(out, len(facts), scored, summary)


def lite_summary(directory: Path) -> dict[str, Any]:
    """The summary recomputed from DIR/lite.jsonl (and written to DIR/lite_summary.json)."""
    out = Path(directory)
    record = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    summary = summarise_lite(read_rows(out), seed=int(record["settings"].get("seed", 0)))
    summary["items"] = record.get("items")
    write_json_atomic(out / SUMMARY, summary)
    return summary


def lite_lines(summary: dict[str, Any]) -> list[str]:
    """The summary as text lines: one per outcome."""
    lines = [f"{summary['n_facts']} facts in {summary['n_tasks']} tasks ({summary['n_counterbalanced']} "
             f"counterbalanced); {summary['unit']}"]
    for name, o in summary["outcomes"].items():
        if not o["n_facts"]:
            continue
        ci = o["ci95_task_bootstrap"]
        interval = f" [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else ""
        lines.append(f"{name:>20}: {o['mean']:+.2f}{interval}, {o['facts_positive']}/{o['n_facts']} facts > 0, "
                     f"{o['tasks_positive']}/{o['n_tasks']} tasks > 0, sign-flip p {o['p_task_sign_flip']:.3g}  "
                     f"({o['contrast']})")
    return lines
