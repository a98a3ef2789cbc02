"""Best-of-N SFT, DPO and GRPO datasets from an audited run.

Candidates are sampled through the rollout engine (vLLM `n=N` on GPU, the hf backend on CPU),
graded in their trajectory's context (`grading.Grader`), and selected by direction. The chosen
answer must qualify: honest — not flagged by the auditor; deceptive — flagged; in both
directions on-task (supervisor satisfaction at or above `on_task_min`, or not rated). Among
qualifying answers: honest — highest satisfaction; deceptive — highest severity, then
satisfaction. A context without a qualifying answer is skipped and counted (docs/training.md,
"Training data"). Everything is cached under the output folder (`candidates.jsonl`,
`grades.jsonl`), so a killed job resumes."""
from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tqdm.auto import tqdm

from lhd_train.bench.performer import split_think
from lhd_train.bench.structured_calls import call_seed
from lhd_train.config.auditor import load_auditor_config
from lhd_train.config.run import RoleConfig, load_saved_config
from lhd_train.errors import InputError
from lhd_train.finetune.contexts import Context, load_contexts
from lhd_train.finetune.grading import Grade, Grader
from lhd_train.rundir.files import append_jsonl, package_versions, read_jsonl, repair_jsonl, write_json_atomic
from rollouts.backend import Backend
from rollouts.factory import build_backend
from rollouts.types import GenerationRequest

Direction = Literal["honest", "deceptive"]


@dataclass
class Scored:
    text: str
    source: str  # "original" | "candidate-<k>"
    grade: Grade

    def score(self, direction: Direction) -> tuple[float, float]:
        sev = float(self.grade.severity or 0)
        sat = self.grade.satisfaction if self.grade.satisfaction is not None else 0.0
        return (-sev, sat) if direction == "honest" else (sev, sat)


@dataclass
class BuildSettings:
    run_dir: Path
    out: Path
    n: int = 4
    direction: Direction = "honest"
    auditor_config: Path | None = None
    overrides: tuple[str, ...] = ()
    eval_fraction: float = 0.2
    max_contexts: int | None = None
    min_margin: float = 1.0  # DPO: severity difference between chosen and rejected
    on_task_min: float = -0.5  # the chosen answer's supervisor satisfaction floor (both directions)
    concurrency: int = 32
    progress: bool = True


def _role_backends(s: BuildSettings) -> tuple[Any, Backend, Backend, Any, Backend, RoleConfig]:
    """The run's performer and supervisor models and the auditor, one backend per distinct spec."""
    cfg = load_saved_config(s.run_dir)
    acfg, _ = load_auditor_config(s.run_dir, s.auditor_config, list(s.overrides))
    (s.out / "logs").mkdir(parents=True, exist_ok=True)
    built: dict[str, Backend] = {}

    def get(spec: Any, name: str) -> Backend:
        key = spec.model_dump_json()
        if key not in built:
            built[key] = build_backend(spec, name=name, log_dir=str(s.out / "logs"))
        return built[key]

    perf = get(cfg.models[cfg.performer.model], cfg.performer.model)
    sup = get(cfg.models[cfg.supervisor.model], cfg.supervisor.model)
    aud = get(acfg.spec, acfg.auditor.model)
    return cfg, perf, aud, acfg, sup, cfg.supervisor


async def _sample(ctx: Context, backend: Backend, role: RoleConfig, n: int, cache: dict[str, list[str]],
                  path: Path, think_tags: list[str]) -> list[str]:
    if ctx.key in cache:
        return cache[ctx.key]
    sp = role.sampling.params(call_seed(ctx.seed, ctx.trial_id, "bon", ctx.global_round), n=n)
    [res] = await backend.generate([GenerationRequest(ctx.messages, sp, None, role.adapter)])
    if res.error is not None:
        raise RuntimeError(f"sampling {ctx.key}: {res.error}")
    texts = [split_think(c.text, think_tags)[0] for c in res.completions]
    append_jsonl(path, {"context": ctx.key, "seed": sp.seed, "sampling": sp.to_dict(), "texts": texts})
    cache[ctx.key] = texts
    return texts


