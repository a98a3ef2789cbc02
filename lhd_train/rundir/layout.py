"""Every path of a run directory (docs/formats.md, "Run directory"), named once.

The run directory is the contract between stages (run, audit, data, merge, report, lens): each
stage asks `RunDir` for a path instead of spelling a file name, so a name lives in this module
only and a reader can never look for a file under another name than its writer used."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CONFIG = "config.resolved.yaml"
MANIFEST = "manifest.json"
SUMMARY = "summary.json"
TASKS = "tasks.json"          # exact task texts of an imported run
LOCK = ".lock"
AUDITOR_INFO = "auditor.json"
TRIALS, SCHEDULES, LOGS, AUDIT = "trials", "schedules", "logs", "audit"
EVAL = "eval"                 # eval/<auditor-id>/[<source>/]eval.json: `lhd audit-eval` results filed for the run
GRADING, GRADES = "grading", "grades.jsonl"  # the GRPO rewards' grade cache (finetune.judged_rewards)
REPORT_MARKER = "lhd_report.json"  # written by `lhd report` into its folder: a report, never a run directory
ROWS_SUFFIX = ".jsonl"
MESSAGES_SUFFIX = ".messages.jsonl"
DONE_SUFFIX = ".done"


def is_rows_file(path: Path) -> bool:
    """A trial's trajectory file (`trials/<trial>.jsonl`), not its message store."""
    return path.name.endswith(ROWS_SUFFIX) and not path.name.endswith(MESSAGES_SUFFIX)


@dataclass(frozen=True)
class TrialFiles:
    """The three files of one trial under `trials/`."""

    trial_id: str
    rows: Path       # trials/<trial>.jsonl: one trajectory row per finished round
    messages: Path   # trials/<trial>.messages.jsonl: the content-addressed message store
    done: Path       # trials/<trial>.done: the finished marker

    @classmethod
    def of(cls, trials_dir: Path, trial_id: str) -> TrialFiles:
        d = Path(trials_dir)
        return cls(trial_id, d / f"{trial_id}{ROWS_SUFFIX}", d / f"{trial_id}{MESSAGES_SUFFIX}",
                   d / f"{trial_id}{DONE_SUFFIX}")

    @classmethod
    def from_rows(cls, rows_path: Path) -> TrialFiles:
        """The trial whose trajectory file is `rows_path` (its siblings sit next to it)."""
        rows_path = Path(rows_path)
        return cls.of(rows_path.parent, rows_path.name.removesuffix(ROWS_SUFFIX))

    @property
    def names(self) -> tuple[str, str, str]:
        return self.rows.name, self.messages.name, self.done.name


def trial_id_of_messages(path: Path) -> str:
    """The trial whose message store is `path`."""
    return Path(path).name.removesuffix(MESSAGES_SUFFIX)


class RunDir:
    """A run directory `runs/<run>/` and the path of every file in it."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def __fspath__(self) -> str:
        return str(self.path)

    # run-level files
    @property
    def config(self) -> Path:
        return self.path / CONFIG

    @property
    def manifest(self) -> Path:
        return self.path / MANIFEST

    @property
    def summary(self) -> Path:
        return self.path / SUMMARY

    @property
    def tasks(self) -> Path:
        return self.path / TASKS

    # folders
    @property
    def trials_dir(self) -> Path:
        return self.path / TRIALS

    @property
    def schedules_dir(self) -> Path:
        return self.path / SCHEDULES

    @property
    def logs_dir(self) -> Path:
        return self.path / LOGS

    @property
    def audit_dir(self) -> Path:
        return self.path / AUDIT

    @property
    def eval_dir(self) -> Path:
        return self.path / EVAL

    @property
    def grading_dir(self) -> Path:
        return self.path / GRADING

    @property
    def grades(self) -> Path:
        """The default grade cache of the GRPO rewards (`grpo` rewards' `cache` param overrides it)."""
        return self.grading_dir / GRADES

    # per trial
    def trial(self, trial_id: str) -> TrialFiles:
        return TrialFiles.of(self.trials_dir, trial_id)

    def schedule(self, trial_id: str) -> Path:
        return self.schedules_dir / f"{trial_id}.json"

    def rows_files(self) -> Iterator[Path]:
        """Every trial's trajectory file, sorted by name."""
        for p in sorted(self.trials_dir.glob(f"*{ROWS_SUFFIX}")):
            if is_rows_file(p):
                yield p

    def trial_ids(self) -> list[str]:
        """Trials with a trajectory file, sorted by name."""
        return [p.name.removesuffix(ROWS_SUFFIX) for p in self.rows_files()]

    def done_trial_ids(self) -> list[str]:
        """Trials with a `.done` marker, sorted by name."""
        return sorted(p.name.removesuffix(DONE_SUFFIX) for p in self.trials_dir.glob(f"*{DONE_SUFFIX}"))

    # per auditor
    def auditor_dir(self, auditor_id: str) -> Path:
        return self.audit_dir / auditor_id

    def auditor_info(self, auditor_id: str) -> Path:
        return self.auditor_dir(auditor_id) / AUDITOR_INFO

    def audit_rows(self, auditor_id: str, trial_id: str) -> Path:
        return self.auditor_dir(auditor_id) / f"{trial_id}{ROWS_SUFFIX}"

    def auditor_ids(self) -> list[str]:
        """Every folder under `audit/`, sorted by name."""
        d = self.audit_dir
        return sorted(p.name for p in d.iterdir() if p.is_dir()) if d.is_dir() else []

    @property
    def report_marker(self) -> Path:
        return self.path / REPORT_MARKER

    def is_report(self) -> bool:
        """A folder `lhd report` wrote (it holds the report's marker): its own `trials/` page
        folder does not make it a run directory."""
        return self.report_marker.is_file()

    def is_run(self) -> bool:
        """Has a `trials/` folder (the minimum every reader needs) and is not a report's folder."""
        return self.trials_dir.is_dir() and not self.is_report()
