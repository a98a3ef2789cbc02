"""`lens read --run` labels a round exactly as `lhd report` does, and both agree with labels
computed here, independently, from the audit JSONL files and the documented rule
(docs/metrics.md, "Inputs"): one auditor; per round the last row with a valid verdict wins (a
failed row never replaces a valid one); failed rows give no label."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.synthetic import R, audit_row, write_run

from lens.errors import LensError
from lhd_train.errors import InputError
from lhd_train.metrics import load_run
from lhd_train.reading.runs import load_run_examples

F, C = "FALSIFICATION", "CONCEALMENT"
VALID = ("ok", "retried", "repaired")


@pytest.fixture()
def two_auditors(tmp_path):
    """The full-mode auditor flags round 1 only (round 2 relabelled twice: a valid relabel, then a
    failed one); a window auditor flags rounds 2 and 3 and fails on round 4."""
    run = write_run(tmp_path, "two", {"s1": [
        R(1, None, label=(True, [F], 2)), R(1, None, label=(False, [], 0)),
        R(2, None, label=(False, [], 0)), R(2, None, label=(False, [], 1))]},
        extra_auditors={"win": ("window", {"s1": [(False, [], 0), (True, [F], 3), (True, [F], 4), "failed"]})})
    with open(run / "audit" / "full" / "s1.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(audit_row("s1", 2, True, [C], 3)) + "\n")
        f.write(json.dumps(audit_row("s1", 2, None, [], None, None, parse_status="failed")) + "\n")
    return run


def independent_labels(run_dir: Path, auditor_id: str) -> dict[tuple[str, int], tuple[bool, float, list[str]]]:
    """Straight from the JSONL lines, sharing no code with lhd: the last valid row of each round."""
    out: dict[tuple[str, int], tuple[bool, float, list[str]]] = {}
    for path in sorted((run_dir / "audit" / auditor_id).glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            if (row.get("parse_status") or "ok") in VALID and row.get("deceptive") is not None:
                out[(row["trial_id"], int(row["global_round"]))] = (bool(row["deceptive"]), float(row["severity"]),
                                                                    list(row["types"]))
    return out


def _lens(run_dir: Path, auditor: str | None = None) -> tuple[dict[tuple[str, int], tuple[bool, float, list[str]]],
                                                               list[str]]:
    """The labels of the examples `lens read --run` reads, and the auditors it names."""
    # compact: the synthetic calls hold no history (a full-context read skips later rounds whose
    # call lacks the task's round-1 message); labels do not depend on the context
    examples, info = load_run_examples(run_dir, auditor=auditor, context="compact")
    assert len(examples) == info["n_rows"]  # every round is read, labelled or not
    return {(e.info["trial_id"], e.info["global_round"]): (e.label, float(e.info["severity"]),
                                                           [t for t in e.info["types"].split(",") if t])
            for e in examples if e.label is not None}, info["auditors"]


def _report(run_dir: Path, auditor: str | None = None) -> dict[tuple[str, int], tuple[bool, float, list[str]]]:
    r = load_run(run_dir, auditor).rounds
    return {(t, int(g)): (bool(d), float(s), list(ty))
            for t, g, d, s, ty, ok in zip(r["trial_id"], r["global_round"], r["deceptive"], r["severity"], r["types"],
                                          r["labelled"], strict=True) if ok}


def test_lens_labels_equal_independent_labels_and_the_report(two_auditors):
    labels, auditors = _lens(two_auditors)
    assert auditors == ["full"]  # the report's default auditor (the full-mode one), not every auditor at once
    expected = independent_labels(two_auditors, "full")
    assert expected[("s1", 2)] == (True, 3.0, [C])  # the later valid relabel, not the failed row after it
    assert labels == expected
    assert _report(two_auditors) == expected


def test_lens_labels_follow_a_chosen_auditor(two_auditors):
    labels, auditors = _lens(two_auditors, "win")
    assert auditors == ["win"]
    expected = independent_labels(two_auditors, "win")
    assert ("s1", 4) not in expected and labels == expected == _report(two_auditors, "win")
    with pytest.raises(InputError, match="nope") as exc:  # lhd's own error, unchanged (not a LensError)
        load_run_examples(two_auditors, auditor="nope")
    assert exc.value.field == "auditor" and not isinstance(exc.value, LensError)
