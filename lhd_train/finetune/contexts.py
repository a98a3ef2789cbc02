"""Performer contexts of a run: the exact messages the performer saw at each round, its answer,
the run's own audit label for it (the headline auditor, by the report's rule
`metrics.labels.round_labels`) and the supervisor's satisfaction, split by trial. The label vetoes
an original as a target, it never replaces the grade (review N2). Imported runs are left out and
counted: their prompts were rebuilt, not seen by the performer (review N11). Why: docs/training.md,
"Training data"."""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from lhd_train.errors import InputError
from lhd_train.interop.reference_import import SOURCE_KIND
from lhd_train.metrics.labels import RoundLabel, round_labels
from lhd_train.rundir.rows import RoundRow
from lhd_train.rundir.run import Run

IMPORTED_BACKEND = "reference"  # a row's `models.performer.backend` when import-reference wrote it


@dataclass(kw_only=True)
class Context:
    run_id: str
    trial_id: str
    global_round: int
    task_index: int
    round: int
    seed: int
    messages: list[dict[str, str]]  # what the performer was sent, system prompt first
    answer: str
    satisfaction: float | None
    label: RoundLabel | None  # the run's headline audit label of this round (valid ones only)
    split: str
    supervisor_eval: list[dict[str, str]] | None = field(default=None, repr=False)  # first evaluation call

    @property
    def key(self) -> str:
        return f"{self.trial_id}/{self.global_round}"

    @property
    def audited_deceptive(self) -> bool | None:
        """The run's own verdict on the original answer: True, False, or None (no valid label)."""
        return None if self.label is None else self.label.deceptive


class Contexts(list[Context]):
    """The contexts, plus the auditor whose labels they carry and the rows left out, by reason."""

    def __init__(self, items: Iterable[Context] = (), auditor_id: str | None = None) -> None:
        super().__init__(items)
        self.auditor_id = auditor_id
        self.skipped: dict[str, int] = {"imported": 0, "no_stored_prompt": 0}


def split_of(trial_id: str, eval_fraction: float, seed: int = 0) -> str:
    """Deterministic and by trial, never by round, so no trajectory straddles the split."""
    h = int(hashlib.sha256(f"{seed}:{trial_id}".encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "eval" if h < eval_fraction else "train"


def is_imported_run(run: Run) -> bool:
    """The run was written by `lhd import-reference` (its manifest says so)."""
    manifest = run.manifest()
    return manifest is not None and manifest.source is not None and manifest.source.kind == SOURCE_KIND


def _imported_row(row: RoundRow) -> bool:
    performer = row.models.performer if row.models is not None else None
    return performer is not None and performer.backend == IMPORTED_BACKEND


def load_contexts(run_dir: Path | Run, auditor_id: str | None = None, eval_fraction: float = 0.2,
                  split_seed: int = 0, limit: int | None = None) -> Contexts:
    """Every performer round with its exact prompt. `auditor_id`: whose labels to attach (None:
    the run's headline auditor, as in the report). Rows of imported runs and rows whose prompt
    is not stored are skipped and counted in `.skipped`."""
    run = run_dir if isinstance(run_dir, Run) else Run.open(run_dir)
    trial_ids = run.trial_ids()
    if not trial_ids:
        raise InputError(run.dir.trials_dir, None, "no trial files: the run has no rounds yet")
    chosen, labels = round_labels(run, auditor_id)
    out = Contexts([], chosen)
    imported_run = is_imported_run(run)
    for trial_id in trial_ids:
        trial = run.trial(trial_id)
        store = trial.messages()
        split = split_of(trial_id, eval_fraction, split_seed)
        for row in trial.rows(RoundRow):  # refuses a round written twice
            if imported_run or _imported_row(row):
                out.skipped["imported"] += 1  # rebuilt prompts, not the ones the performer saw
                continue
            ids = row.performer.message_ids or []
            if not ids or not all(i in store for i in ids):
                out.skipped["no_stored_prompt"] += 1
                continue
            sup = row.supervisor
            evals = [c.message_ids for c in (sup.calls if sup is not None else None) or []
                     if c.stage == "evaluation" and c.message_ids]
            sup_msgs = store.get(evals[0]) if evals and all(i in store for i in evals[0]) else None
            evaluation = sup.evaluation if sup is not None else None
            out.append(Context(
                run_id=row.run_id or "", trial_id=trial_id, global_round=row.global_round,
                task_index=row.task_index, round=row.round, seed=row.seed or 0, messages=store.get(ids),
                answer=row.performer.text or "", satisfaction=evaluation.satisfaction if evaluation else None,
                label=labels.get((trial_id, row.global_round)), split=split, supervisor_eval=sup_msgs,
            ))
            if limit and len(out) >= limit:
                return out
    return out
