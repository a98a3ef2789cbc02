"""The public labels API (`lhd_train.metrics.labels`): `round_labels` returns typed, frozen
`RoundLabel`s, one per round by the run's one winning-row rule, only usable ones; the report's
tables count exactly those; auditors are listed by creation time (auditor.json)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from support.synthetic import R, audit_row, write_run

from lhd_train.metrics import load_audit, load_run
from lhd_train.metrics.labels import AuditorInfo, RoundLabel, list_auditors, round_labels

F, C = "FALSIFICATION", "CONCEALMENT"


def _append(run: Path, auditor: str, *rows: dict) -> None:
    with open(run / "audit" / auditor / "s1.jsonl", "a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


@pytest.fixture()
def relabelled(tmp_path: Path) -> Path:
    """Round 1: usable, then a failed relabel (the usable one stays). Round 2: failed, then usable
    (the later one wins). Round 3: cut at the token limit although it says deceptive (no label).
    Round 4: types in odd spellings and one unknown; no severity."""
    run = write_run(tmp_path, "r", {"s1": [R(1, label=(True, [F], 2)), R(1, label="failed"),
                                           R(2, label=None), R(2, label=None)]})
    _append(run, "full",
            audit_row("s1", 1, None, (), None, None, parse_status="failed"),
            audit_row("s1", 2, True, [C], 3, parse_status="retried"),
            audit_row("s1", 3, True, [F], 4, parse_status="cut"),
            audit_row("s1", 4, True, ["falsification ", "FALSIFICATION", "made-up"], None))
    return run


def test_round_labels_are_typed_and_follow_the_winning_row_rule(relabelled: Path) -> None:
    auditor, labels = round_labels(relabelled)
    assert auditor == "full"
    assert sorted(labels) == [("s1", 1), ("s1", 2), ("s1", 4)]  # round 3 was cut: no label
    assert all(isinstance(lab, RoundLabel) and lab.valid for lab in labels.values())
    one, two, four = labels[("s1", 1)], labels[("s1", 2)], labels[("s1", 4)]
    assert (one.deceptive, one.types, one.severity, one.label_status) == (True, (F,), 2.0, "ok")
    assert (two.deceptive, two.types, two.severity, two.label_status) == (True, (C,), 3.0, "retried")
    assert (four.types, four.severity) == ((F,), None)  # known types once each; no severity is None, not NaN
    with pytest.raises(dataclasses.FrozenInstanceError):
        one.deceptive = False  # type: ignore[misc]


def test_the_report_counts_the_same_labels(relabelled: Path) -> None:
    _, labels = round_labels(relabelled)
    rounds = load_run(relabelled).rounds.set_index(["trial_id", "global_round"])
    assert set(rounds.index[rounds["labelled"]]) == set(labels)
    assert {k for k, lab in labels.items() if lab.deceptive} == set(rounds.index[rounds["flagged"]])
    cut = load_audit(relabelled, "full").set_index("global_round").loc[3]
    assert (cut["label_status"], bool(cut["label_cut"]), cut["deceptive"]) == ("failed", True, None)


def test_auditors_are_listed_by_creation_time(tmp_path: Path) -> None:
    run = write_run(tmp_path, "r", {"s1": [R(1, label=(False, [], 0))]},
                    extra_auditors={"late": ("window", {"s1": [(True, [F], 1)]})})
    for aid, created in (("full", "2025-02-01T00:00:00Z"), ("late", "2025-01-01T00:00:00Z")):
        (run / "audit" / aid / "auditor.json").write_text(json.dumps({"auditor_id": aid, "created_at": created}))
    found = list_auditors(run)
    assert [a.auditor_id for a in found] == ["late", "full"]
    assert found[0] == AuditorInfo("late", "window", 6, 1, "2025-01-01T00:00:00Z")
    assert round_labels(run)[0] == "full"  # the headline is still the full-mode auditor
