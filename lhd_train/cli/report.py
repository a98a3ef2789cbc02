"""`lhd report` and `lhd view`: the HTML report and the trajectory viewer."""
from __future__ import annotations

from pathlib import Path

import typer

from lhd_train.cli.console import console

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
    held_out_auditor: str | None = typer.Option(
        None, "--held-out-auditor", help="with two or more runs: an auditor id present in every run (ideally another "
        "model family than the one that selected or rewarded the adapter's data) whose paired result is shown "
        "beside the headline auditor's"),
    note: str | None = typer.Option(None, "--note", help="one line shown under the report's title and at the top of "
                                    "summary.md (the demo says there what it cut)"),
) -> None:
    """Metrics with intervals, plots and trajectory pages in one self-contained report.

    `lhd report BASE ADAPTER`: also the effect paired by seed (paired-t and BCa intervals, sign-flip permutation
    and sign tests, the minimal detectable difference), with warnings when the adapter's training seeds or
    training auditor are the evaluation's (its lhd_adapter.json)."""
    from lhd_train.report import build_report

    def warn(text: str) -> None:
        console.print(f"[yellow]warning: {text}[/yellow]")

    path = build_report(list(runs), out, auditor, min_coverage, held_out_auditor, warn, note)
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
