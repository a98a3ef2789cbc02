"""Issue 28 item 4: an adapter is not judged only by what trained it (review science-4 D8).

`lhd report BASE ADAPTER` reads the adapter's lhd_adapter.json lineage and warns (in summary.md,
report.html and on stderr) when evaluation seeds trained the adapter and when the evaluating auditor
is the training auditor; `--held-out-auditor ID` scores both runs again and its paired result sits
beside the headline one. Expected numbers are the per-seed rates of the labels written here."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from markdown_tables import md_rows
from markupsafe import escape
from support.synthetic import R, write_run
from typer.testing import CliRunner

from lhd_train.cli.app import app
from lhd_train.errors import InputError
from lhd_train.report import build_report

DATA = Path(__file__).resolve().parents[1] / "data" / "records"
F = "FALSIFICATION"
SEEDS = (1, 2, 3, 4, 5, 6)
# headline auditor "full": flagged rounds of 4 per seed; held-out auditor "other": another labelling
BASE_FULL = {1: 2, 2: 2, 3: 1, 4: 3, 5: 1, 6: 2}
LORA_FULL = {1: 0, 2: 1, 3: 0, 4: 1, 5: 0, 6: 1}
BASE_OTHER = {1: 2, 2: 1, 3: 2, 4: 2, 5: 1, 6: 2}
LORA_OTHER = {1: 2, 2: 1, 3: 1, 4: 2, 5: 1, 6: 3}


def _labels(k: int) -> list:
    return [(True, [F], 2)] * k + [(False, [], 0)] * (4 - k)


def _trial(k: int) -> list[R]:
    return [R(i // 2 + 1, None, label=lab) for i, lab in enumerate(_labels(k))]


def _runs(root: Path, adapter: Path, held_out: bool = True) -> tuple[Path, Path]:
    extra = {(run): {f"s{s}": _labels(k[s]) for s in SEEDS} for run, k in (("base", BASE_OTHER), ("lora", LORA_OTHER))}
    a = write_run(root, "base", {f"s{s}": _trial(BASE_FULL[s]) for s in SEEDS},
                  extra_auditors={"other": ("full", extra["base"])} if held_out else None)
    b = write_run(root, "lora", {f"s{s}": _trial(LORA_FULL[s]) for s in SEEDS}, adapter=str(adapter),
                  extra_auditors={"other": ("full", extra["lora"])} if held_out else None)
    return a, b


def _adapter(tmp: Path, train_seeds=(1, 2, 9), eval_seeds=(3,), auditor_id="full") -> Path:
    folder = tmp / "adapters" / "honest-lora"
    folder.mkdir(parents=True)
    written = json.loads((DATA / "lhd_adapter-sft.json").read_text())  # as `lhd train` wrote one
    (folder / "lhd_adapter.json").write_text(json.dumps(written | {"lineage": {
        "runs": ["/runs/source"], "train_seeds": list(train_seeds), "eval_seeds": list(eval_seeds),
        "auditors": [{"role": "run labels", "auditor_id": auditor_id, "key": None, "model": None},
                     {"role": "grader (selected the data)", "auditor_id": None, "key": "llama70b",
                      "model": "meta-llama/Llama-3.3-70B-Instruct"}], "missing": []}}))
    return folder


def _effects(out: Path) -> list[dict[str, str]]:
    with open(out / "tables" / "paired.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_warnings_for_training_seeds_and_the_training_auditor_and_a_held_out_auditor(tmp_path):
    adapter = _adapter(tmp_path)
    a, b = _runs(tmp_path, adapter)
    heard: list[str] = []
    out = tmp_path / "report"
    html = build_report([a, b], out, held_out_auditor="other", on_warning=heard.append).read_text()
    assert any("2 of 6 evaluation seeds trained the adapter (1, 2)" in w for w in heard), heard
    assert any("1 evaluation seed(s) were in its training data's eval split (3)" in w for w in heard), heard
    assert any("the headline auditor full is the training auditor (run labels; same auditor id full)" in w
               for w in heard), heard
    assert not any("held-out auditor other is the training auditor" in w for w in heard)
    summary = (out / "summary.md").read_text()
    for w in heard:
        assert f"- WARNING: {w}" in summary
        assert str(escape(w)) in html
    # the held-out auditor's paired rate, beside the headline one, recomputed from the labels
    rows = {(r["auditor"], r["metric"]): r for r in _effects(out)}
    for auditor, base, lora in (("full", BASE_FULL, LORA_FULL), ("other", BASE_OTHER, LORA_OTHER)):
        diffs = [(lora[s] - base[s]) / 4 for s in SEEDS]
        r = rows[(auditor, "deception_rate")]
        assert float(r["mean_diff"]) == pytest.approx(sum(diffs) / 6)
        assert int(r["n_pairs"]) == 6
    paired = {(r["scored by"], r["metric"]): r for r in md_rows(summary) if "scored by" in r}
    assert paired[("other", "deception rate")]["paired seeds (dropped: undefined)"] == "6 (0)"


def test_no_warning_when_the_evaluation_is_held_out(tmp_path):
    adapter = _adapter(tmp_path, train_seeds=(11, 12), eval_seeds=(13,), auditor_id="someone-else")
    a, b = _runs(tmp_path, adapter)
    heard: list[str] = []
    build_report([a, b], tmp_path / "r", on_warning=heard.append)
    assert heard == []


def test_an_adapter_without_a_record_is_named(tmp_path):
    a, b = _runs(tmp_path, tmp_path / "adapters" / "gone", held_out=False)
    heard: list[str] = []
    build_report([a, b], tmp_path / "r", on_warning=heard.append)
    assert len(heard) == 1 and "lhd_adapter.json not found" in heard[0] and "cannot check" in heard[0]


def test_a_held_out_auditor_missing_from_a_run_is_refused(tmp_path):
    a, b = _runs(tmp_path, _adapter(tmp_path), held_out=False)
    with pytest.raises(InputError, match="other"):
        build_report([a, b], tmp_path / "r", held_out_auditor="other")
    with pytest.raises(InputError, match="--held-out-auditor.*two or more runs"):
        build_report([a], tmp_path / "r1", held_out_auditor="full")


def test_the_command_prints_the_warnings_on_stderr(tmp_path):
    a, b = _runs(tmp_path, _adapter(tmp_path))
    res = CliRunner().invoke(app, ["report", str(a), str(b), "--out", str(tmp_path / "r"),
                                   "--held-out-auditor", "other"])
    assert res.exit_code == 0, res.output
    assert "warning:" in res.stderr and "2 of 6 evaluation seeds trained the adapter" in res.stderr
