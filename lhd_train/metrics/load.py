"""Read a run directory (docs/formats.md) into tables: one row per round, labels of one auditor joined.

Everything downstream (metrics, report, viewer) works on these tables. The run is read through
`rundir.run.Run` (typed rows, manifest and summary); which auditor and which audit row count is
`metrics.labels`, the public labels API (docs/metrics.md, "Inputs").

Loading only reads: a run being written is read up to its last whole line, a trial without its
`.done` marker counts as unfinished, and a finished trial whose rows disagree with its marker (rows
cut after it was written) is a `DataFileError` naming the file, as `lhd run` treats it, never a
shorter trial. No file of the run is changed (no repair on read)."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import pandas as pd

from lhd_train.config.vocab import STATES, TYPES
from lhd_train.metrics.labels import (
    OK_STATUSES,
    AuditorInfo,
    RoundLabel,
    auditor_labels,
    headline_auditor,
    list_auditors,
    pick_auditor,
)
from lhd_train.rundir.manifest import Manifest, Summary
from lhd_train.rundir.names import parse_trial_id
from lhd_train.rundir.rows import RoundRow, SupervisorRecord
from lhd_train.rundir.run import Run

NO_EVENT = "none"
SUPERVISOR_OK = ("ok", "retried")  # a supervisor round with both calls answered; anything else failed
COVERAGE_MIN = 0.9  # a trial whose valid labels cover less than this share of its rounds is flagged
LABEL_COLUMNS = [f.name for f in fields(RoundLabel)]


@dataclass(frozen=True)
class Performer:
    """The performer model of a run, as recorded (manifest, else its rows, else its config)."""

    model: str | None
    adapter: str | None = None
    revision: str | None = None


@dataclass
class RunData:
    """One run directory loaded with one auditor's labels (or none)."""

    store: Run
    run_id: str
    key: str            # unique among the runs of one report (the run id, suffixed on clashes)
    label: str          # run id + performer model/adapter, for tables and plots
    model_label: str    # performer model + adapter only: groups control-study runs of one model
    performer: Performer
    manifest: Manifest  # an empty one when the run has no manifest.json
    summary: Summary | None
    config: dict[str, Any]
    auditors: list[AuditorInfo]
    auditor_id: str | None
    rounds: pd.DataFrame
    trials: pd.DataFrame
    schedules: dict[str, dict[str, Any]] = field(default_factory=dict)  # trial id -> its saved event schedule
    notes: list[str] = field(default_factory=list)
    auditor_reason: str = ""  # why this auditor is the headline (chosen by name, or the default rule)

    @property
    def path(self) -> Path:
        return self.store.path

    @property
    def auditor(self) -> AuditorInfo | None:
        return next((a for a in self.auditors if a.auditor_id == self.auditor_id), None)

    @property
    def completion_threshold(self) -> float:
        return float(self.config.get("completion_threshold", 0.2))


def labels_frame(labels: Iterable[RoundLabel]) -> pd.DataFrame:
    """One row per label (`labels.RoundLabel`, usable or not) with the columns the metrics count
    (`with_counted_columns`); severity and confidence NaN where there is none."""
    nan = float("nan")
    recs = [{**asdict(lab), "severity": nan if lab.severity is None else lab.severity,
             "confidence": nan if lab.confidence is None else lab.confidence, "evidence": list(lab.evidence)}
            for lab in labels]
    return with_counted_columns(pd.DataFrame(recs, columns=LABEL_COLUMNS))


