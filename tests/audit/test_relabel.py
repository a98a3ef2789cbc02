"""Issue 31, item 4: a failed relabel of a round first labelled while its trial was unfinished.

`lhd audit --include-unfinished` labels a growing trial and flags those rows `trial_unfinished`;
once the trial has its `.done` marker the next audit labels those rounds again. Before, when that
relabel failed (no parsable answer), the winning-row rule ("a failed row never replaces a usable
one") kept the label made from the partial trajectory: it kept counting in the report, which said
nothing; the audit kept advising "rerun once the trial is finished" although it was; and every
rerun appended another failed row for the same round."""
from __future__ import annotations

from support.scripted import ScriptedBackend
from support.synthetic import LABEL_IDS
from test_auditor import answer, audit, auditor_script, make_run, rows_of

from lhd_train.metrics.load import load_run
from lhd_train.rundir.rows import AuditRow
from lhd_train.rundir.run import Run
from lhd_train.rundir.store import winning_audit_rows

FAILS = 2  # the round whose relabel never parses


def test_a_failed_relabel_replaces_the_label_of_the_unfinished_trial(tmp_path):
    cfg, (tid,) = make_run(tmp_path)
    done = cfg.run_dir / "trials" / f"{tid}.done"
    marker = done.read_bytes()
    done.unlink()
    first = audit(cfg, ScriptedBackend(auditor_script(default=answer(True, ["FALSIFICATION"], 3))),
                  include_unfinished=True)
    n = first.totals["rounds"]
    assert n > FAILS and first.totals["partial"] == n
    done.write_bytes(marker)  # the trial finishes

    relabel = audit(cfg, ScriptedBackend(auditor_script({FAILS: "not an answer"}, default=answer(False))))
    assert relabel.totals["relabel"] == n and relabel.totals["failed"] == relabel.totals["relabel_failed"] == 1
    assert relabel.totals["partial"] == 0  # before: 1, and "rerun once the trial is finished"
    label = Run.open(cfg.run_dir).auditor("m-full").labels(tid)[FAILS]
    assert label.parse_status == "failed" and not label.trial_unfinished  # before: the stale flagged label

    rounds = load_run(cfg.run_dir).rounds.set_index("global_round")
    assert rounds.loc[FAILS, "label_status"] == "failed" and rounds.loc[FAILS, "deceptive"] is None
    assert int(rounds["flagged"].sum()) == 0  # no label of the partial trajectory counts any more
    notes = load_run(cfg.run_dir).notes
    assert any("1 round(s) whose audit failed" in n for n in notes), notes

    rows = len(rows_of(cfg, "m-full", tid))
    again = audit(cfg, ScriptedBackend(auditor_script({FAILS: "not an answer"})))
    assert again.totals["audited"] == 0 and len(rows_of(cfg, "m-full", tid)) == rows  # before: one more failed row


def test_the_report_says_when_labels_of_an_unfinished_trial_still_count(tmp_path):
    """Issue 31's last gap: a trial audited while unfinished, finished since and not audited again,
    keeps its partial labels; the report's notes say how many and how to redo them."""
    cfg, (tid,) = make_run(tmp_path)
    done = cfg.run_dir / "trials" / f"{tid}.done"
    marker = done.read_bytes()
    done.unlink()
    first = audit(cfg, ScriptedBackend(auditor_script(default=answer(False))), include_unfinished=True)
    n = first.totals["partial"]
    assert n > 0
    unfinished = [note for note in load_run(cfg.run_dir).notes if "made while the trial was unfinished" in note]
    assert unfinished == []  # still running: the labels are the best there is, and the trial is listed as not finished
    done.write_bytes(marker)  # the trial finishes; no audit since
    notes = [note for note in load_run(cfg.run_dir).notes if "made while the trial was unfinished" in note]
    assert len(notes) == 1 and notes[0].startswith(f"{n} label(s) in 1 trial(s)"), notes
    audit(cfg, ScriptedBackend(auditor_script(default=answer(False))))  # the relabel
    assert not [note for note in load_run(cfg.run_dir).notes if "made while the trial was unfinished" in note]


def _row(g: int, status: str, unfinished: bool | None, deceptive: bool | None) -> AuditRow:
    return AuditRow.model_validate({**LABEL_IDS, "global_round": g, "parse_status": status,
                                    "trial_unfinished": unfinished, "deceptive": deceptive})


def test_the_winning_row_rule_hand_checked():
    """A failed or cut row never replaces a usable label of the finished trial, but does replace
    one made from the unfinished trial; a usable row replaces anything before it."""
    cases = [
        ([("ok", None, True), ("failed", None, None)], "ok"),          # a failed rerun: the label stays
        ([("ok", True, True), ("failed", None, None)], "failed"),      # a failed relabel: the stale label goes
        ([("ok", True, True), ("cut", None, None)], "cut"),
        ([("ok", True, True), ("failed", True, None)], "ok"),          # still unfinished: nothing better yet
        ([("failed", None, None), ("ok", None, False)], "ok"),
        ([("ok", True, True), ("failed", None, None), ("ok", None, False)], "ok"),
    ]
    for rows, want in cases:
        got = winning_audit_rows([_row(1, s, u, d) for s, u, d in rows])[1]
        assert got.parse_status == want, (rows, got)
