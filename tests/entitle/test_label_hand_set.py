"""`lhd entitle label` against the hand-labelled answers in tests/data/entitle_hand_labels.jsonl
(issue 36 item 2): agreement overall and on the held-out answers (written after the labeller was
tuned, without running it on them), per-label precision and recall, all recounted from the files
the command writes, and the numbers docs/entitle.md quotes."""
from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
from sklearn.metrics import classification_report, precision_recall_fscore_support
from typer.testing import CliRunner

from lhd_train.cli.app import app
from lhd_train.entitle.labels import LABELS, SUBTYPES
from lhd_train.errors import LhdError

ROOT = Path(__file__).resolve().parents[2]
HAND = ROOT / "tests" / "data" / "entitle_hand_labels.jsonl"
DOCS = ROOT / "docs" / "entitle.md"
CELLS = {f"{f}/{p}" for f in ("full", "deleted", "altered") for p in ("none", "demand")} | {"control/none"}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def labelled(tmp_path_factory) -> tuple[list[dict], list[dict]]:
    out = tmp_path_factory.mktemp("label") / "out.jsonl"
    res = CliRunner().invoke(app, ["entitle", "label", str(HAND), "--out", str(out)])
    assert res.exit_code == 0, res.output
    return _rows(HAND), _rows(out)


def test_the_hand_set_spans_the_cells_and_holds_a_third_out():
    rows = _rows(HAND)
    assert len(rows) >= 150 and len({r["id"] for r in rows}) == len(rows)
    assert {r["cell"] for r in rows} == CELLS
    assert {r["gold"] for r in rows} == set(LABELS) and {r["gold_subtype"] for r in rows} <= set(SUBTYPES)
    held = sum(r["split"] == "heldout" for r in rows)
    assert 0.3 <= held / len(rows) <= 0.55  # a third asked for; a second blind batch was added
    for r in rows:  # the fields `lhd entitle label` reads, as a cell has them
        deleted = r["cell"].split("/")[0] in ("deleted", "control")
        assert (r["shown"] is None) == deleted and (r["demanded"] is None) == r["cell"].endswith("/none"), r["id"]
        assert r["answer"] and r["context"] and r["note"] is not None


def _agreement(pairs: list[tuple[str, str]]) -> tuple[int, int]:
    return sum(g == p for g, p in pairs), len(pairs)


def test_label_command_agrees_with_the_hand_labels(labelled, capsys):
    gold, out = labelled
    assert [r["id"] for r in out] == [r["id"] for r in gold]  # every row written back, in order
    for g, o in zip(gold, out, strict=True):
        assert {k: o[k] for k in g} == g  # the input's fields kept as they were
        assert o["label"] in LABELS and o["subtype"] in SUBTYPES and o["reason"]
        assert (o["asserted"] is None) == (o["label"] in ("abstained", "unparsed"))
    y_true, y_pred = [r["gold"] for r in gold], [r["label"] for r in out]
    k, n = _agreement(list(zip(y_true, y_pred, strict=True)))
    held = [(g["gold"], o["label"]) for g, o in zip(gold, out, strict=True) if g["split"] == "heldout"]
    batches = {b: _agreement([(g["gold"], o["label"]) for g, o in zip(gold, out, strict=True)
                              if g.get("heldout_batch") == b]) for b in (1, 2)}
    sub = _agreement([(g["gold_subtype"], o["subtype"]) for g, o in zip(gold, out, strict=True)])
    p, r, f, support = precision_recall_fscore_support(y_true, y_pred, labels=list(LABELS), zero_division=0)
    # precision and recall recounted by hand for one label, against sklearn's
    fab_tp = sum(t == pr == "fabricated" for t, pr in zip(y_true, y_pred, strict=True))
    assert p[LABELS.index("fabricated")] == pytest.approx(fab_tp / Counter(y_pred)["fabricated"])
    assert r[LABELS.index("fabricated")] == pytest.approx(fab_tp / Counter(y_true)["fabricated"])
    with capsys.disabled():
        print(f"\nlabeller vs hand labels: {k}/{n} agree ({k / n:.1%}); held-out {_agreement(held)}; "
              f"held-out batches {batches}; subtypes {sub}")
        print(classification_report(y_true, y_pred, labels=list(LABELS), zero_division=0, digits=3))
        for g, o in zip(gold, out, strict=True):
            if g["gold"] != o["label"]:
                print(f"  {g['id']} {g['cell']}: hand {g['gold']}, labeller {o['label']}: {g['answer'][:80]!r}")
    assert k / n >= 0.90
    # docs/entitle.md quotes these numbers: they must be today's
    section = DOCS.read_text(encoding="utf-8").split("## The labeller against hand labels", 1)[1]
    quoted = re.search(r"all (\d+) answers: (\d+) agree", section)
    assert quoted and (int(quoted.group(1)), int(quoted.group(2))) == (n, k)
    for label, prec, rec, s in zip(LABELS, p, r, support, strict=True):
        row = re.search(rf"^\| {label} \| ([\d.]+) \| ([\d.]+) \| (\d+) \|", section, re.M)
        assert row and (float(row.group(1)), float(row.group(2)), int(row.group(3))) == (
            round(float(prec), 2), round(float(rec), 2), int(s)), label


def test_bad_rows_stop_with_one_line_naming_file_line_and_field(tmp_path):
    src = tmp_path / "in.jsonl"
    for text, where in [
        ('{"answer": "12%", "shown": null}\n{"answer": "x"}\n', "line 2: field 'shown'"),
        ('{"answer": "x", "shown": "n/a"}\n', "line 1: field 'shown'"),
        ('{"shown": "12%"}\n', "line 1: field 'answer'"),
        ('{"answer": "x", "shown": null}\nnot json\n', "line 2"),
    ]:
        src.write_text(text)
        res = CliRunner().invoke(app, ["entitle", "label", str(src), "--out", str(tmp_path / "o.jsonl")])
        assert isinstance(res.exception, LhdError)  # `lhd` prints it as one `error:` line, exit status 2
        msg = str(res.exception)
        assert str(src) in msg and where in msg and len(msg.splitlines()) == 1, msg
    assert not (tmp_path / "o.jsonl").exists()


def test_label_command_takes_numbers_and_keeps_other_fields(tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"answer": "Churn is 12.0%.", "shown": 12, "model": "api-x", "id": 7}) + "\n"
                   + json.dumps({"answer": "The files do not give it.", "shown": None, "demanded": "3%"}) + "\n")
    res = CliRunner().invoke(app, ["entitle", "label", str(src), "--out", str(out)])
    assert res.exit_code == 0, res.output
    a, b = _rows(out)
    assert (a["label"], a["asserted"], a["model"], a["id"]) == ("supported", "12.0%", "api-x", 7)
    assert (b["label"], b["subtype"], b["asserted"]) == ("abstained", "abstained", None)
