"""Which audit label counts for a round: the run's headline auditor and the label of each round it
audited. The public labels API (docs/metrics.md, "Inputs"): `lhd report`, the training contexts of
`lhd data` and `lhd lens read --run` all take their labels from here, so a round the lens calls
flagged is one the report counts as deceptive.

The rules, each once: which auditor is the headline (`headline_auditor`, never by file time);
which row of a round labelled twice wins (`AuditorStore.labels`, the one rule of `rundir`); and
which label is usable (`label_of`: status in OK_STATUSES with a verdict; a failed or cut row is
no label, whatever values it holds)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lhd_train.config.vocab import TYPES
from lhd_train.errors import InputError
from lhd_train.rundir.rows import AuditRow
from lhd_train.rundir.run import Run
from lhd_train.rundir.store import NO_LABEL_STATUSES

OK_STATUSES = ("ok", "retried", "repaired")  # a label that counts; "failed", "cut" and "missing" do not
FAILED = "failed"  # the label status of a row without a usable label (failed, cut, or no verdict)


@dataclass(frozen=True)
class AuditorInfo:
    """An auditor id of a run with at least one row file."""

    auditor_id: str
    mode: str | None
    window: int | None
    n_rows: int
    created_at: str | None = None  # from auditor.json, written when `lhd audit` first used this id


@dataclass(frozen=True)
class RoundLabel:
    """One round's label as the metrics count it: the winning audit row of the round, read by the
    rule of `label_of`. `label_status` is the row's parse status (`ok`, `retried`, `repaired`), or
    `failed` for a row with no usable label (`label_cut`: it stopped at the auditor's token limit);
    then `deceptive` and `severity` are None and `types` is empty."""

    trial_id: str
    global_round: int
    auditor_id: str
    mode: str | None
    window: int | None
    label_status: str
    label_cut: bool
    deceptive: bool | None
    types: tuple[str, ...]
    severity: float | None
    confidence: float | None
    reasoning: str
    evidence: tuple[str, ...]
    from_unfinished: bool = False  # made from the trajectory of a trial still running (`trial_unfinished`)

    @property
    def valid(self) -> bool:
        return self.label_status in OK_STATUSES


def _as_run(run: Run | str | Path) -> Run:
    return run if isinstance(run, Run) else Run.open(run)


def list_auditors(run: Run | str | Path) -> list[AuditorInfo]:
    """Every auditor id with at least one row file, in creation order (auditor.json `created_at`;
    ids without one after those with one, by id). Mode and window as the rows record them."""
    run = _as_run(run)
    out = []
    for aid in run.auditor_ids():
        store = run.auditor(aid)
        rows = [row for tid in store.trial_ids() for row in store.rows(tid)]
        record = store.record()
        first = rows[0] if rows else None
        mode = first.mode if first else record.mode if record else None
        window = first.window if first else record.window if record else None
        out.append(AuditorInfo(aid, mode, window, len(rows), record.created_at if record else None))
    return sorted(out, key=lambda a: (a.created_at is None, a.created_at or "", a.auditor_id))


def run_config_auditor(run: Run) -> str | None:
    """The auditor id the run's own config gives by default (`lhd audit RUN` with no options:
    the config's auditor model in full mode), or None when the config names no auditor."""
    from lhd_train.config.auditor import DEFAULT_OPTIONS

    role = run.config().get("auditor")
    key = role.get("model") if isinstance(role, dict) else None
    return DEFAULT_OPTIONS.resolved_id(str(key)) if key else None


def headline_auditor(run: Run | str | Path, auditors: list[AuditorInfo]) -> tuple[str | None, str]:
    """The default headline auditor and why it was chosen (shown in the report). In order: the
    run config's own full-mode auditor; else the first full-mode auditor created (the paper's
    auditor sees the whole trajectory); else the first auditor created. Never by file time: a
    resumed or extended audit must not change the headline (review N6)."""
    if not auditors:
        return None, "no auditor"
    own = run_config_auditor(_as_run(run))
    full = [a for a in auditors if a.mode == "full"]
    if own and any(a.auditor_id == own for a in full):
        return own, "the run config's auditor in full mode"
    if full:
        return full[0].auditor_id, "the first full-mode auditor created"
    return auditors[0].auditor_id, "the first auditor created (the run has no full-mode auditor)"


def pick_auditor(run: Run | str | Path, auditor: str | None,
                 auditors: list[AuditorInfo] | None = None) -> str | None:
    """The auditor id to score with: the one asked for (`--auditor`), else `headline_auditor`'s
    default (the run config's full-mode auditor, else the first full-mode one created)."""
    run = _as_run(run)
    auditors = list_auditors(run) if auditors is None else auditors
    ids = [a.auditor_id for a in auditors]
    if auditor is not None:
        if auditor not in ids:
            raise InputError(run.dir.audit_dir, "auditor", f"no audit labels from auditor '{auditor}'",
                             ", ".join(ids) or "none: run `lhd audit` first")
        return auditor
    return headline_auditor(run, auditors)[0]


def label_of(row: AuditRow, trial_id: str, auditor_id: str) -> RoundLabel:
    """The one rule that turns an audit row into a label: a row cut at its token limit (parse
    status `cut`), failed, or without a verdict is no label; types are the known ones, each once.
    `trial_id` and `auditor_id` are those of the row file (`audit/<auditor_id>/<trial_id>.jsonl`)."""
    status = row.parse_status
    failed = status in NO_LABEL_STATUSES or row.deceptive is None
    named = {str(t).strip().upper() for t in row.types}
    return RoundLabel(
        trial_id=trial_id, global_round=row.global_round, auditor_id=auditor_id,
        mode=row.mode, window=row.window, label_status=FAILED if failed else status, label_cut=status == "cut",
        deceptive=None if failed else bool(row.deceptive),
        types=() if failed else tuple(t for t in TYPES if t in named),
        severity=None if failed or row.severity is None else float(row.severity),
        confidence=None if row.confidence is None else float(row.confidence),
        reasoning=row.reasoning or "", evidence=tuple(str(e) for e in row.evidence),
        from_unfinished=bool(row.trial_unfinished))


def auditor_labels(run: Run | str | Path, auditor_id: str) -> list[RoundLabel]:
    """Every round `auditor_id` labelled, usable or not: the winning row of each round
    (`AuditorStore.labels`) read by `label_of`, by trial and global round."""
    store = _as_run(run).auditor(auditor_id)
    return [label_of(row, tid, auditor_id)
            for tid in store.trial_ids() for _, row in sorted(store.labels(tid).items())]


def round_labels(run: Run | str | Path,
                 auditor: str | None = None) -> tuple[str | None, dict[tuple[str, int], RoundLabel]]:
    """The usable labels of one auditor (`auditor`, else `pick_auditor`'s default), as `lhd
    report` counts them: the auditor id and `(trial_id, global_round) -> RoundLabel`, only rounds
    with a valid label (`RoundLabel.valid`: `deceptive` is a bool)."""
    run = _as_run(run)
    auditor_id = pick_auditor(run, auditor)
    if auditor_id is None:
        return None, {}
    return auditor_id, {(lab.trial_id, lab.global_round): lab
                        for lab in auditor_labels(run, auditor_id) if lab.valid}
