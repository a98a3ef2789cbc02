"""`lhd audit`, `lhd import-reference` and `lhd export`. The library functions return; these
print. The audit's options are `config.auditor.AuditCommand` (one declaration for the command
line, YAML and the Slurm audit stage)."""
from __future__ import annotations

import asyncio
from pathlib import Path

import typer
from rich.table import Table

from lhd_train.cli.console import console, shown_markup, table_console
from lhd_train.cli.options import settings_command
from lhd_train.config.auditor import AuditCommand
from lhd_train.errors import InputError
from lhd_train.rundir.run import Run

app = typer.Typer()


def audit_command(s: AuditCommand) -> int:
    """Audit a run; print a summary. Returns the exit status: 0 when every round of every audited
    trial has a row, 3 when some are missing (rerun the same command to finish them)."""
    from lhd_train.audit.runner import audit_run
    from lhd_train.config.auditor import load_auditor_config
    from lhd_train.config.run import check_window

    run = Run.open(s.run).path  # the one "not a run directory" rule, before any model loads
    cfg, source = load_auditor_config(run, s.auditor, s.overrides)
    check_window("auditor", cfg.auditor, cfg.spec, source or run)  # before the model loads
    opts, concurrency = s.options, s.concurrency
    from lhd_train.config.run import preflight

    # Before a server starts: its GPUs visible and not shared, no CPU vLLM for cuda, vLLM's own verdict.
    for note in preflight({cfg.auditor.model: cfg.spec}, source or run):
        console.print(f"[yellow]{note}[/yellow]")
    cap = cfg.spec.in_flight_limit()
    if cap is not None and cap < concurrency:
        console.print(f"[yellow]--concurrency {concurrency}: at most {cap} rounds are in flight, since "
                      f"models.{cfg.auditor.model}.max_in_flight is {cap} in {source or 'the auditor config'}; "
                      "raise it (or leave it unset) to send more[/yellow]")
    summary = asyncio.run(audit_run(run, cfg, opts, config_source=source, progress=s.progress))
    print_audit_summary(summary)
    totals = summary.totals
    if totals["relabel"]:
        console.print(f"{totals['relabel']} round(s) labelled while their trial was unfinished were labelled again "
                      "now that it is finished")
    if totals["relabel_failed"]:
        console.print(f"[yellow]{totals['relabel_failed']} of those relabels failed (no usable answer): the label made "
                      "from the unfinished trial no longer counts; those rounds count as failed[/yellow]")
    if totals["partial"]:
        console.print(f"[yellow]{totals['partial']} label(s) were made from an unfinished trial (trial_unfinished in "
                      "the row); rerun `lhd audit` once the trial is finished to redo them[/yellow]")
    if not summary.complete:
        console.print("[yellow]some rounds have no row yet (model unreachable); run the same command again[/yellow]")
        return 3
    return 0


def print_audit_summary(summary) -> None:  # AuditSummary
    table = Table(title=f"audit {summary.auditor_id} ({summary.seconds:.1f} s)")
    for col in ("trial", "rounds", "on disk", "new", "failed", "repaired", "missing", "flagged", "rate"):
        table.add_column(col, justify="left" if col == "trial" else "right")
    for t in summary.trials:
        if t.skipped:
            table.add_row(t.trial_id, str(t.rounds), "-", "-", "-", "-", "-", "-", f"skipped: {t.skipped}")
            continue
        labelled = t.on_disk
        rate = f"{t.flagged / labelled:.2f}" if labelled else "-"
        table.add_row(t.trial_id, str(t.rounds), str(t.on_disk), str(t.audited), str(t.failed), str(t.repaired),
                      str(t.missing), str(t.flagged), rate)
    table_console().print(table)
    for t in summary.trials:
        for err in t.errors[:5]:
            console.print(f"[red]{t.trial_id}: {shown_markup(err)}[/red]")  # a server's words: text only
    console.print(f"audit rows: {summary.out_dir}")


def import_reference_command(src: Path, out: Path, repair: bool = False) -> int:
    """Import an authors' session folder (or a folder of them) as a run; print what was written."""
    from lhd_train.interop.reference_import import import_reference

    report = import_reference(Path(src), Path(out), repair)
    table = Table(title=f"imported into {out}")
    for col in ("trial", "session", "rounds", "auditors", "note"):
        table.add_column(col)
    for t in report.trials:
        table.add_row(t.trial_id, t.session, str(t.rounds), ", ".join(t.auditors) or "-", t.note or "")
    table_console().print(table)
    return 0


def export_command(run: Path, out: Path, fmt: str = "datasets") -> int:
    """Export a run (trajectory rows + every auditor's labels) as a `datasets` dataset, or as an
    inspect_ai evaluation log (`fmt` "inspect")."""
    if fmt == "inspect":
        from lhd_train.interop.inspect_log import export_inspect

        log = export_inspect(Path(run), Path(out))
        console.print(f"wrote {len(log.samples)} samples (one per performer round) to {out} (open with "
                      f"`inspect view --log-dir {Path(out).parent}`)")
        return 0
    if fmt != "datasets":
        raise InputError("command line", "--format", f"{fmt!r} is not an export format", "datasets, inspect")
    from lhd_train.interop.export import export_run

    ds = export_run(Path(run), Path(out))
    console.print(f"wrote {ds.num_rows} rows, {len(ds.column_names)} columns to {out} "
                  f"(load with datasets.load_from_disk)")
    return 0


@app.command("audit")
@settings_command(AuditCommand)
def audit_cmd(s: AuditCommand) -> None:
    """Label every performer answer of a run for deception (resumable: rerun to finish)."""
    code = audit_command(s)
    if code:
        raise typer.Exit(code)


@app.command("import-reference")
def import_reference_cmd(
    src: Path = typer.Argument(..., help="a reference session folder, or a folder of them"),
    out: Path = typer.Option(..., "--out", help="run directory to write (runs/<name>)"),
    repair_labels: bool = typer.Option(False, "--repair-labels",
                                       help="apply our consistency rules to the authors' labels (default: as written)"),
) -> None:
    """Import the authors' session folders (result.json + detector_*.json) as a run."""
    raise typer.Exit(import_reference_command(src, out, repair_labels))


@app.command("export")
def export_cmd(
    run: Path = typer.Argument(..., help="run directory"),
    out: Path = typer.Option(..., "--out", help="dataset folder (datasets.load_from_disk reads it); with "
                             "--format inspect, a .eval or .json log file"),
    fmt: str = typer.Option("datasets", "--format", help="datasets | inspect (an inspect_ai evaluation log: "
                            "one sample per performer round; needs the `inspect` extra)"),
) -> None:
    """Export a run, with every auditor's labels, as a Hugging Face datasets dataset or an inspect_ai log."""
    raise typer.Exit(export_command(run, out, fmt))
