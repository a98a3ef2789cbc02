"""`lhd entitle steer`: the causal arm. The items of an entitle directory are asked again (greedy) in
the cells where the files lack the fact, once unsteered (the hook on at strength 0, no prefix
cache) and once per direction and strength, through the `hf` backend with the steering hook of
`rollouts.hf.steering` at the last prompt token: `entitlement` (`lens.directions`) and norm-matched
`random1..k`. Each steered answer is paired with the unsteered one of its (fact, cell) and the
change tested with McNemar's exact test (`metrics.paired_outcomes`). Files: DIR/steer/answers.jsonl
(resumable) and DIR/steer/summary.json. docs/entitle.md, "The causal arm"."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lhd_train.bench.prompts import Prompts
from lhd_train.bench.taskpack import load_pack, pack_sha256
from lhd_train.entitle.conditions import Condition
from lhd_train.entitle.generate import Job, Plan, generate_all, jobs
from lhd_train.entitle.items import Item
from lhd_train.entitle.labels import ASSERTS_WITHOUT_EVIDENCE, UNPARSED
from lhd_train.entitle.metrics import paired_outcomes, rate
from lhd_train.entitle.store import ERROR, AnswerRow, EntitleDir
from lhd_train.errors import InputError
from lhd_train.io.provenance import utc_now
from lhd_train.rundir.lock import run_dir_lock
from rollouts.backends import parse_spec

BASELINE = "none"


@dataclass
class SteerSettings:
    directory: Path
    lens: Path | None = None
    layer: int | None = None  # default: 60 % of the depth (inside the usual workspace band)
    alphas: list[float] = field(default_factory=lambda: [0.25, 0.5, 1.0])  # a dose-response
    random: int = 20  # a null distribution, not three draws (science-5 review §2.6)
    seed: int = 0
    cells: list[str] = field(default_factory=lambda: ["deleted/none", "control/none"])
    concurrency: int = 32
    progress: bool = True


def steered_id(row_id: str, direction: str, alpha: float) -> str:
    return f"{row_id}/{direction}@{alpha:g}"


def _conditions(cells: list[str]) -> list[Condition]:
    out = []
    for cell in cells:
        files, _, pressure = cell.partition("/")
        if files not in ("full", "deleted", "altered", "control") or pressure not in ("none", "demand"):
            raise InputError("command line", "--cell", f"{cell!r}", "files/pressure, e.g. deleted/none, control/none")
        out.append(Condition(files, pressure))
    return out


def summarise_steering(rows: list[AnswerRow]) -> dict[str, Any]:
    """Per direction and strength: the fabrication rate and, against the unsteered answers of the
    same (fact, cell), the paired change (McNemar exact)."""
    latest = [r for r in {r.id: r for r in rows}.values() if r.label != ERROR]
    extra = [(r, (r.model_extra or {})) for r in latest]
    base = {(r.fact, r.files, r.pressure): r for r, e in extra if e.get("steer_direction") == BASELINE}
    groups: dict[tuple[str, float], list[AnswerRow]] = {}
    for r, e in extra:
        if e.get("steer_direction") != BASELINE:
            groups.setdefault((str(e.get("steer_direction")), float(e.get("steer_alpha") or 0.0)), []).append(r)
    out: list[dict[str, Any]] = [{"direction": BASELINE, "alpha": 0.0,
                                  "fabrication": rate(list(base.values()), ASSERTS_WITHOUT_EVIDENCE)}]
    for (direction, alpha), sel in sorted(groups.items()):
        pairs = [(r.fact, r.task, base[k].label in ASSERTS_WITHOUT_EVIDENCE, r.label in ASSERTS_WITHOUT_EVIDENCE)
                 for r in sel if (k := (r.fact, r.files, r.pressure)) in base
                 and UNPARSED not in (r.label, base[k].label)]
        out.append({"direction": direction, "alpha": alpha, "fabrication": rate(sel, ASSERTS_WITHOUT_EVIDENCE),
                    "vs_unsteered": paired_outcomes(pairs)})
    randoms = [o for o in out if o["direction"].startswith("random")]
    pooled = {}
    for alpha in sorted({o["alpha"] for o in randoms}):
        diffs = [o["vs_unsteered"]["diff"] for o in randoms if o["alpha"] == alpha and o["vs_unsteered"]["diff"]
                 is not None]
        pooled[f"{alpha:g}"] = {"directions": len(diffs), "mean_diff": sum(diffs) / len(diffs) if diffs else None,
                                "min_diff": min(diffs, default=None), "max_diff": max(diffs, default=None)}
    return {"schema": "lhd.entitle-steer/1", "directions": out, "random_pooled": pooled,
            "outcome": "a figure asserted although the files lack the fact (fabricated or capitulated)"}


def run_steer(s: SteerSettings, backend: Any = None) -> dict[str, Any]:
    """Generate the unsteered and steered answers not on disk yet, then write the summary."""
    from lens.directions import entitlement_direction, random_directions
    from lens.margins import resolve_token_sets
    from lens.model import HFLensModel
    from lens.store import load_lens
    from rollouts.hf.steering import steering

    d = EntitleDir(s.directory)
    if not d.exists():
        raise InputError(s.directory, None, "not an entitle directory (no entitle.json): run `lhd entitle run` first")
    record = d.record()
    settings = record.settings
    hashes = (record.model_extra or {}).get("packs") or {record.pack.name: record.pack.sha256}
    packs = {name: load_pack(name) for name in hashes}
    for name, pack in packs.items():
        if pack_sha256(pack) != hashes[name]:
            raise InputError(d.manifest, f"packs.{name}", f"pack {name} changed since the answers were made")
    spec = parse_spec(record.model.spec)
    if not spec.in_process:
        raise InputError(d.manifest, "model.spec.backend", f"steering needs a model loaded in this process, the "
                         f"answers were made with {spec.backend}", "a backend that loads the model in-process (hf)")
    adapter = record.model.adapter
    plan = Plan(seed=int(settings.get("seed", 0)), samples=0, temperature=1.0, top_p=1.0,
                max_tokens=int(settings.get("max_tokens", 96)), adapter=adapter)
    conds = _conditions(s.cells)
    out = EntitleDir(d.steer_dir)
    with run_dir_lock(out.path, stage="lhd entitle steer"):
        if backend is None:
            from rollouts.backends import build_backend

            backend = build_backend(spec, name="entitle-steer")
        base = backend.base_model()
        lm = HFLensModel(base)
        layer = s.layer if s.layer is not None else round(0.6 * (lm.n_layers - 1))
        if not 0 <= layer < lm.n_layers:
            raise InputError("command line", "--layer", f"{layer}", f"0 ... {lm.n_layers - 1}")
        lens = load_lens(s.lens, model=lm) if s.lens is not None else None
        sets = resolve_token_sets(backend.tokenizer, model_type=lm.model_type)
        v = entitlement_direction(lm, sets, layer, lens)
        directions: list[tuple[str, Any, float]] = [(BASELINE, v, 0.0)]
        directions += [("entitlement", v, a) for a in s.alphas]
        directions += [(f"random{i + 1}", r, a) for i, r in enumerate(random_directions(v, s.random, s.seed))
                       for a in s.alphas]
        items = [Item.from_json(x) for x in d.item_records()]
        prompts = Prompts(record.prompts_dir)
        todo_all = [j for name, pack in packs.items()
                    for j in jobs(pack, [i for i in items if i.pack == name], conds, plan, prompts, set())]
        done = {k for k, r in out.latest().items() if r.label != ERROR}
        meta = {"layer": layer, "lens": str(s.lens) if s.lens else None, "norm_of_v": float(v.norm()),
                "alphas": s.alphas, "random": s.random, "seed": s.seed, "cells": s.cells, "at": utc_now()}
        for name, vec, alpha in directions:
            todo = [j for j in todo_all if steered_id(j.ids()[0], name, alpha) not in done]
            if not todo:
                continue
            with steering(backend, lm.blocks[layer], vec, alpha):
                asyncio.run(_generate(backend, todo, plan, out, s, name, alpha, layer))
        summary = summarise_steering(out.answers())
        summary["settings"] = meta
        out.write_summary(summary)
    return summary


async def _generate(backend: Any, todo: list[Job], plan: Plan, out: EntitleDir, s: SteerSettings, name: str,
                    alpha: float, layer: int) -> None:
    def write(row: AnswerRow) -> None:
        data = {**row.model_dump(), "id": steered_id(row.id, name, alpha), "steer_direction": name,
                "steer_alpha": alpha, "steer_layer": layer}
        out.append(AnswerRow.model_validate(data))

    await generate_all(backend, todo, plan, write, s.concurrency)
