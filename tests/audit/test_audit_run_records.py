"""`lhd audit` reads and writes the run directory through the Run API: on a run written by an
earlier main (tests/data/runs/), the rows it resumes from are the rows that count by the one
winning-row rule, and auditor.json keeps everything its first session recorded."""
from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from lhd_train.audit import audit_run
from lhd_train.audit.runner import load_trials
from lhd_train.config.auditor import AuditOptions, load_auditor_config
from lhd_train.errors import InputError
from lhd_train.rundir.rows import RoundRow
from lhd_train.rundir.run import Run

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "runs" / "v1-control-study"
TRIAL = "s390185437-cat-MORAL_DILEMMA"


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return Path(shutil.copytree(FIXTURE, tmp_path / "run"))


def _append_failed_relabel(run_dir: Path, global_round: int) -> None:
    """A later row for an already labelled round that holds no label (a resumed or merged audit)."""
    path = run_dir / "audit" / "tiny-full" / f"{TRIAL}.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    row = next(r for r in rows if r["global_round"] == global_round)
    failed = row | {"deceptive": None, "types": [], "severity": None, "confidence": None, "parse_status": "failed",
                    "raw": "", "error": "no answer"}
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(failed) + "\n")


def test_a_resumed_audit_counts_the_row_that_counts_not_the_last_one(run_dir: Path) -> None:
    info = run_dir / "audit" / "tiny-full" / "auditor.json"
    before = json.loads(info.read_text(encoding="utf-8"))
    assert Run.open(run_dir).auditor("tiny-full").labels(TRIAL)[2].deceptive is True
    _append_failed_relabel(run_dir, 2)
    acfg, source = load_auditor_config(run_dir)
    summary = asyncio.run(audit_run(run_dir, acfg, AuditOptions(), source, progress=False))  # nothing left to do
    [trial] = summary.trials
    assert (trial.rounds, trial.already, trial.audited) == (3, 3, 0)
    assert trial.on_disk == 3 and trial.flagged == 3  # round 2 keeps its flag: a failed row never replaces it
    after = json.loads(info.read_text(encoding="utf-8"))
    assert {k: v for k, v in after.items() if k != "updated_at"} == {k: v for k, v in before.items()
                                                                    if k != "updated_at"}


def test_trials_of_an_earlier_run_load_as_typed_rows(run_dir: Path, tmp_path: Path) -> None:
    trials, skipped, _ = load_trials(run_dir)
    [trial] = trials
    assert skipped == [] and trial.trial_id == TRIAL and trial.finished
    assert all(isinstance(r, RoundRow) for r in trial.rows)
    assert [r.global_round for r in trial.rows] == [1, 2, 3]
    assert trial.seed == 390185437
    with pytest.raises(InputError, match="not a run directory"):
        load_trials(tmp_path / "nowhere")
