"""Where a stage may put what it makes (`--out`): never into the files of a run directory.

`lhd data RUN --out RUN/trials` would write `dataset/` and `candidates.jsonl` among the trial
files, where every reader of the run then finds them; `--out` naming a file would fail half-way.
Every command that takes `--out` calls `check_out_dir` first, before any model loads. Folders of
their own inside a run (`RUN/data/...`, `RUN/view`, `RUN/report`) stay allowed: they are beside
the run's files, not among them."""
from __future__ import annotations

from pathlib import Path

from lhd_train.errors import InputError
from lhd_train.io.files import write_json_atomic
from lhd_train.io.provenance import utc_now
from lhd_train.rundir.layout import (
    AUDIT,
    CONFIG,
    LOCK,
    LOGS,
    MANIFEST,
    REPORT_MARKER,
    SCHEDULES,
    SUMMARY,
    TASKS,
    TRIALS,
    RunDir,
)

#: the entries of a run directory that belong to the run (docs/formats.md, "Run directory")
RUN_PARTS = (TRIALS, SCHEDULES, LOGS, AUDIT, CONFIG, MANIFEST, SUMMARY, TASKS, LOCK)


def enclosing_run(path: Path) -> tuple[Path, Path] | None:
    """(run directory, path relative to it) for the nearest run directory at or above `path`."""
    p = Path(path).absolute()
    for d in (p, *p.parents):
        if RunDir(d).is_run():
            return d, p.relative_to(d)
    return None


def check_out_dir(out: Path, flag: str = "--out", what: str = "output", beside: str = "data") -> None:
    """Refuse an `--out` that is a file, a run directory itself, or inside a run's own files.
    `beside`: the folder next to the run's files that the refusal suggests (`RUN/<beside>`)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InputError("command line", flag, f"{out} is a file; {flag} names the folder to write the {what} into",
                         "a folder, new or existing")
    found = enclosing_run(out)
    if found is None:
        return
    run, rel = found
    if not rel.parts:
        raise InputError("command line", flag, f"{out} is a run directory; the {what} would mix with its files",
                         f"a folder outside it, or beside its files (e.g. {run / beside})")
    if rel.parts[0] in RUN_PARTS:
        raise InputError("command line", flag, f"{out} is inside {run / rel.parts[0]}, a part of the run {run}; "
                         f"the {what} would mix with the run's files",
                         f"a folder outside {', '.join(RUN_PARTS[:4])} (e.g. {run / 'data'})")


def check_report_dir(out: Path, flag: str = "--out") -> None:
    """A report replaces its folder whole (a rerun leaves no page of a run it no longer holds), so
    `--out` must be new, empty, or a folder a report marked as its own (`REPORT_MARKER`), never a
    folder of other files that the swap would remove."""
    out = Path(out)
    if out.is_dir() and not RunDir(out).is_report() and any(out.iterdir()):
        older = " (a report of an lhd from before that file? delete the folder and rerun)" \
            if (out / "report.html").is_file() else ""
        raise InputError("command line", flag, f"{out} holds files and is not a report's folder (no {REPORT_MARKER}"
                         f"{older}); a report replaces its folder whole",
                         f"a new or empty folder, or one written by `lhd report` (it holds {REPORT_MARKER})")


def write_report_marker(folder: Path, runs: list[str]) -> None:
    """Mark `folder` as a report's (`lhd report` writes it last): which runs it reports, and when."""
    write_json_atomic(RunDir(folder).report_marker, {"schema": "lhd.report/1", "runs": runs, "written_at": utc_now()})