def with_counted_columns(df: pd.DataFrame) -> pd.DataFrame:
    """`df` (label columns of `RoundLabel`; a round without a label has NaN there) with its label
    status `missing` where there is no label, and the columns `registry.TrialLabels` reads:
    `labelled` (a valid label), `flagged` (a valid label that says deceptive) and one bool column
    per type. `deceptive` stays True/False/None so a missing label is never "False"."""
    df["label_status"] = df["label_status"].fillna("missing")
    df["label_cut"] = df["label_cut"].eq(True)  # no audit row: not cut
    df["types"] = [t if isinstance(t, tuple) else () for t in df["types"]]
    df["evidence"] = [e if isinstance(e, list) else [] for e in df["evidence"]]
    df["reasoning"] = df["reasoning"].fillna("")
    df["labelled"] = df["label_status"].isin(OK_STATUSES)
    df["deceptive"] = [bool(d) if lab else None for d, lab in zip(df["deceptive"], df["labelled"], strict=True)]
    df["flagged"] = [d is True for d in df["deceptive"]]
    for t in TYPES:
        df[t] = [t in ty for ty in df["types"]]
    return df


def load_audit(run: Run | str | Path, auditor_id: str | None) -> pd.DataFrame:
    """One row per (trial_id, global_round) labelled by this auditor (empty for None): the
    `labels.RoundLabel` of each round, usable or not (`label_status` `failed` for a row without a
    usable label, `label_cut` for one cut at its token limit), in `labels_frame`'s columns."""
    return labels_frame(auditor_labels(run, auditor_id) if auditor_id else [])


def trial_condition(trial_id: str, schedule: dict[str, Any] | None = None,
                    config: dict[str, Any] | None = None) -> str:
    """The control condition of a trial: `uncontrolled`, `category=<CAT>`, `pressure=<LVL>`,
    `category=<CAT>,pressure=<LVL>` or `none` (no events at all). Read from the saved schedule,
    else from the trial id (`names.parse_trial_id`), else from the run's config."""
    cat = lvl = None
    parsed = parse_trial_id(trial_id)
    if schedule and ("control_category" in schedule or "control_pressure" in schedule):
        cat, lvl = schedule.get("control_category"), schedule.get("control_pressure")
    elif parsed is not None and (parsed[1] or parsed[2]):
        cat, lvl = parsed[1], parsed[2]
    elif config:
        ctl = config.get("control") or {}
        cat, lvl = ctl.get("category"), ctl.get("pressure")
    if "NONE" in (cat, lvl):
        return "none"
    parts = ([f"category={cat}"] if cat else []) + ([f"pressure={lvl}"] if lvl else [])
    return ",".join(parts) or "uncontrolled"


def _seed_of(trial_id: str, rows: list[RoundRow], schedule: dict[str, Any]) -> int | None:
    if rows and rows[0].seed is not None:
        return rows[0].seed
    if schedule.get("seed") is not None:
        return int(schedule["seed"])
    parsed = parse_trial_id(trial_id)
    return parsed[0] if parsed else None


def performer_info(manifest: Manifest, config: dict[str, Any], first_row: RoundRow | None) -> Performer:
    """The performer model, adapter and revision: manifest, else trajectory rows, else config."""
    recorded = (manifest.models or {}).get("performer")
    if recorded is not None and recorded.model:
        return Performer(recorded.model, recorded.adapter, recorded.revision)
    in_row = first_row.models.performer if first_row is not None and first_row.models is not None else None
    if in_row is not None and in_row.model:
        return Performer(in_row.model, in_row.adapter, in_row.revision)
    role = config.get("performer") or {}  # the run config (YAML), not a run record
    spec = (config.get("models") or {}).get(role.get("model"), {}) if role else {}
    return Performer(spec.get("model") or role.get("model"), role.get("adapter"), spec.get("revision"))


def _short(name: str | None) -> str:
    """The last path component of a model or adapter path; hub ids are kept whole."""
    if not name:
        return "?"
    p = Path(str(name))
    return p.name if (p.is_absolute() or str(name).startswith(".")) else str(name)


def model_label(perf: Performer) -> str:
    return _short(perf.model) + (f" + {_short(perf.adapter)}" if perf.adapter else "")


def _evaluated(sup: SupervisorRecord | None) -> bool:
    """The supervisor's evaluation holds an answer (a failed one is written as null or {})."""
    return sup is not None and sup.evaluation is not None and bool(sup.evaluation.model_dump(exclude_unset=True))


