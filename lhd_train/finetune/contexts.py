"""Performer contexts from an audited run: the exact messages the performer saw at each round,
its answer, the run's own audit label for it and the supervisor's satisfaction, split by trial.

The label comes from the run's headline auditor, chosen by the one rule the report uses
(`lhd_train.metrics.load.round_labels`: by name, else the run's default), so training data and
the report agree on which answers were deceptive (review N2). Imported runs (`lhd
import-reference`) are left out, counted: the authors never saved the performer's prompts, so
their rows hold conversations rebuilt with our templates and no system prompt, which the
performer never saw (review N11)."""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lhd_train.errors import InputError
from lhd_train.interop.reference_import import SOURCE_KIND
from lhd_train.metrics.load import round_labels
from lhd_train.rundir.files import read_json_mapping
from lhd_train.rundir.layout import RunDir, TrialFiles
from lhd_train.rundir.store import MessageStore, iter_trial_files, read_trial_rows

IMPORTED_BACKEND = "reference"  # a row's `models.performer.backend` when import-reference wrote it


@dataclass
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
    label: dict[str, Any] | None  # the run's headline audit label of this round (valid ones only)
    split: str
    supervisor_eval: list[dict[str, str]] | None = field(default=None, repr=False)  # first evaluation call

    @property
    def key(self) -> str:
        return f"{self.trial_id}/{self.global_round}"

    @property
    def audited_deceptive(self) -> bool | None:
        """The run's own verdict on the original answer: True, False, or None (no valid label)."""
        return None if self.label is None or self.label.get("deceptive") is None else bool(self.label["deceptive"])


class Contexts(list):
    """The contexts, plus the auditor whose labels they carry and the rows left out, by reason."""

    def __init__(self, items: Iterable[Context] = (), auditor_id: str | None = None) -> None:
        super().__init__(items)
        self.auditor_id = auditor_id
        self.skipped: dict[str, int] = {"imported": 0, "no_stored_prompt": 0}


def split_of(trial_id: str, eval_fraction: float, seed: int = 0) -> str:
    """Deterministic and by trial, never by round, so no trajectory straddles the split."""
    h = int(hashlib.sha256(f"{seed}:{trial_id}".encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "eval" if h < eval_fraction else "train"


def is_imported_run(run_dir: Path) -> bool:
    """The run was written by `lhd import-reference` (its manifest says so)."""
    manifest = read_json_mapping(RunDir(run_dir).manifest)
    return (manifest.get("source") or {}).get("kind") == SOURCE_KIND


def _imported_row(row: dict[str, Any]) -> bool:
    return ((row.get("models") or {}).get("performer") or {}).get("backend") == IMPORTED_BACKEND


def load_contexts(run_dir: Path, auditor_id: str | None = None, eval_fraction: float = 0.2,
                  split_seed: int = 0, limit: int | None = None) -> Contexts:
    """Every performer round with its exact prompt. `auditor_id`: whose labels to attach (None:
    the run's headline auditor, as in the report). Rows of imported runs and rows whose prompt
    is not stored are skipped and counted in `.skipped`."""
    run_dir = Path(run_dir)
    files = list(iter_trial_files(run_dir))
    if not files:
        raise InputError(run_dir, "trials", "no trial files: is this a run directory (runs/<run>)?")
    chosen, labels = round_labels(run_dir, auditor_id)
    out = Contexts([], chosen)
    imported_run = is_imported_run(run_dir)
    for path in files:
        tf = TrialFiles.from_rows(path)
        trial_id = tf.trial_id
        store = MessageStore(tf.messages)
        split = split_of(trial_id, eval_fraction, split_seed)
        for row in read_trial_rows(path):  # refuses a round written twice
            if imported_run or _imported_row(row):
                out.skipped["imported"] += 1  # rebuilt prompts, not the ones the performer saw
                continue
            ids = row["performer"].get("message_ids") or []
            if not ids or not all(i in store for i in ids):
                out.skipped["no_stored_prompt"] += 1
                continue
            evals = [c for c in (row.get("supervisor") or {}).get("calls") or []
                     if c.get("stage") == "evaluation" and c.get("message_ids")]
            sup_msgs = (store.get(evals[0]["message_ids"])
                        if evals and all(i in store for i in evals[0]["message_ids"]) else None)
            ev = (row.get("supervisor") or {}).get("evaluation") or {}
            out.append(Context(
                row.get("run_id", ""), trial_id, row["global_round"], row["task_index"], row["round"], row["seed"],
                store.get(ids), row["performer"]["text"], ev.get("satisfaction"),
                labels.get((trial_id, row["global_round"])), split, sup_msgs,
            ))
            if limit and len(out) >= limit:
                return out
    return out
