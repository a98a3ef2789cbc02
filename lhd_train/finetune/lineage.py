"""What trained an adapter, recorded in `lhd_adapter.json` under "lineage" (docs/training.md,
"What an adapter records"): the runs its data came from, the seeds of the trials whose rounds are
in its training and evaluation splits, and the auditors whose labels selected or rewarded that
data. `lhd report BASE ADAPTER` reads it back (`read_lineage`) to warn when the evaluation repeats
training seeds or is scored by the training auditor (review science-4 D8: an adapter trained to
please an auditor and graded by the same auditor may have learned to evade it).

The data stage writes the auditors into the dataset's record (`auditors`, see `data_auditors`)
and a `seed` column into every row; for data made before that, the seeds are looked up by trial id
in the run the record names, and the auditors read from its older fields."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from lhd_train.config.algos import OnlineSection
from lhd_train.errors import DataFileError, InputError
from lhd_train.finetune.records import (
    ADAPTER_RECORD,
    AdapterLineage,
    AuditorIdentity,
    DataLineage,
    DataRecord,
    SplitInfo,
    find_data_record,
    read_adapter_record,
)
from lhd_train.rundir.run import Run


def auditor_identity(role: str, auditor_id: str | None, run_dir: str | Path | None = None,
                     key: str | None = None, model: str | None = None) -> AuditorIdentity:
    """One auditor as lineage records it: its role, id, model key and model; the key and model come
    from the run's `audit/<id>/auditor.json` when they are not given."""
    if run_dir is not None and auditor_id and (key is None or model is None):
        try:
            record = Run.open(run_dir).auditor(auditor_id).record()
        except (InputError, OSError):
            record = None
        ident = (record.model_identity or {}) if record is not None else {}
        key, model = key or ident.get("key"), model or ident.get("model")
    return AuditorIdentity(role=role, auditor_id=auditor_id, key=key, model=model)


def data_auditors(run_dir: Path, run_auditor: str | None, grader: Any | None = None) -> list[AuditorIdentity]:
    """The data stage's auditors: the run's audit labels (which veto an original answer) and, for
    best-of-N and DPO, the grader that chose the kept answers (an `AuditorConfig`)."""
    out = [auditor_identity("run labels", run_auditor, run_dir)] if run_auditor else []
    if grader is not None:
        out.append(auditor_identity("grader (selected the data)", None, key=grader.auditor.model,
                                    model=grader.spec.model))
    return out


def _older_auditors(meta: DataRecord) -> list[AuditorIdentity]:
    """Auditors from a record written before `auditors` existed."""
    out = []
    if meta.run_audit.auditor_id:
        out.append(auditor_identity("run labels", meta.run_audit.auditor_id, meta.run))
    key = (meta.auditor.get("auditor") or {}).get("model")
    if key:
        out.append(auditor_identity("grader (selected the data)", None, key=key,
                                    model=((meta.auditor.get("models") or {}).get(key) or {}).get("model")))
    return out


def _seed_lookup(runs: list[str], trial_ids: set[str]) -> dict[str, int]:
    """trial id -> seed from the runs' own rows (data made before rows carried a `seed`)."""
    found: dict[str, int] = {}
    for run_dir in runs:
        try:
            run = Run.open(run_dir)
        except InputError:
            continue
        for tid in sorted(trial_ids - set(found)):
            if not run.dir.trial(tid).rows.is_file():
                continue
            rows, _ = run.trial(tid).read()
            if rows and rows[0].seed is not None:
                found[tid] = int(rows[0].seed)
    return found


def dataset_lineage(ds: Any, path: Path) -> DataLineage:
    """The lineage of one loaded dataset split (`datasets.Dataset`, before its columns are cut to
    the trainer's): its runs, trial seeds and auditors, and what could not be found (`missing`)."""
    found = find_data_record(Path(path))
    meta = found[0] if found is not None else None
    cols = set(ds.column_names)
    tids = [str(t) for t in ds["trial_id"]] if "trial_id" in cols else []
    runs = sorted(({str(r) for r in ds["run_dir"]} if "run_dir" in cols else set())
                  | ({meta.run} if meta is not None and meta.run else set())
                  | {p.run for p in (meta.parts if meta is not None else []) if p.run})
    trials: dict[str, int] = {}
    if "seed" in cols:
        trials = {t: int(s) for t, s in zip(tids, ds["seed"], strict=True) if s is not None}
    missing_seeds = set(tids) - set(trials)
    if missing_seeds:
        trials |= _seed_lookup(runs, missing_seeds)
    auditors = list(meta.auditors or _older_auditors(meta)) if meta is not None else []
    if "run_auditor" in cols:
        for aid in sorted({str(a) for a in ds["run_auditor"] if a} - {a.auditor_id for a in auditors}):
            auditors.append(auditor_identity("run labels", aid, runs[0] if runs else None))
    missing = []
    if not tids:
        missing.append("the rows name no trial (no trial_id column): seeds unknown")
    elif set(tids) - set(trials):
        missing.append(f"{len(set(tids) - set(trials))} trial(s) without a known seed")
    if not auditors:
        missing.append("no auditor recorded for the data")
    return DataLineage(path=str(path), kind=meta.kind if meta is not None else None, runs=runs,
                       run_ids=sorted({str(r) for r in ds["run_id"]}) if "run_id" in cols else [],
                       trials=dict(sorted(trials.items())), seeds=sorted(set(trials.values())), auditors=auditors,
                       missing=missing)


def reward_judges(recipe: Any) -> list[AuditorIdentity]:
    """An online algorithm: the judge endpoint of the judged rewards (its section's `judge`), else
    the runs' auditor config."""
    online = recipe.section
    if not isinstance(online, OnlineSection):
        return []
    judged = [r.name for r in online.rewards if r.name not in ("format_length",)]
    if not judged:
        return []
    model = online.judge.model if online.judge is not None else None
    return [AuditorIdentity(role=f"reward judge ({', '.join(judged)})", auditor_id=None, key=None,
                            model=model or "the auditor config of the data's run")]


def adapter_lineage(data: dict[str, SplitInfo], recipe: Any) -> AdapterLineage:
    """lhd_adapter.json's "lineage": every split's lineage joined (`data[split].lineage`)."""
    splits = {k: v.lineage or DataLineage(path=v.path, kind=None) for k, v in data.items()}
    auditors: list[AuditorIdentity] = []
    for lin in splits.values():
        auditors += [a for a in lin.auditors if a not in auditors]
    auditors += reward_judges(recipe)
    train, evaluation = splits.get("train"), splits.get("eval")
    return AdapterLineage(runs=sorted({r for lin in splits.values() for r in lin.runs}),
                          train_seeds=train.seeds if train else [], eval_seeds=evaluation.seeds if evaluation else [],
                          train_trials=train.trials if train else {}, auditors=auditors,
                          missing=[f"{k}: {m}" for k, lin in splits.items() for m in lin.missing])


def read_lineage(adapter: str | Path) -> tuple[AdapterLineage | None, str | None]:
    """(lineage, None) from `<adapter>/lhd_adapter.json`, or (None, why not) in words."""
    try:
        record = read_adapter_record(Path(adapter))
    except DataFileError as e:
        return None, str(e)
    path = Path(adapter) / ADAPTER_RECORD
    if record is None:
        return None, f"{path} not found: the adapter's training seeds and auditors are unknown"
    if record.lineage is None:
        return None, f"{path} records no lineage (trained before adapters recorded their seeds and auditors)"
    return record.lineage, None