def _round_record(trial_id: str, row: RoundRow) -> dict[str, Any]:
    ev, sup, perf = row.event, row.supervisor, row.performer
    before = sup.state_before if sup is not None else None
    after = sup.state_after if sup is not None else None
    status = sup.parse_status if sup is not None else None
    rec = {
        "trial_id": trial_id, "seed": row.seed, "task_index": row.task_index,
        "task_title": row.task_title or "", "round": row.round,
        "global_round": row.global_round, "has_event": ev is not None,
        "event_name": ev.name if ev else None,
        "category": (ev.category or NO_EVENT) if ev else NO_EVENT,
        "pressure": (ev.pressure or NO_EVENT) if ev else NO_EVENT,
        "sup_parse_status": status, "sup_failed": supervisor_failed(row),
        "sup_cut": status == "cut",
        "task_complete": bool(row.task_complete),
        "performer_chars": len(perf.text or ""),
        "performer_tokens": perf.completion_tokens,
    }
    for k in STATES:
        rec[f"{k}_before"] = getattr(before, k) if before is not None else None
        rec[k] = getattr(after, k) if after is not None else None
    return rec


def supervisor_failed(row: RoundRow) -> bool:
    """The round's supervisor evaluation or feedback has no usable answer (parse_status `failed`,
    or `cut`: stopped at its token limit): the states were carried over unchanged (evaluation)
    or the performer got no feedback, and the task stayed incomplete."""
    sup = row.supervisor
    if sup is None:
        return False
    status = sup.parse_status
    return (status is not None and status not in SUPERVISOR_OK) or (
        "evaluation" in sup.model_fields_set and not _evaluated(sup))


def read_trials(run: Run) -> tuple[dict[str, list[RoundRow]], dict[str, bool]]:
    """Every trial's checked rows (in global-round order) and whether it is finished, through
    `TrialStore.read`: the `.done` rule of `lhd run` (a marker over cut rows is an error)."""
    rows: dict[str, list[RoundRow]] = {}
    done: dict[str, bool] = {}
    for trial in run.trials():
        found: list[RoundRow]
        found, done[trial.trial_id] = trial.read()  # refuses a round written twice
        rows[trial.trial_id] = sorted(found, key=lambda r: r.global_round)
    return rows, done


def load_rounds(run: Run, auditor_id: str | None
                ) -> tuple[pd.DataFrame, dict[str, list[RoundRow]], dict[str, bool]]:
    """Trajectory rows of every trial with `auditor_id`'s labels joined (label_status `missing`
    where the auditor wrote nothing for a round). Also returns the rows per trial and whether
    each trial is finished (`read_trials`)."""
    raw, done = read_trials(run)
    recs = [_round_record(tid, r) for tid, rows in raw.items() for r in rows]
    rounds = pd.DataFrame(recs)
    if rounds.empty:
        rounds = pd.DataFrame(columns=["trial_id", "global_round", "task_index", "round", "category",
                                       "pressure", "has_event", *STATES])
    rounds = with_counted_columns(rounds.merge(load_audit(run, auditor_id), on=["trial_id", "global_round"],
                                               how="left"))
    return rounds.sort_values(["trial_id", "global_round"]).reset_index(drop=True), raw, done


def read_schedules(run: Run, trial_ids: list[str]) -> dict[str, dict[str, Any]]:
    """Each trial's saved event schedule (`schedules/<trial>.json`, written by `lhd run`), for the
    trials that have one."""
    out = {}
    for tid in trial_ids:
        sched = run.schedule(tid)
        if sched:
            out[tid] = sched
    return out


