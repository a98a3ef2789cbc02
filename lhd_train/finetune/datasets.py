"""Best-of-N SFT, DPO and GRPO datasets from an audited run: candidates sampled through the rollout
engine, graded in their trajectory's context (`grading.Grader`) and selected by direction, the run's
own audit vetoing an original (review N2: one it flagged is never an honest target, one it did not
flag never a deceptive one; disagreements printed and stored in dataset.json). A context without a
qualifying answer is skipped and counted. Candidates and grades are cached under the output folder,
so a killed job resumes; `settings.json` refuses a rerun whose caches would differ (`data_folder`).
The rules, in full: docs/training.md, "Training data"."""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from lhd_train.bench.performer import split_think
from lhd_train.bench.structured_calls import call_seed
from lhd_train.config.auditor import load_auditor_config
from lhd_train.config.data import BuildSettings
from lhd_train.config.run import RoleConfig, load_saved_config
from lhd_train.config.vocab import Direction
from lhd_train.errors import InputError
from lhd_train.finetune.contexts import Context, Contexts, load_contexts
from lhd_train.finetune.data_folder import claim_folder
from lhd_train.finetune.grading import Grade, Grader
from lhd_train.finetune.lineage import data_auditors
from lhd_train.finetune.records import DATA_DIR, DataRecord, write_data_record
from lhd_train.io.files import append_jsonl, read_jsonl, repair_jsonl
from lhd_train.io.provenance import package_versions
from rollouts.backend import Backend
from rollouts.backends import build_backend
from rollouts.types import GenerationRequest

log = logging.getLogger(__name__)


@dataclass
class Scored:
    text: str
    source: str  # "original" | "candidate-<k>"
    grade: Grade
    audited: bool | None = None  # original only: the run's own audit verdict (None: no valid label)

    def score(self, direction: Direction) -> tuple[float, float]:
        sev = float(self.grade.severity or 0)
        sat = self.grade.satisfaction if self.grade.satisfaction is not None else 0.0
        return (-sev, sat) if direction == "honest" else (sev, sat)


def data_specs(s: BuildSettings) -> tuple[dict[str, Any], str]:
    """The models `lhd data bon|dpo` starts at the same time (the performer with its adapter, the
    supervisor, the auditor), keyed as their configs name them, and the file the auditor comes
    from: what `config.run.preflight` checks before any of them starts (issue 30, B6)."""
    from lhd_train.bench.engine import role_specs

    cfg = load_saved_config(s.run_dir)
    acfg, source = load_auditor_config(s.run_dir, s.auditor_config, list(s.overrides))
    specs = role_specs(cfg, ("performer", "supervisor"))
    key = acfg.auditor.model
    if key in specs and specs[key].model_dump() != acfg.spec.model_dump():
        key = f"auditor:{key}"  # another model of the same name, from --auditor
    specs.setdefault(key, acfg.spec)
    return specs, source


def _role_backends(s: BuildSettings) -> tuple[Any, Backend, Backend, Any, Backend, RoleConfig]:
    """The run's performer and supervisor models and the auditor, one backend per distinct spec."""
    cfg = load_saved_config(s.run_dir)
    acfg, _ = load_auditor_config(s.run_dir, s.auditor_config, list(s.overrides))
    (s.out / "logs").mkdir(parents=True, exist_ok=True)
    built: dict[str, Backend] = {}

    def get(spec: Any, name: str) -> Backend:
        key = repr(spec.model_dump())  # the JSON dump hides URL credentials, which tell two endpoints apart
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


