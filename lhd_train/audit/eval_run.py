"""`lhd audit-eval`: run an auditor on labelled answers through the ordinary audit code path
(`runner.audit_run`, any mode, any backend) and score its rows (`evaluation.score`).

The labelled answers are the curated set, written as a run directory under `OUT/run` (reused by
later evaluations), or a planted run, audited in place. Sampling k times audits under ids
`<id>-k1` ... `<id>-kk`, each seeding its calls differently. `attach` files a copy of the results in
another run's `eval/` folder (`eval_results`; for a planted copy, by default its source run).
docs/validity.md."""
from __future__ import annotations

import asyncio
from pathlib import Path

from lhd_train.audit.curated import build_curated_run, load_curated, set_sha256
from lhd_train.audit.eval_plots import reliability_png
from lhd_train.audit.eval_results import (
    EVAL_JSON,
    EVAL_MD,
    RELIABILITY_PNG,
    SCHEMA,
    AuditorEvaluation,
    EvalModel,
    EvalScore,
    eval_dir,
    write_evaluation,
)
from lhd_train.audit.eval_text import headline_lines, markdown
from lhd_train.audit.evaluation import Key, Sample, score, truths
from lhd_train.audit.ground_truth import read_ground_truth, read_plant_info
from lhd_train.config.auditor import AuditOptions, AuditorConfig
from lhd_train.errors import InputError
from lhd_train.io.files import atomic_write_bytes, atomic_write_text
from lhd_train.io.provenance import utc_now
from lhd_train.rundir.outputs import check_out_dir
from lhd_train.rundir.run import Run
from rollouts.backend import Backend


def curated_run(out: Path, set_path: Path | None = None) -> Path:
    """`OUT/run`: the curated set as a run directory, built once and reused while the set is the
    same (a changed set is refused: its old audit rows would be scored against new labels)."""
    cset = load_curated(set_path)
    run = Run.at(Path(out) / "run")
    manifest = run.manifest()
    if manifest is not None:
        if manifest.set_sha256 != set_sha256(cset):
            raise InputError(run.dir.manifest, "set_sha256", f"{run.path} was built from another version of the set; "
                             "pass a new --out")
        return run.path
    return build_curated_run(cset, run.path)


def audited_rounds(run: Run) -> list[Key]:
    """(trial, global round) of every round the auditor judges (finished trials)."""
    from lhd_train.audit.runner import load_trials

    trials, _, _ = load_trials(run)
    return [(t.trial_id, r.global_round) for t in trials for r in t.rows]


def labels_of(run: Run, auditor_id: str) -> Sample:
    """(trial, global round) -> the audit row that counts for it (`AuditorStore.labels`)."""
    store = run.auditor(auditor_id)
    return {(tid, g): row for tid in store.trial_ids() for g, row in store.labels(tid).items()}


def evaluate_auditor(run: Path, cfg: AuditorConfig, opts: AuditOptions, out: Path, source: str, samples: int = 1,
                     config_source: str = "", backend: Backend | None = None,
                     progress: bool = True) -> AuditorEvaluation:
    """Audit `run` `samples` times (`AuditEvalCommand` bounds it), score the rows, write
    `OUT/eval.json` and `OUT/eval.md`."""
    from lhd_train.audit.runner import audit_run

    judged = Run.open(run)
    truth_rows, planted = read_ground_truth(judged), read_plant_info(judged) is not None
    base = opts.resolved_id(cfg.auditor.model)
    ids = [base] if samples == 1 else [f"{base}-k{j}" for j in range(1, samples + 1)]
    incomplete = []
    for aid in ids:
        summary = asyncio.run(audit_run(run, cfg, opts.model_copy(update={"auditor_id": aid}), config_source,
                                        backend=backend, progress=progress))
        if not summary.complete:
            incomplete.append(aid)
    per_sample = [labels_of(judged, aid) for aid in ids]
    truth = truths(truth_rows, audited_rounds(judged), planted)
    result = EvalScore.model_validate(score(truth, per_sample))
    record = AuditorEvaluation(
        schema_=SCHEMA, auditor_id=base, auditor_ids=ids, source=source, run=str(Path(run).absolute()),
        planted=planted, options=opts.to_json(),
        model=EvalModel(key=cfg.auditor.model, model=cfg.spec.model, revision=cfg.spec.revision,
                        backend=cfg.spec.backend, adapter=cfg.auditor.adapter),
        sampling=cfg.auditor.sampling.model_dump(mode="json"), samples=samples,
        note=("temperature 0: the k samples differ only by seed, so they agree by construction"
              if samples > 1 and not cfg.auditor.sampling.temperature else None),
        incomplete=incomplete, result=result, created_at=utc_now(),
        reliability_png=RELIABILITY_PNG if result.calibration else None)
    record.headline = headline_lines(record)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_evaluation(out / EVAL_JSON, record)
    atomic_write_text(out / EVAL_MD, markdown(record))
    if result.calibration:
        atomic_write_bytes(out / RELIABILITY_PNG, reliability_png(result.calibration, f"{base} on {source}"))
    return record


def planted_from(run: Path) -> Path | None:
    """The run a planted copy was made from (plant.json `source_run`), when it is still a run."""
    info = read_plant_info(Run.at(run))
    if info is None:
        return None
    try:
        return Run.open(info.source_run).path
    except InputError:
        return None


def attach(record: AuditorEvaluation, run: Path) -> Path:
    """File a copy of the evaluation `evaluate_auditor` wrote under `RUN/eval/<auditor-id>/<source>/`,
    where `lhd report RUN` finds it (`eval_results.evaluations_for`). Returns the folder."""
    Run.open(run, source="command line", field="--attach")
    dest = eval_dir(run, record.auditor_id, record.source)
    check_out_dir(dest, "--attach", "evaluation")
    dest.mkdir(parents=True, exist_ok=True)
    written = record.path.parent
    write_evaluation(dest / EVAL_JSON, record.model_copy())
    atomic_write_text(dest / EVAL_MD, (written / EVAL_MD).read_text(encoding="utf-8"))
    if (written / RELIABILITY_PNG).is_file():
        atomic_write_bytes(dest / RELIABILITY_PNG, (written / RELIABILITY_PNG).read_bytes())
    return dest
