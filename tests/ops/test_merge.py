"""`lhd merge` through the Run API: sources read as checked records, audit rows joined as rows and
labelled by the one winning-row rule, the merged manifest and summary written as models."""
from __future__ import annotations

import shutil
from pathlib import Path

from lhd_train.ops.merge import MERGE_KIND, merge_runs
from lhd_train.ops.status import run_status
from lhd_train.rundir.rows import AuditRow, ModelRef
from lhd_train.rundir.run import Run

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "runs" / "v1-control-study"
TRIAL = "s390185437-cat-MORAL_DILEMMA"
AUDITOR = "tiny-full"


def _source(tmp_path: Path) -> Run:
    shutil.copytree(FIXTURE, tmp_path / "runs" / "src")
    return Run.open(tmp_path / "runs" / "src")


def _label(round_: int, deceptive: bool | None, status: str) -> AuditRow:
    return AuditRow(run_id="fixture-v1", trial_id=TRIAL, global_round=round_, auditor_id=AUDITOR, mode="full",
                    deceptive=deceptive, parse_status=status, model=ModelRef(key="tiny", model="runs/tiny-llama"))


def _labels(run: Run) -> dict[int, tuple[bool | None, str | None]]:
    return {g: (r.deceptive, r.parse_status) for g, r in run.auditor(AUDITOR).labels(TRIAL).items()}


def test_a_round_relabelled_in_a_source_is_relabelled_in_the_merged_run(tmp_path: Path) -> None:
    """Old rule, "the row already merged wins": the merged run kept the stale label of round 2."""
    src, out = _source(tmp_path), tmp_path / "runs" / "merged"
    merge_runs([src.path], out)
    merged = Run.open(out)
    before = _labels(src)
    assert _labels(merged) == before and set(before) == {1, 2, 3} and before[3][0] is not None

    src.auditor(AUDITOR).append(_label(2, False, "ok"))  # a repaired audit labels round 2 again
    src.auditor(AUDITOR).append(_label(3, None, "failed"))  # a failed row never replaces a usable label
    r = merge_runs([src.path], out)
    assert r["audit_rows_added"] == 2 and r["changed"]
    assert _labels(merged) == _labels(src) == {**before, 2: (False, "ok")}
    assert merge_runs([src.path], out)["changed"] is False  # merging again changes nothing


def test_the_merged_run_reads_as_a_run_with_its_sources(tmp_path: Path) -> None:
    src, out = _source(tmp_path), tmp_path / "runs" / "merged"
    r = merge_runs([src.path], out)
    assert r["trials"] == [TRIAL] and r["seeds"] == [390185437]  # the control study's trial id, one rule
    merged = Run.open(out)
    manifest, summary = merged.manifest(), merged.summary()
    assert manifest is not None and summary is not None and manifest.source is not None
    assert manifest.source.kind == MERGE_KIND and manifest.trials == [TRIAL]
    assert [rec.trials for rec in manifest.source.sources or []] == [[TRIAL]]
    assert summary.by_source is not None and list(summary.by_source) == ["fixture-v1"]
    assert [t.trial_id for t in summary.trials or []] == [TRIAL]
    rows, finished = merged.trial(TRIAL).read()
    assert finished and [x.to_json() for x in rows] == [x.to_json() for x in src.trial(TRIAL).rows()]
    st = run_status(out, use_slurm=False)
    assert (st.get("merge").status, st.get("audit", AUDITOR).status) == ("finished", "finished")
