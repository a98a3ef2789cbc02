"""Where a stage may put what it makes (`--out`): never into the files of a run directory.

`lhd data RUN --out RUN/trials` would write `dataset/` and `candidates.jsonl` among the trial
files, where every reader of the run then finds them; `--out` naming a file would fail half-way.
Every command that takes `--out` calls `check_out_dir` first, before any model loads. Folders of
their own inside a run (`RUN/data/...`, `RUN/view`, `RUN/report`) stay allowed: they are beside
the run's files, not among them."""
from __future__ import annotations

from pathlib import Path

from lhd_train.errors import InputError
from lhd_train.rundir.layout import AUDIT, CONFIG, LOCK, LOGS, MANIFEST, SCHEDULES, SUMMARY, TASKS, TRIALS, RunDir

#: the entries of a run directory that belong to the run (docs/formats.md, "Run directory")
RUN_PARTS = (TRIALS, SCHEDULES, LOGS, AUDIT, CONFIG, MANIFEST, SUMMARY, TASKS, LOCK)


def enclosing_run(path: Path) -> tuple[Path, Path] | None:
    """(run directory, path relative to it) for the nearest run directory at or above `path`."""
    p = Path(path).absolute()
    for d in (p, *p.parents):
        if RunDir(d).is_run():
            return d, p.relative_to(d)
    return None


def check_out_dir(out: Path, flag: str = "--out", what: str = "output") -> None:
    """Refuse an `--out` that is a file, a run directory itself, or inside a run's own files."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InputError("command line", flag, f"{out} is a file; the {what} goes into a folder", "a folder")
    found = enclosing_run(out)
    if found is None:
        return
    run, rel = found
    if not rel.parts:
        raise InputError("command line", flag, f"{out} is a run directory; the {what} would mix with its files",
                         f"a folder outside it, or beside its files (e.g. {run / 'data' / out.name})")
    if rel.parts[0] in RUN_PARTS:
        raise InputError("command line", flag, f"{out} is inside {run / rel.parts[0]}, a part of the run {run}; "
                         f"the {what} would mix with the run's files",
                         f"a folder outside {', '.join(RUN_PARTS[:4])} (e.g. {run / 'data'})")
