"""What trained an adapter, recorded in `lhd_adapter.json` under "lineage" (docs/training.md,
"What an adapter records"): the runs its data came from, the seeds of the trials whose rounds are
in its training and evaluation splits, and the auditors whose labels selected or rewarded that
data. `lhd report BASE ADAPTER` reads it back (`read_lineage`) to warn when the evaluation repeats
training seeds or is scored by the training auditor (review science-4 D8: an adapter trained to
please an auditor and graded by the same auditor may have learned to evade it).

The data stage writes the auditors into the dataset's sidecar (`auditors`, see `data_auditors`)
and a `seed` column into every row; for data made before that, the seeds are looked up by trial id
in the run the sidecar names, and the auditors read from its older fields."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lhd_train.errors import InputError
from lhd_train.rundir.run import Run

LINEAGE = "lineage"
SIDECARS = ("lhd_data.json", "dataset.json")  # the data folder's own (lhd data), the merged one (lhd data merge)


def auditor_identity(role: str, auditor_id: str | None, run_dir: str | Path | None = None,
                     key: str | None = None, model: str | None = None) -> dict[str, Any]:
    """One auditor as lineage records it: its role, id, model key and model; the key and model come
    from the run's `audit/<id>/auditor.json` when they are not given."""
    if run_dir is not None and auditor_id and (key is None or model is None):
        try:
            record = Run.open(run_dir).auditor(auditor_id).record()
        except (InputError, OSError):
            record = None
        ident = (record.model_identity or {}) if record is not None else {}
        key, model = key or ident.get("key"), model or ident.get("model")
    return {"role": role, "auditor_id": auditor_id, "key": key, "model": model}


def data_auditors(run_dir: Path, run_auditor: str | None, grader: Any | None = None) -> list[dict[str, Any]]:
    """The data stage's auditors: the run's audit labels (which veto an original answer) and, for
    best-of-N and DPO, the grader that chose the kept answers (an `AuditorConfig`)."""
    out = [auditor_identity("run labels", run_auditor, run_dir)] if run_auditor else []
    if grader is not None:
        out.append(auditor_identity("grader (selected the data)", None, key=grader.auditor.model,
                                    model=grader.spec.model))
    return out


def _sidecar(path: Path) -> dict[str, Any]:
    folder = path if path.is_dir() else path.parent
    for where in (folder / SIDECARS[0], folder.parent / SIDECARS[1], folder / SIDECARS[1]):
        if where.is_file():
            try:
                rec = json.loads(where.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if isinstance(rec, dict):
                return rec
    return {}


def _older_auditors(meta: dict[str, Any]) -> list[dict[str, Any]]:
    """Auditors from a sidecar written before `auditors` existed."""
    out = []
    run_audit = meta.get("run_audit") or {}
    if run_audit.get("auditor_id"):
        out.append(auditor_identity("run labels", run_audit["auditor_id"], meta.get("run")))
    cfg = meta.get("auditor") or {}
    key = (cfg.get("auditor") or {}).get("model")
    if key:
        out.append(auditor_identity("grader (selected the data)", None, key=key,
                                    model=((cfg.get("models") or {}).get(key) or {}).get("model")))
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


def dataset_lineage(ds: Any, path: Path) -> dict[str, Any]:
    """The lineage of one loaded dataset split (`datasets.Dataset`, before its columns are cut to
    the trainer's): its runs, trial seeds and auditors, and what could not be found (`missing`)."""
    meta = _sidecar(Path(path))
    cols = set(ds.column_names)
    tids = [str(t) for t in ds["trial_id"]] if "trial_id" in cols else []
    runs = sorted(({str(r) for r in ds["run_dir"]} if "run_dir" in cols else set())
                  | ({str(meta["run"])} if meta.get("run") else set())
                  | {str(p["run"]) for p in meta.get("parts") or [] if p.get("run")})
    trials: dict[str, int] = {}
    if "seed" in cols:
        trials = {t: int(s) for t, s in zip(tids, ds["seed"], strict=True) if s is not None}
    missing_seeds = set(tids) - set(trials)
    if missing_seeds:
        trials |= _seed_lookup(runs, missing_seeds)
    auditors = list(meta.get("auditors") or _older_auditors(meta))
    if "run_auditor" in cols:
        for aid in sorted({str(a) for a in ds["run_auditor"] if a} - {a.get("auditor_id") for a in auditors}):
            auditors.append(auditor_identity("run labels", aid, runs[0] if runs else None))
    missing = []
    if not tids:
        missing.append("the rows name no trial (no trial_id column): seeds unknown")
    elif set(tids) - set(trials):
        missing.append(f"{len(set(tids) - set(trials))} trial(s) without a known seed")
    if not auditors:
        missing.append("no auditor recorded for the data")
    return {"path": str(path), "kind": meta.get("kind"), "runs": runs,
            "run_ids": sorted({str(r) for r in ds["run_id"]}) if "run_id" in cols else [],
            "trials": dict(sorted(trials.items())), "seeds": sorted(set(trials.values())),
            "auditors": auditors, "missing": missing}


def reward_judges(recipe: Any) -> list[dict[str, Any]]:
    """GRPO: the judge endpoint of the judged rewards (`grpo.judge`), else the runs' auditor config."""
    grpo = getattr(recipe, "grpo", None)
    if recipe.algo != "grpo" or grpo is None:
        return []
    judged = [r.name for r in grpo.rewards if r.name not in ("format_length",)]
    if not judged:
        return []
    model = grpo.judge.model if grpo.judge is not None else None
    return [{"role": f"reward judge ({', '.join(judged)})", "auditor_id": None, "key": None,
             "model": model or "the auditor config of the data's run"}]


def adapter_lineage(data: dict[str, dict[str, Any]], recipe: Any) -> dict[str, Any]:
    """lhd_adapter.json's "lineage": every split's lineage joined (`data[split]["lineage"]`)."""
    splits = {k: v.get(LINEAGE) or {} for k, v in data.items()}
    auditors: list[dict[str, Any]] = []
    for lin in splits.values():
        auditors += [a for a in lin.get("auditors", []) if a not in auditors]
    auditors += reward_judges(recipe)
    return {"runs": sorted({r for lin in splits.values() for r in lin.get("runs", [])}),
            "train_seeds": splits.get("train", {}).get("seeds", []),
            "eval_seeds": splits.get("eval", {}).get("seeds", []),
            "train_trials": splits.get("train", {}).get("trials", {}),
            "auditors": auditors,
            "missing": [f"{k}: {m}" for k, lin in splits.items() for m in lin.get("missing", [])]}


def read_lineage(adapter: str | Path) -> tuple[dict[str, Any] | None, str | None]:
    """(lineage, None) from `<adapter>/lhd_adapter.json`, or (None, why not) in words."""
    path = Path(adapter) / "lhd_adapter.json"
    if not path.is_file():
        return None, f"{path} not found: the adapter's training seeds and auditors are unknown"
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return None, f"{path} is not readable JSON ({e})"
    lin = rec.get(LINEAGE) if isinstance(rec, dict) else None
    if not isinstance(lin, dict):
        return None, f"{path} records no lineage (trained before adapters recorded their seeds and auditors)"
    return lin, None