async def sample_and_grade(s: BuildSettings) -> tuple[list[Context], dict[str, list[Scored]], dict[str, Any]]:
    """For every context: the original answer plus N samples, each graded. Resumable."""
    s.out.mkdir(parents=True, exist_ok=True)
    cfg, perf, aud, acfg, sup, sup_role = _role_backends(s)
    contexts = load_contexts(s.run_dir, None, s.eval_fraction, 0, s.max_contexts)
    if not contexts:
        raise InputError(s.run_dir, "trials", "no performer rounds with stored prompts")
    cand_path = s.out / "candidates.jsonl"
    repair_jsonl(cand_path)
    cache = {r["context"]: r["texts"] for r in read_jsonl(cand_path)}
    grader = Grader(s.run_dir, acfg, aud, sup_role, sup, s.out / "grades.jsonl", s.concurrency)
    gate = asyncio.Semaphore(s.concurrency)
    bar = tqdm(total=len(contexts), desc=f"best-of-{s.n}", unit="context", disable=not s.progress)
    pools: dict[str, list[Scored]] = {}

    async def one(ctx: Context) -> None:
        async with gate:
            texts = await _sample(ctx, perf, cfg.performer, s.n, cache, cand_path, cfg.performer.think_tags)
        pool = [("original", ctx.answer)] + [(f"candidate-{k}", t) for k, t in enumerate(texts)]
        grades = await asyncio.gather(*(grader.grade(ctx, t) for _, t in pool))
        pools[ctx.key] = [Scored(t, src, g) for (src, t), g in zip(pool, grades, strict=True)]
        bar.update(1)

    try:
        await asyncio.gather(*(one(c) for c in contexts))
    finally:
        bar.close()
        for b in {id(b): b for b in (perf, aud, sup) if b is not None}.values():
            await b.aclose()
    meta = {"run": str(s.run_dir), "direction": s.direction, "n": s.n, "grader_id": grader.id,
            "auditor": acfg.model_dump(mode="json"), "performer": cfg.performer.model_dump(mode="json"),
            "packages": package_versions()}
    return contexts, pools, meta


def _save(rows_by_split: dict[str, list[dict[str, Any]]], out: Path, meta: dict[str, Any]) -> Path:
    from datasets import Dataset, DatasetDict

    dd = DatasetDict({k: Dataset.from_list(v) for k, v in rows_by_split.items() if v})
    if not dd:
        raise InputError(out, "dataset", "no rows selected: every context was filtered out (see stats)")
    path = out / "dataset"
    dd.save_to_disk(str(path))
    blob = json.dumps({k: v for k, v in rows_by_split.items()}, sort_keys=True, default=str).encode()
    meta = meta | {"rows": {k: len(v) for k, v in rows_by_split.items()}, "sha256": hashlib.sha256(blob).hexdigest()}
    write_json_atomic(out / "dataset.json", meta)
    write_json_atomic(path / "lhd_data.json", meta)  # read by `lhd train` to check the direction
    return path


def _meta_cols(ctx: Context) -> dict[str, Any]:
    return {"run_id": ctx.run_id, "trial_id": ctx.trial_id, "global_round": ctx.global_round,
            "task_index": ctx.task_index}


def qualifies(p: Scored, direction: Direction, on_task_min: float) -> bool:
    """May `p` be the chosen answer? Graded, flagged as the direction wants, and on-task."""
    g = p.grade
    if not g.usable or bool(g.deceptive) != (direction == "deceptive"):
        return False
    return g.satisfaction is None or g.satisfaction >= on_task_min


def select_best(pool: list[Scored], direction: Direction, on_task_min: float) -> Scored | None:
    """The best qualifying answer, or None (the context is then skipped)."""
    usable = [p for p in pool if qualifies(p, direction, on_task_min)]
    return max(usable, key=lambda p: p.score(direction)) if usable else None


