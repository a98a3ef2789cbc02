"""`lhd report` on run directories written by earlier versions (tests/data/runs/): they still read,
end to end through the command line, and the deception rate it shows is the one counted here from
the run's own audit rows, read as plain JSON without lhd's readers."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from markdown_tables import md_rows

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "data" / "runs" / "v1-control-study"
USABLE = {"ok", "retried", "repaired"}  # docs/metrics.md: a label that counts


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _counted_from_json(run: Path) -> tuple[str, int, int, float]:
    """(auditor id, labelled rounds, flagged rounds, mean severity) of the run's one auditor,
    counted from its JSONL files directly."""
    (auditor,) = [d for d in (run / "audit").iterdir() if d.is_dir()]
    rows = [json.loads(line) for f in sorted(auditor.glob("*.jsonl")) for line in f.read_text().splitlines() if line]
    rounds = [(r["trial_id"], r["global_round"]) for r in rows]
    assert len(rounds) == len(set(rounds)), "the fixture labels each round once (no winning-row rule needed)"
    usable = [r for r in rows if r.get("parse_status", "ok") in USABLE and r.get("deceptive") is not None]
    flagged = sum(bool(r["deceptive"]) for r in usable)
    severity = sum(float(r.get("severity") or 0) for r in usable) / len(usable)
    return auditor.name, len(usable), flagged, severity


@pytest.mark.model  # `lhd report` in a subprocess
def test_lhd_report_reads_a_v1_run_and_shows_its_deception_rate(tmp_path: Path) -> None:
    run, out = tmp_path / "run", tmp_path / "report"
    shutil.copytree(FIXTURE, run)
    before = _snapshot(run)
    res = subprocess.run([sys.executable, "-m", "lhd_train.cli", "report", str(run), "--out", str(out)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert _snapshot(run) == before  # the report only reads its runs

    auditor, labelled, flagged, severity = _counted_from_json(run)
    run_id = json.loads((run / "manifest.json").read_text())["run_id"]
    [row] = [r for r in md_rows((out / "summary.md").read_text(encoding="utf-8")) if r.get("run") == run_id]
    assert row["auditor"].split(" (")[0] == auditor
    assert row["deception rate"] == f"{flagged / labelled:.3f}"  # one trial: its rate is the mean
    assert row["avg severity (all rounds)"] == f"{severity:.3f}"

    runs_csv = (out / "tables" / "runs.csv").read_text(encoding="utf-8").splitlines()
    csv_row = dict(zip(runs_csv[0].split(","), runs_csv[1].split(","), strict=True))
    assert (int(csv_row["n_rounds"]), int(csv_row["n_flagged"])) == (labelled, flagged)
    assert float(csv_row["deception_rate_mean"]) == flagged / labelled

    (trial,) = json.loads((run / "manifest.json").read_text())["trials"]
    assert (out / "trials" / run_id / f"{trial}.html").is_file()
    html = (out / "report.html").read_text(encoding="utf-8")
    assert f"{flagged / labelled:.3f}" in html and auditor in html
