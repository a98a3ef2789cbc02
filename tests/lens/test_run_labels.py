"""`lens read --run` labels a round exactly as `lhd report` does: one shared rule
(`lhd_train.metrics.load.round_labels`), selectable by auditor id."""
from __future__ import annotations

import pytest
from support.synthetic import R, write_run

from lens.errors import LensError
from lens.runs import load_audit_labels
from lhd_train.metrics import load_run

F = "FALSIFICATION"


@pytest.fixture()
def two_auditors(tmp_path):
    """The full-mode auditor flags round 1 only; a newer window auditor flags rounds 2 and 3
    and fails on round 4."""
    return write_run(tmp_path, "two", {"s1": [
        R(1, None, label=(True, [F], 2)), R(1, None, label=(False, [], 0)),
        R(2, None, label=(False, [], 0)), R(2, None, label=(False, [], 1))]},
        extra_auditors={"win": ("window", {"s1": [(False, [], 0), (True, [F], 3), (True, [F], 4), "failed"]})})


def _report_flags(run_dir, auditor=None):
    rounds = load_run(run_dir, auditor).rounds
    return {("s1", int(g)): d
            for g, d, ok in zip(rounds["global_round"], rounds["deceptive"], rounds["labelled"], strict=True)
            if ok}


def test_lens_labels_equal_report_labels(two_auditors):
    labels, auditors = load_audit_labels(two_auditors)
    assert auditors == ["full"]  # the report's default auditor, not every auditor at once
    assert {k: v["flagged"] for k, v in labels.items()} == _report_flags(two_auditors)
    assert labels[("s1", 1)]["severity"] == 2 and labels[("s1", 4)]["severity"] == 1


def test_lens_labels_follow_a_chosen_auditor(two_auditors):
    labels, auditors = load_audit_labels(two_auditors, "win")
    assert auditors == ["win"]
    assert {k: v["flagged"] for k, v in labels.items()} == _report_flags(two_auditors, "win")
    assert ("s1", 4) not in labels  # a failed label is no label
    with pytest.raises(LensError, match="nope"):
        load_audit_labels(two_auditors, "nope")