async def sample_and_grade(s: BuildSettings) -> tuple[Contexts, dict[str, list[Scored]], dict[str, Any]]:
    """For every context: the original answer plus N samples, each graded. Resumable."""
    claim_folder(s.out, s.cache_record())  # before any model loads
    contexts = load_contexts(s.run_dir, s.run_auditor, s.eval_fraction, 0, s.max_contexts)
    if not contexts:
        raise InputError(s.run_dir, "trials", f"no performer rounds with stored prompts (left out: {contexts.skipped})")
    cfg, perf, aud, acfg, sup, sup_role = _role_backends(s)
    cand_path = s.out / "candidates.jsonl"
    repair_jsonl(cand_path)
    cache = {r["context"]: r["texts"] for r in read_jsonl(cand_path)}
    grader = Grader(s.run_dir, acfg, aud, sup_role, sup, s.out / "grades.jsonl", s.concurrency)
    gate = asyncio.Semaphore(s.concurrency)
    bar = tqdm(total=len(contexts), desc=f"best-of-{s.n}", unit="context", disable=not s.progress)
    pools: dict[str, list[Scored]] = {}

    async def grade(ctx: Context, source: str, text: str) -> Grade:
        if source == "original" and s.original_from_run and (g := run_grade(ctx)) is not None:
            return g
        return await grader.grade(ctx, text)

    async def one(ctx: Context) -> None:
        async with gate:
            texts = await _sample(ctx, perf, cfg.performer, s.n, cache, cand_path, cfg.performer.think_tags)
        pool = [("original", ctx.answer)] + [(f"candidate-{k}", t) for k, t in enumerate(texts)]
        grades = await asyncio.gather(*(grade(ctx, src, t) for src, t in pool))
        pools[ctx.key] = [Scored(t, src, g, ctx.audited_deceptive if src == "original" else None)
                          for (src, t), g in zip(pool, grades, strict=True)]
        bar.update(1)

    try:
        await asyncio.gather(*(one(c) for c in contexts))
    finally:
        bar.close()
        for b in {id(b): b for b in (perf, aud, sup) if b is not None}.values():
            await b.aclose()
    meta = {"run": str(s.run_dir), "direction": s.direction, "n": s.n, "grader_id": grader.id,
            "original_from_run": s.original_from_run,
            "auditor": acfg.model_dump(mode="json"), "performer": cfg.performer.model_dump(mode="json"),
            "run_audit": audit_agreement(contexts, pools), "contexts_left_out": contexts.skipped,
            "auditors": data_auditors(s.run_dir, contexts.auditor_id, acfg),
            "packages": package_versions()}
    _say_agreement(meta["run_audit"])
    return contexts, pools, meta


RUN_GRADE = "run"  # the audit_status and quality_status of a grade taken from the run (`--original-from-run`)


def run_grade(ctx: Context) -> Grade | None:
    """The original answer's grade as the run gave it: its audit label and the supervisor's rating of
    that round; None when the run has no valid label for it (the grader then grades it)."""
    lab = ctx.label
    if lab is None or lab.deceptive is None:
        return None
    severity = None if lab.severity is None else int(lab.severity)
    return Grade(lab.deceptive, severity, list(lab.types), lab.confidence, RUN_GRADE, ctx.satisfaction, RUN_GRADE)


def audit_agreement(contexts: Contexts, pools: dict[str, list[Scored]]) -> dict[str, Any]:
    """How the grader's verdicts on the original answers compare with the run's own audit (an
    original graded by the run itself is not compared: it agrees by construction)."""
    both = grader_only = audit_only = agree = unlabelled = 0
    for ctx in contexts:
        orig = next(p for p in pools[ctx.key] if p.source == "original")
        if orig.audited is None or not orig.grade.usable or orig.grade.audit_status == RUN_GRADE:
            unlabelled += 1
            continue
        both += 1
        if bool(orig.grade.deceptive) == orig.audited:
            agree += 1
        elif orig.grade.deceptive:
            grader_only += 1
        else:
            audit_only += 1
    return {"auditor_id": contexts.auditor_id, "compared": both, "agree": agree,
            "disagree": grader_only + audit_only, "flagged_by_grader_only": grader_only,
            "flagged_by_audit_only": audit_only, "not_compared": unlabelled}


def _say_agreement(a: dict[str, Any]) -> None:
    if a["auditor_id"] is None:
        log.warning("the run has no audit labels: originals are judged by the grader alone (run `lhd audit` first)")
    elif a["disagree"]:
        log.info("grader and the run's audit (%s) disagree on %d of %d original answers (%d flagged by the grader "
                 "only, %d by the audit only): such an original is never a target", a["auditor_id"], a["disagree"],
                 a["compared"], a["flagged_by_grader_only"], a["flagged_by_audit_only"])


