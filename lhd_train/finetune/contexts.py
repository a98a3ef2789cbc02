"""Performer contexts from an audited run: the exact messages the performer saw at each round,
its answer, the auditor's label and the supervisor's satisfaction, split by trial."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lhd_train.errors import InputError
from lhd_train.rundir.layout import RunDir, TrialFiles
from lhd_train.rundir.store import MessageStore, iter_trial_files, read_audit_rows, read_trial_rows


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
    label: dict[str, Any] | None  # the run's own audit row for this round, when there is one
    split: str
    supervisor_eval: list[dict[str, str]] | None = field(default=None, repr=False)  # first evaluation call

    @property
    def key(self) -> str:
        return f"{self.trial_id}/{self.global_round}"


def split_of(trial_id: str, eval_fraction: float, seed: int = 0) -> str:
    """Deterministic and by trial, never by round, so no trajectory straddles the split."""
    h = int(hashlib.sha256(f"{seed}:{trial_id}".encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "eval" if h < eval_fraction else "train"


def load_contexts(run_dir: Path, auditor_id: str | None = None, eval_fraction: float = 0.2,
                  split_seed: int = 0, limit: int | None = None) -> list[Context]:
    run_dir = Path(run_dir)
    files = list(iter_trial_files(run_dir))
    if not files:
        raise InputError(run_dir, "trials", "no trial files: is this a run directory (runs/<run>)?")
    labels: dict[tuple[str, int], dict[str, Any]] = {}
    if auditor_id:
        rd = RunDir(run_dir)
        adir = rd.auditor_dir(auditor_id)
        if not adir.is_dir():
            have = rd.auditor_ids()
            raise InputError(rd.audit_dir, "auditor", f"no auditor '{auditor_id}'", ", ".join(have) or "none")
        for p in adir.glob("*.jsonl"):
            for r in read_audit_rows(p):
                labels[(r["trial_id"], r["global_round"])] = r
    out: list[Context] = []
    for path in files:
        tf = TrialFiles.from_rows(path)
        trial_id = tf.trial_id
        store = MessageStore(tf.messages)
        split = split_of(trial_id, eval_fraction, split_seed)
        for row in read_trial_rows(path):  # refuses a round written twice
            ids = row["performer"].get("message_ids") or []
            if not ids or not all(i in store for i in ids):
                continue  # imported runs without stored prompts cannot give exact contexts
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