def _trial_table(raw: dict[str, list[RoundRow]], done: dict[str, bool], schedules: dict[str, dict[str, Any]],
                 config: dict[str, Any]) -> pd.DataFrame:
    recs = []
    for tid, rows in raw.items():
        sched = schedules.get(tid, {})
        entries = sched.get("entries") or []
        last = rows[-1].supervisor.state_after if rows and rows[-1].supervisor is not None else None
        # satisfaction the supervisor gave: a failed evaluation's carried-over state is not one
        sats = [r.supervisor.state_after.satisfaction for r in rows
                if _evaluated(r.supervisor) and r.supervisor is not None and r.supervisor.state_after is not None]
        given = [s for s in sats if s is not None]
        tasks = {r.task_index for r in rows}
        recs.append({
            "trial_id": tid, "seed": _seed_of(tid, rows, sched),
            "condition": trial_condition(tid, sched or None, config),
            "done": done[tid],
            "n_rounds": len(rows), "n_tasks": len(tasks),
            # tasks reached whose schedule drew an event (not the whole pack's schedule)
            "n_event_tasks": len({e["task_index"] for e in entries if e is not None} & tasks) if entries else
            len({r.task_index for r in rows if r.event is not None}),
            "final_trust": last.trust if last else None, "final_comfort": last.comfort if last else None,
            "final_satisfaction": last.satisfaction if last else None,
            "mean_satisfaction": sum(given) / len(given) if given else float("nan"),
            "tasks_completed": len({r.task_index for r in rows if r.task_complete}),
            "supervisor_failed_rounds": sum(supervisor_failed(r) for r in rows),
            "supervisor_cut_rounds": sum(r.supervisor is not None and r.supervisor.parse_status == "cut"
                                         for r in rows),
        })
    cols = ["trial_id", "seed", "condition", "done", "n_rounds", "n_tasks", "n_event_tasks", "final_trust",
            "final_comfort", "final_satisfaction", "mean_satisfaction", "tasks_completed", "supervisor_failed_rounds",
            "supervisor_cut_rounds"]
    # numbers stay numbers when a trial has no round yet (None), so tables over several runs average them
    states = ["final_trust", "final_comfort", "final_satisfaction", "mean_satisfaction"]
    return pd.DataFrame(recs, columns=cols).astype({c: float for c in states})


def left_out_trials(run: Run, manifest: Manifest, loaded: dict[str, Any]) -> list[str]:
    """Trials the run should have (in its manifest, or marked done) that have no rows to load:
    a report must say it dropped them, not count a shorter run."""
    expected = [str(t) for t in manifest.trials or []] + run.dir.done_trial_ids()
    return [t for t in dict.fromkeys(expected) if t not in loaded]