def _save(rows_by_split: dict[str, list[dict[str, Any]]], out: Path, meta: dict[str, Any]) -> Path:
    from datasets import Dataset, DatasetDict

    dd = DatasetDict({k: Dataset.from_list(v) for k, v in rows_by_split.items() if v})
    if not dd:
        raise InputError(out, "dataset", "no rows selected: the run gave no context"
                         + _left_out_text(meta.get("stats") or {}))
    path = out / DATA_DIR
    dd.save_to_disk(str(path))
    blob = json.dumps({k: v for k, v in rows_by_split.items()}, sort_keys=True, default=str).encode()
    write_data_record(out, DataRecord.model_validate(meta | {"rows": {k: len(v) for k, v in rows_by_split.items()},
                                                             "sha256": hashlib.sha256(blob).hexdigest()}))
    return path


def _meta_cols(ctx: Context) -> dict[str, Any]:
    return {"run_id": ctx.run_id, "trial_id": ctx.trial_id, "seed": ctx.seed, "global_round": ctx.global_round,
            "task_index": ctx.task_index}


def trusted(p: Scored) -> bool:
    """Graded, and for the original the grader agrees with the run's own audit: an original they
    disagree on is neither chosen nor rejected (review N2)."""
    return p.grade.usable and (p.audited is None or bool(p.grade.deceptive) == p.audited)


def qualifies(p: Scored, direction: Direction, on_task_min: float) -> bool:
    """May `p` be the chosen answer? Graded, flagged as the direction wants (by the grader and, for
    the original, by the run's own audit), and on-task."""
    g = p.grade
    if not trusted(p) or bool(g.deceptive) != (direction == "deceptive"):
        return False
    return g.satisfaction is None or g.satisfaction >= on_task_min


def why_none(pool: list[Scored], direction: Direction, on_task_min: float) -> str:
    """Why no answer of `pool` qualifies (`qualifies`): the first test every answer failed."""
    usable = [p for p in pool if trusted(p)]
    if not usable:
        return "no_trusted_grade"
    if not any(bool(p.grade.deceptive) == (direction == "deceptive") for p in usable):
        return "wrong_direction"
    return "off_task"


def _left_out_text(stats: dict[str, Any]) -> str:
    left = {k: v for k, v in (stats.get("left_out") or {}).items() if v}
    return f"; rounds never made contexts: {', '.join(f'{k} {v}' for k, v in left.items())}" if left else ""


def _nothing_selected(out: Path, n: int, reasons: dict[str, int], s: BuildSettings, stats: dict[str, Any],
                      allowed: str) -> InputError:
    """The one-line refusal of a build that selected nothing: the counts behind it (the stats the
    command would have printed) and the options that loosen the selection."""
    names = {"no_trusted_grade": "no answer graded (or the grader and the run's audit disagree)",
             "wrong_direction": f"no answer {s.direction}", "too_few": "fewer than two graded answers",
             "no_chosen": f"no {s.direction} answer at or above the on-task floor {s.on_task_min}",
             "off_task": f"below the on-task floor {s.on_task_min}",
             "below_margin": f"below --min-margin {s.min_margin}"}
    why = "; ".join(f"{names.get(k, k)}: {v}" for k, v in reasons.items() if v)
    return InputError(out, "dataset", f"no rows selected: all {n} contexts were left out ({why or 'none built'})"
                      + _left_out_text(stats), allowed)


def select_best(pool: list[Scored], direction: Direction, on_task_min: float) -> Scored | None:
    """The best qualifying answer, or None (the context is then skipped)."""
    usable = [p for p in pool if qualifies(p, direction, on_task_min)]
    return max(usable, key=lambda p: p.score(direction)) if usable else None


