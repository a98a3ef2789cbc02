"""`lhd report` and `lhd view`: the HTML report and the trajectory viewer."""
from __future__ import annotations

from pathlib import Path

import typer

from lhd_train.console import console

app = typer.Typer()
HEADLINE_HELP = ("headline auditor id (default: the run config's auditor in full mode, else the first full-mode "
                 "auditor created; never by file time)")


@app.command("report")
def report_cmd(
    runs: list[Path] = typer.Argument(..., help="one or more run directories, compared side by side; every run "
                                      "after the first is also compared with the first (the base) seed by seed"),
    out: Path = typer.Option(..., "--out", help="output folder for report.html, tables/, summary.md (refused when "
                             "it is a file, a run directory or inside a run's own files; the runs are only read)"),
    auditor: str | None = typer.Option(None, "--auditor", help=HEADLINE_HELP),
    min_coverage: float = typer.Option(0.9, "--min-coverage",
                                       help="flag trials whose valid labels cover less than this share of rounds"),
) -> None:
    """Metrics with intervals, plots and trajectory pages in one self-contained report.

    `lhd report BASE ADAPTER`: also the effect paired by seed, with a bootstrap interval and a sign test."""
    from lhd_train.report import build_report

    path = build_report(list(runs), out, auditor, min_coverage)
    console.print(f"report: {path}\ntables: {Path(out) / 'tables'}  summary: {Path(out) / 'summary.md'}")


@app.command("view")
def view_cmd(
    run: Path = typer.Argument(..., help="run directory"),
    out: Path | None = typer.Option(None, "--out", help="default: RUN/view"),
    auditor: str | None = typer.Option(None, "--auditor", help=HEADLINE_HELP),
) -> None:
    """Static chat-style HTML pages, one per trial, with the auditor's labels."""
    from lhd_train.report import build_viewer

    path = build_viewer(run, out, auditor)
    console.print(f"viewer: {path}")