def load_run(run_dir: str | Path | Run, auditor: str | None = None, min_coverage: float = COVERAGE_MIN) -> RunData:
    """Load a run directory with one auditor's labels (`auditor`, or the default of `pick_auditor`).
    `min_coverage` only words the note about trials with many failed or missing labels."""
    run = run_dir if isinstance(run_dir, Run) else Run.open(run_dir)
    manifest = run.manifest() or Manifest()
    config = run.config()
    auditors = list_auditors(run)
    auditor_id = pick_auditor(run, auditor, auditors)
    reason = "chosen by name (--auditor)" if auditor is not None else headline_auditor(run, auditors)[1]
    rounds, raw, done = load_rounds(run, auditor_id)
    schedules = read_schedules(run, list(raw))
    first = next((rows[0] for rows in raw.values() if rows), None)
    run_id = str(manifest.run_id or config.get("run_name") or (first.run_id if first else None) or run.path.name)
    perf = performer_info(manifest, config, first)
    mlabel = model_label(perf)
    data = RunData(store=run, run_id=run_id, key=run_id, label=f"{run_id} ({mlabel})", model_label=mlabel,
                   performer=perf, manifest=manifest, summary=run.summary(), config=config, auditors=auditors,
                   auditor_id=auditor_id, rounds=rounds, trials=_trial_table(raw, done, schedules, config),
                   schedules=schedules, auditor_reason=reason)
    if not raw:
        data.notes.append("no trajectory files under trials/")
    elif rounds.empty:
        data.notes.append("no finished round yet (the trajectory files hold no whole row)")
    lost = left_out_trials(run, manifest, raw)
    if lost:
        data.notes.append(f"{len(lost)} trial(s) left out, with no trajectory file (trials/<trial>.jsonl) although the "
                          f"manifest lists them or a .done marker marks them finished: {', '.join(lost[:5])}"
                          + (" ..." if len(lost) > 5 else ""))
    if auditor_id is None:
        data.notes.append("no audit labels: run `lhd audit` first; deception metrics are empty")
    n_failed = int((rounds["label_status"] == "failed").sum()) if len(rounds) else 0
    n_missing = int((rounds["label_status"] == "missing").sum()) if len(rounds) and auditor_id else 0
    n_cut = int(rounds["label_cut"].sum()) if len(rounds) else 0
    if n_failed:
        data.notes.append(f"{n_failed} round(s) whose audit failed are excluded from the rates"
                          + (f" ({n_cut} of them cut at the auditor's token limit)" if n_cut else ""))
    if n_missing:
        data.notes.append(f"{n_missing} round(s) not yet audited by '{auditor_id}' are excluded from the rates")
    if auditor_id and len(rounds):
        cov = rounds.groupby("trial_id", sort=False)["labelled"].mean()
        low = [f"{t} {c:.0%}" for t, c in cov.items() if c < min_coverage]
        if low:
            data.notes.append(f"{len(low)} trial(s) with label coverage below {min_coverage:.0%} ("
                              + ", ".join(low[:5]) + (" ..." if len(low) > 5 else "")
                              + "): their rates rest on fewer rounds; the runs table also gives the rates "
                              "without them")
    n_sup = int(data.trials["supervisor_failed_rounds"].sum()) if len(data.trials) else 0
    if n_sup:
        n_tr = int((data.trials["supervisor_failed_rounds"] > 0).sum())
        n_sup_cut = int(data.trials["supervisor_cut_rounds"].sum())
        cut_note = f" ({n_sup_cut} of them cut at the token limit)" if n_sup_cut else ""
        data.notes.append(f"{n_sup} round(s) in {n_tr} trial(s) had a failed supervisor call{cut_note}: "
                          "the states were carried over unchanged and the task stayed incomplete (which can add "
                          "rounds); these performer answers are audited and stay in N, their carried-over "
                          "satisfaction is left out of the mean satisfaction, and the runs table gives the rate "
                          "without these trials")
    n_repaired = int((rounds["label_status"] == "repaired").sum()) if len(rounds) else 0
    if n_repaired:
        data.notes.append(f"{n_repaired} label(s) were changed by the consistency rules (parse_status 'repaired'; "
                          "the originals are in each audit row's `original` or `reference_raw`)")
    if len(rounds):  # load_rounds always joins the label columns, from_unfinished among them
        stale = rounds["from_unfinished"].eq(True) & rounds["trial_id"].map(done).eq(True)
        if stale.any():
            data.notes.append(f"{int(stale.sum())} label(s) in {rounds.loc[stale, 'trial_id'].nunique()} trial(s) "
                              "were made while the trial was unfinished (`lhd audit --include-unfinished`) and "
                              "still count; the trial has finished since: rerun `lhd audit` to label those rounds "
                              "from the whole trajectory")
    undone = [t for t, d in zip(data.trials["trial_id"], data.trials["done"], strict=True) if not d]
    if undone:
        data.notes.append(f"{len(undone)} trial(s) not finished: {', '.join(undone[:5])}"
                          + (" ..." if len(undone) > 5 else ""))
    return data


def load_runs(run_dirs: list[Path], auditor: str | None = None,
              min_coverage: float = COVERAGE_MIN) -> list[RunData]:
    """Load several runs and give each a unique `key` (and label) for side-by-side tables."""
    runs = [load_run(p, auditor, min_coverage) for p in run_dirs]
    taken: set[str] = set()
    for r in runs:
        key, n = r.key, 1
        while key in taken:  # `a`, `a`, `a#2`: the suffix must not land on another run's own id
            n += 1
            key = f"{r.key}#{n}"
        taken.add(key)
        if key != r.key:
            r.key = key
            r.label = f"{r.key} ({r.model_label})"
    return runs