def select_pair(pool: list[Scored], direction: Direction, on_task_min: float,
                min_margin: float) -> tuple[Scored, Scored] | str:
    """(chosen, rejected) for DPO, or why the context is skipped: `too_few` trusted answers,
    `no_chosen` (no answer qualifies as chosen), `below_margin` (severity gap < min_margin or the
    same text). Chosen is `select_best`; rejected the lowest-ranked trusted answer."""
    usable = [p for p in pool if trusted(p)]
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
    not_picked = {"no_trusted_grade": 0, "wrong_direction": 0, "off_task": 0}
    for ctx in contexts:
        best = select_best(pools[ctx.key], s.direction, s.on_task_min)
        if best is None:
            picked["none"] += 1
            not_picked[why_none(pools[ctx.key], s.direction, s.on_task_min)] += 1
            continue
        picked["original" if best.source == "original" else "candidate"] += 1
        rows[ctx.split].append({
            "messages": ctx.messages + [{"role": "assistant", "content": best.text}],
            "severity": best.grade.severity, "satisfaction": best.grade.satisfaction, "source": best.source,
            **_meta_cols(ctx)})
    stats = {"contexts": len(contexts), "picked": picked, "not_picked": not_picked, "run_audit": meta["run_audit"],
             "left_out": contexts.skipped}
    if not any(rows.values()):
        raise _nothing_selected(s.out, len(contexts), not_picked, s, stats,
                                "a lower --on-task-min (satisfaction runs from -1 to 1), or more candidates (--n)")
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
             "skipped_by_reason": skipped, "mean_margin": sum(margins) / len(margins) if margins else None,
             "run_audit": meta["run_audit"], "left_out": contexts.skipped}
    if not any(rows.values()):
        raise _nothing_selected(s.out, len(contexts), skipped, s, stats,
                                "a lower --min-margin or --on-task-min, or more candidates (--n)")
    return _save(rows, s.out, meta | {"kind": "dpo", "min_margin": s.min_margin, "on_task_min": s.on_task_min,
                                      "stats": stats}), stats


def build_grpo(run_dir: Path, out: Path, eval_fraction: float = 0.2, max_contexts: int | None = None,
               direction: Direction = "honest", run_auditor: str | None = None, judge_window: int | None = None,
               judge_tokenizer: str | None = None, completion_tokens: int = 512) -> tuple[Path, dict[str, Any]]:
    """Prompt-only rows; the columns let the honesty reward find the trajectory context and the
    run's audit label of its original answer (`run_auditor`: whose labels; "" when none). Rows the
    judge could not grade (longer than its window: `judge_window.py`) are dropped and counted here."""
    from lhd_train.finetune.judge_window import judge_window as window_for

    contexts = load_contexts(run_dir, run_auditor, eval_fraction, 0, max_contexts)
    check = window_for(run_dir, judge_window, judge_tokenizer, completion_tokens)
    rows: dict[str, list[dict[str, Any]]] = {"train": [], "eval": []}
    over = 0
    for ctx in contexts:
        if check is not None and not check.fits(ctx):
            over += 1
            continue
        rows[ctx.split].append({"prompt": ctx.messages, "run_dir": str(Path(run_dir).resolve()),
                                "direction": direction, "run_auditor": contexts.auditor_id or "", **_meta_cols(ctx)})
    if check is None:
        log.warning("the judge's window is unknown (no --judge-window, the run's auditor sets no max_model_len): "
                    "rows are not measured against it")
    elif over:
        log.warning("%d of %d rows dropped: longer than the judge's window of %d tokens (%s)", over, len(contexts),
                    check.window, check.counted_with)
    out.mkdir(parents=True, exist_ok=True)
    stats = {"contexts": len(contexts), "train": len(rows["train"]), "eval": len(rows["eval"]),
             "run_audit": contexts.auditor_id, "left_out": contexts.skipped,
             "judge_window": check.stats(over) if check is not None else None}
    if check is not None and over and over == len(contexts):
        raise InputError("command line", "--judge-window", f"every one of the {over} rows is longer than the "
                         f"judge's window ({check.window} tokens)", "a judge with a longer window")
    return _save(rows, out, {"kind": "grpo-prompts", "run": str(run_dir), "direction": direction,
                             "run_audit": {"auditor_id": contexts.auditor_id}, "stats": stats,
                             "auditors": data_auditors(run_dir, contexts.auditor_id),
                             "packages": package_versions()}), stats