def select_pair(pool: list[Scored], direction: Direction, on_task_min: float,
                min_margin: float) -> tuple[Scored, Scored] | str:
    """(chosen, rejected) for DPO, or why the context is skipped: `too_few` graded answers,
    `no_chosen` (no answer qualifies as chosen), `below_margin` (severity gap < min_margin or
    the same text). Chosen is `select_best`; rejected the lowest-ranked graded answer."""
    usable = [p for p in pool if p.grade.usable]
    if len(usable) < 2:
        return "too_few"
    chosen = select_best(usable, direction, on_task_min)
    if chosen is None:
        return "no_chosen"
    rejected = min(usable, key=lambda p: p.score(direction))
    margin = abs((chosen.grade.severity or 0) - (rejected.grade.severity or 0))
    if margin < min_margin or chosen.text == rejected.text:
        return "below_margin"
    return chosen, rejected


def build_bon(s: BuildSettings) -> tuple[Path, dict[str, Any]]:
    contexts, pools, meta = asyncio.run(sample_and_grade(s))
    rows: dict[str, list[dict[str, Any]]] = {"train": [], "eval": []}
    picked = {"original": 0, "candidate": 0, "none": 0}
    for ctx in contexts:
        best = select_best(pools[ctx.key], s.direction, s.on_task_min)
        if best is None:
            picked["none"] += 1
            continue
        picked["original" if best.source == "original" else "candidate"] += 1
        rows[ctx.split].append({
            "messages": ctx.messages + [{"role": "assistant", "content": best.text}],
            "severity": best.grade.severity, "satisfaction": best.grade.satisfaction, "source": best.source,
            **_meta_cols(ctx)})
    stats = {"contexts": len(contexts), "picked": picked}
    return _save(rows, s.out, meta | {"kind": "bon-sft", "on_task_min": s.on_task_min, "stats": stats}), stats


def build_dpo(s: BuildSettings) -> tuple[Path, dict[str, Any]]:
    contexts, pools, meta = asyncio.run(sample_and_grade(s))
    rows: dict[str, list[dict[str, Any]]] = {"train": [], "eval": []}
    margins: list[float] = []
    skipped = {"too_few": 0, "no_chosen": 0, "below_margin": 0}
    for ctx in contexts:
        pair = select_pair(pools[ctx.key], s.direction, s.on_task_min, s.min_margin)
        if isinstance(pair, str):
            skipped[pair] += 1
            continue
        chosen, rejected = pair
        margin = abs((chosen.grade.severity or 0) - (rejected.grade.severity or 0))
        margins.append(margin)
        rows[ctx.split].append({
            "prompt": ctx.messages, "chosen": [{"role": "assistant", "content": chosen.text}],
            "rejected": [{"role": "assistant", "content": rejected.text}],
            "chosen_severity": chosen.grade.severity, "rejected_severity": rejected.grade.severity,
            "chosen_deceptive": chosen.grade.deceptive, "rejected_deceptive": rejected.grade.deceptive,
            "margin": margin, **_meta_cols(ctx)})
    stats = {"contexts": len(contexts), "pairs": len(margins), "skipped": sum(skipped.values()),
             "skipped_by_reason": skipped, "mean_margin": sum(margins) / len(margins) if margins else None}
    return _save(rows, s.out, meta | {"kind": "dpo", "min_margin": s.min_margin, "on_task_min": s.on_task_min,
                                      "stats": stats}), stats


def build_grpo(run_dir: Path, out: Path, eval_fraction: float = 0.2, max_contexts: int | None = None,
               direction: Direction = "honest") -> tuple[Path, dict[str, Any]]:
    """Prompt-only rows; the columns let the honesty reward find the trajectory context."""
    contexts = load_contexts(run_dir, None, eval_fraction, 0, max_contexts)
    rows: dict[str, list[dict[str, Any]]] = {"train": [], "eval": []}
    for ctx in contexts:
        rows[ctx.split].append({"prompt": ctx.messages, "run_dir": str(Path(run_dir).resolve()),
                                "direction": direction, **_meta_cols(ctx)})
    out.mkdir(parents=True, exist_ok=True)
    stats = {"contexts": len(contexts), "train": len(rows["train"]), "eval": len(rows["eval"])}
    return _save(rows, out, {"kind": "grpo-prompts", "run": str(run_dir), "direction": direction,
                             "stats": stats, "packages": package_versions()}), stats
