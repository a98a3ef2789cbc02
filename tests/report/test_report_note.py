"""Issue 39 item 2: the demo's report says what the demo cut. `lhd report --note TEXT` puts the
caller's line under the report's title and at the top of summary.md, escaped like any text."""
from __future__ import annotations

from pathlib import Path

from support.synthetic import R, write_run
from typer.testing import CliRunner

from lhd_train.cli.app import app

NOTE = "cut: 1 trial <b>x</b> 1 task & best-of-1"


def test_the_note_opens_the_report_and_its_summary_escaped(tmp_path: Path) -> None:
    run = write_run(tmp_path, "base", {"s1": [R(1, None, label=(False, [], 0))]})
    res = CliRunner().invoke(app, ["report", str(run), "--out", str(tmp_path / "report"), "--note", NOTE])
    assert res.exit_code == 0, res.output
    html = (tmp_path / "report" / "report.html").read_text()
    header = html[html.index('<header class="top">'):html.index("</header>")]
    assert '<p class="note" id="note">cut: 1 trial &lt;b&gt;x&lt;/b&gt; 1 task &amp; best-of-1</p>' in header
    assert "<b>x</b>" not in html
    summary = (tmp_path / "report" / "summary.md").read_text().splitlines()
    assert summary[:3] == ["# LH-Deception report", "", f"Note: {NOTE}"]


def test_without_a_note_the_report_has_none(tmp_path: Path) -> None:
    run = write_run(tmp_path, "base", {"s1": [R(1, None, label=(False, [], 0))]})
    res = CliRunner().invoke(app, ["report", str(run), "--out", str(tmp_path / "report")])
    assert res.exit_code == 0, res.output
    assert 'id="note"' not in (tmp_path / "report" / "report.html").read_text()
    assert not any(line.startswith("Note:") for line in (tmp_path / "report" / "summary.md").read_text().splitlines())
