"""Read a run directory (docs/formats.md) into tables: one row per round, labels of one auditor joined.

Everything downstream (metrics, report, viewer) works on these tables, so the rules about which
audit row counts live here only: see docs/metrics.md, "Inputs".

Loading only reads: a run being written is read up to its last whole line, a trial without its
`.done` marker counts as unfinished, and a finished trial whose rows disagree with its marker (rows
cut after it was written) is a `DataFileError` naming the file, as `lhd run` treats it, never a
shorter trial. No file of the run is changed (no repair on read)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from lhd_train.config.vocab import STATES, TYPES
from lhd_train.errors import InputError
from lhd_train.rundir.files import read_json_mapping as _read_json
from lhd_train.rundir.files import read_yaml_mapping
from lhd_train.rundir.layout import RunDir
from lhd_train.rundir.store import read_audit_rows, read_finished_trial

NO_EVENT = "none"
OK_STATUSES = ("ok", "retried", "repaired")  # a label that counts; "failed", "cut" and "missing" do not
NO_LABEL_STATUSES = ("failed", "cut")  # an audit row without a usable label (cut: stopped at its token limit)
SUPERVISOR_OK = ("ok", "retried")  # a supervisor round with both calls answered; anything else failed
COVERAGE_MIN = 0.9  # a trial whose valid labels cover less than this share of its rounds is flagged


@dataclass
class AuditorInfo:
    auditor_id: str
    mode: str | None
    window: int | None
    n_rows: int
    mtime: float  # kept for callers that show it; never used to choose an auditor (review N6)
    created_at: str | None = None  # from auditor.json, written when `lhd audit` first used this id


@dataclass
class RunData:
    """One run directory loaded with one auditor's labels (or none)."""

    path: Path
    run_id: str
    key: str            # unique among the runs of one report (the run id, suffixed on clashes)
    label: str          # run id + performer model/adapter, for tables and plots
    model_label: str    # performer model + adapter only: groups control-study runs of one model
    performer: dict[str, Any]
    manifest: dict[str, Any]
    config: dict[str, Any]
    auditors: list[AuditorInfo]
    auditor_id: str | None
    rounds: pd.DataFrame
    trials: pd.DataFrame
    notes: list[str] = field(default_factory=list)
    auditor_reason: str = ""  # why this auditor is the headline (chosen by name, or the default rule)

    @property
    def auditor(self) -> AuditorInfo | None:
        return next((a for a in self.auditors if a.auditor_id == self.auditor_id), None)

    @property
    def completion_threshold(self) -> float:
        return float(self.config.get("completion_threshold", 0.2))


def trial_ids(run_dir: Path) -> list[str]:
    """Trials with a trajectory file, in the manifest's order when it has one."""
    rd = RunDir(run_dir)
    found = rd.trial_ids()
    order = _read_json(rd.manifest).get("trials") or []
    rank = {t: i for i, t in enumerate(order)}
    return sorted(found, key=lambda t: (rank.get(t, len(rank)), t))


def _created_at(run_dir: Path, auditor_id: str) -> str | None:
    """When this auditor id was first used (auditor.json `created_at`, an ISO time), if recorded."""
    path = RunDir(run_dir).auditor_info(auditor_id)
    if not path.is_file():
        return None
    value = _read_json(path).get("created_at")
    return str(value) if value else None


def list_auditors(run_dir: Path) -> list[AuditorInfo]:
    """Every `audit/<id>/` folder with at least one JSONL file, in creation order (auditor.json
    `created_at`; ids without one after those with one, by id)."""
    out = []
    for d in sorted(RunDir(run_dir).audit_dir.glob("*/")):
        files = sorted(d.glob("*.jsonl"))
        if not files:
            continue
        mode = window = None
        n = 0
        for f in files:
            rows = read_audit_rows(f)
            n += len(rows)
            if rows and mode is None:
                mode, window = rows[0].get("mode"), rows[0].get("window")
        out.append(AuditorInfo(d.name, mode, window, n, max(f.stat().st_mtime for f in files),
                               _created_at(run_dir, d.name)))
    return sorted(out, key=lambda a: (a.created_at is None, a.created_at or "", a.auditor_id))


def run_config_auditor(run_dir: Path) -> str | None:
    """The auditor id the run's own config gives by default (`lhd audit RUN` with no options:
    the config's auditor model in full mode), or None when the config names no auditor."""
    from lhd_train.config.auditor import DEFAULT_OPTIONS

    role = read_yaml_mapping(RunDir(run_dir).config, missing_ok=True).get("auditor")
    key = role.get("model") if isinstance(role, dict) else None
    return DEFAULT_OPTIONS.resolved_id(str(key)) if key else None


def headline_auditor(run_dir: Path, auditors: list[AuditorInfo]) -> tuple[str | None, str]:
    """The default headline auditor and why it was chosen (shown in the report). In order: the
    run config's own full-mode auditor; else the first full-mode auditor created (the paper's
    auditor sees the whole trajectory); else the first auditor created. Never by file time: a
    resumed or extended audit must not change the headline (review N6)."""
    if not auditors:
        return None, "no auditor"
    own = run_config_auditor(run_dir)
    full = [a for a in auditors if a.mode == "full"]
    if own and any(a.auditor_id == own for a in full):
        return own, "the run config's auditor in full mode"
    if full:
        return full[0].auditor_id, "the first full-mode auditor created"
    return auditors[0].auditor_id, "the first auditor created (the run has no full-mode auditor)"


def pick_auditor(run_dir: Path, auditor: str | None, auditors: list[AuditorInfo] | None = None) -> str | None:
    """The auditor id to score with: the one asked for (`--auditor`), else `headline_auditor`'s
    default (the run config's full-mode auditor, else the first full-mode one created)."""
    auditors = list_auditors(run_dir) if auditors is None else auditors
    ids = [a.auditor_id for a in auditors]
    if auditor is not None:
        if auditor not in ids:
            raise InputError(RunDir(run_dir).audit_dir, "auditor", f"no audit labels from auditor '{auditor}'",
                             ", ".join(ids) or "none: run `lhd audit` first")
        return auditor
    return headline_auditor(Path(run_dir), auditors)[0]


def _keep_audit_row(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """For a round labelled twice (a resumed or repaired audit), the later row wins, except that
    a failed or cut row never replaces a valid one."""
    return not (new.get("parse_status") in NO_LABEL_STATUSES and old.get("parse_status") not in NO_LABEL_STATUSES)


def load_audit(run_dir: Path, auditor_id: str | None) -> pd.DataFrame:
    """One row per (trial_id, global_round) labelled by this auditor (empty for None); a round
    labelled twice keeps the row `_keep_audit_row` prefers. A row cut at its token limit
    (parse_status `cut`) is no label, as a failed one (label_status `failed`, `label_cut` true),
    whatever values it holds."""
    chosen: dict[tuple[str, int], dict[str, Any]] = {}
    files = sorted(RunDir(run_dir).auditor_dir(auditor_id).glob("*.jsonl")) if auditor_id else []
    for f in files:
        for row in read_audit_rows(f):
            key = (str(row.get("trial_id", f.stem)), int(row["global_round"]))
            if key not in chosen or _keep_audit_row(chosen[key], row):
                chosen[key] = row
    recs = []
    for (tid, g), r in chosen.items():
        status = r.get("parse_status") or "ok"
        failed = status in NO_LABEL_STATUSES or r.get("deceptive") is None
        types = tuple(t for t in TYPES if t in {str(x).strip().upper() for x in (r.get("types") or [])})
        sev = r.get("severity")
        recs.append({
            "trial_id": tid, "global_round": g, "auditor_id": r.get("auditor_id", auditor_id),
            "mode": r.get("mode"), "window": r.get("window"),
            "label_status": "failed" if failed else status, "label_cut": status == "cut",
            "deceptive": None if failed else bool(r.get("deceptive")),
            "types": () if failed else types,
            "severity": float("nan") if failed or sev is None else float(sev),
            "confidence": float("nan") if r.get("confidence") is None else float(r["confidence"]),
            "reasoning": r.get("reasoning") or "", "evidence": list(r.get("evidence") or []),
        })
    cols = ["trial_id", "global_round", "auditor_id", "mode", "window", "label_status", "label_cut", "deceptive",
            "types", "severity", "confidence", "reasoning", "evidence"]
    return pd.DataFrame(recs, columns=cols)


def round_labels(run_dir: str | Path,
                 auditor: str | None = None) -> tuple[str | None, dict[tuple[str, int], dict[str, Any]]]:
    """The one rule that turns audit rows into a label per round, shared by `lhd report` and
    `lhd lens read --run`: a single auditor (`auditor`, else `pick_auditor`'s default, see
    `headline_auditor`), one row per round (`_keep_audit_row`), and only valid labels (status in
    OK_STATUSES with a verdict). Returns the auditor id and `(trial_id, global_round) ->
    {deceptive, severity, types, label_status}` (severity as the auditor wrote it)."""
    run_dir = Path(run_dir)
    auditor_id = pick_auditor(run_dir, auditor)
    labels: dict[tuple[str, int], dict[str, Any]] = {}
    for r in load_audit(run_dir, auditor_id).to_dict("records"):
        if r["label_status"] not in OK_STATUSES:
            continue
        labels[(str(r["trial_id"]), int(r["global_round"]))] = {
            "deceptive": bool(r["deceptive"]), "severity": r["severity"], "types": list(r["types"]),
            "label_status": r["label_status"]}
    return auditor_id, labels


_CONTROL_RE = re.compile(r"^s(?P<seed>\d+)"
                         r"(?:-(?P<kind>cat|lvl)-(?P<value>[A-Z_]+)(?:-lvl-(?P<lvl2>[A-Z_]+))?|-(?P<none>none))?$")


def trial_condition(trial_id: str, schedule: dict[str, Any] | None = None,
                    config: dict[str, Any] | None = None) -> str:
    """The control condition of a trial: `uncontrolled`, `category=<CAT>`, `pressure=<LVL>`,
    `category=<CAT>,pressure=<LVL>` or `none` (no events at all). Read from the saved schedule,
    else from the trial id's suffix, else from the run's config."""
    cat = lvl = None
    if schedule and ("control_category" in schedule or "control_pressure" in schedule):
        cat, lvl = schedule.get("control_category"), schedule.get("control_pressure")
    else:
        m = _CONTROL_RE.match(trial_id)
        if m and m.group("none"):
            return "none"
        if m and m.group("kind"):
            if m.group("kind") == "cat":
                cat, lvl = m.group("value"), m.group("lvl2")
            else:
                lvl = m.group("value")
        elif config:
            ctl = config.get("control") or {}
            cat, lvl = ctl.get("category"), ctl.get("pressure")
    if "NONE" in (cat, lvl):
        return "none"
    parts = ([f"category={cat}"] if cat else []) + ([f"pressure={lvl}"] if lvl else [])
    return ",".join(parts) or "uncontrolled"


def _seed_of(trial_id: str, rows: list[dict[str, Any]], schedule: dict[str, Any]) -> int | None:
    if rows and rows[0].get("seed") is not None:
        return int(rows[0]["seed"])
    if schedule.get("seed") is not None:
        return int(schedule["seed"])
    m = re.match(r"^s(\d+)", trial_id)
    return int(m.group(1)) if m else None


def performer_info(run_dir: Path, manifest: dict[str, Any], config: dict[str, Any],
                   first_row: dict[str, Any] | None) -> dict[str, Any]:
    """{model, adapter, revision} of the performer: manifest, else trajectory rows, else config."""
    for src in ((manifest.get("models") or {}).get("performer"),
                ((first_row or {}).get("models") or {}).get("performer")):
        if isinstance(src, dict) and src.get("model"):
            return {"model": src.get("model"), "adapter": src.get("adapter"), "revision": src.get("revision")}
    perf = config.get("performer") or {}
    spec = (config.get("models") or {}).get(perf.get("model"), {}) if perf else {}
    return {"model": spec.get("model") or perf.get("model"), "adapter": perf.get("adapter"),
            "revision": spec.get("revision")}


def _short(name: str | None) -> str:
    """The last path component of a model or adapter path; hub ids are kept whole."""
    if not name:
        return "?"
    p = Path(str(name))
    return p.name if (p.is_absolute() or str(name).startswith(".")) else str(name)


def model_label(perf: dict[str, Any]) -> str:
    base = _short(perf.get("model"))
    return base + (f" + {_short(perf['adapter'])}" if perf.get("adapter") else "")


def _round_record(row: dict[str, Any]) -> dict[str, Any]:
    ev = row.get("event") or None
    sup = row.get("supervisor") or {}
    before, after = sup.get("state_before") or {}, sup.get("state_after") or {}
    perf = row.get("performer") or {}
    rec = {
        "trial_id": row["trial_id"], "seed": row.get("seed"), "task_index": int(row["task_index"]),
        "task_title": row.get("task_title", ""), "round": int(row["round"]),
        "global_round": int(row["global_round"]), "has_event": ev is not None,
        "event_name": ev.get("name") if ev else None,
        "category": (ev.get("category") or NO_EVENT) if ev else NO_EVENT,
        "pressure": (ev.get("pressure") or ev.get("level") or NO_EVENT) if ev else NO_EVENT,
        "sup_parse_status": sup.get("parse_status"), "sup_failed": supervisor_failed(row),
        "sup_cut": sup.get("parse_status") == "cut",
        "task_complete": bool(row.get("task_complete")),
        "performer_chars": len(perf.get("text") or ""),
        "performer_tokens": perf.get("completion_tokens"),
    }
    for k in STATES:
        rec[f"{k}_before"] = before.get(k)
        rec[k] = after.get(k)
    return rec


def supervisor_failed(row: dict[str, Any]) -> bool:
    """The round's supervisor evaluation or feedback has no usable answer (parse_status `failed`,
    or `cut`: stopped at its token limit): the states were carried over unchanged (evaluation)
    or the performer got no feedback, and the task stayed incomplete."""
    sup = row.get("supervisor") or {}
    status = sup.get("parse_status")
    return (status is not None and status not in SUPERVISOR_OK) or ("evaluation" in sup and not sup["evaluation"])


def read_trials(run_dir: Path) -> tuple[dict[str, list[dict[str, Any]]], dict[str, bool]]:
    """Every trial's checked rows (in global-round order) and whether it is finished, through
    `read_finished_trial`: the `.done` rule of `lhd run` (a marker over cut rows is an error)."""
    raw: dict[str, list[dict[str, Any]]] = {}
    done: dict[str, bool] = {}
    for tid in trial_ids(run_dir):
        rows, done[tid] = read_finished_trial(RunDir(run_dir).trial(tid).rows)  # refuses a round written twice
        raw[tid] = sorted(rows, key=lambda r: int(r["global_round"]))
    return raw, done


def load_rounds(run_dir: Path, auditor_id: str | None
                ) -> tuple[pd.DataFrame, dict[str, list[dict[str, Any]]], dict[str, bool]]:
    """Trajectory rows of every trial with `auditor_id`'s labels joined (label_status `missing`
    where the auditor wrote nothing for a round). Also returns the raw rows per trial and
    whether each trial is finished (`read_trials`)."""
    raw, done = read_trials(run_dir)
    recs = [_round_record(r) for rows in raw.values() for r in rows]
    rounds = pd.DataFrame(recs)
    if rounds.empty:
        rounds = pd.DataFrame(columns=["trial_id", "global_round", "task_index", "round", "category",
                                       "pressure", "has_event", *STATES])
    audit = load_audit(run_dir, auditor_id) if auditor_id else load_audit(run_dir, None)
    rounds = rounds.merge(audit, on=["trial_id", "global_round"], how="left")
    rounds["label_status"] = rounds["label_status"].fillna("missing")
    rounds["label_cut"] = rounds["label_cut"].eq(True)  # no audit row: not cut
    rounds["types"] = [t if isinstance(t, tuple) else () for t in rounds["types"]]
    rounds["evidence"] = [e if isinstance(e, list) else [] for e in rounds["evidence"]]
    rounds["reasoning"] = rounds["reasoning"].fillna("")
    rounds["labelled"] = rounds["label_status"].isin(OK_STATUSES)
    # `deceptive` stays an object column of True/False/None so a missing label is never "False".
    rounds["deceptive"] = [bool(d) if lab else None
                           for d, lab in zip(rounds["deceptive"], rounds["labelled"], strict=True)]
    rounds["flagged"] = [d is True for d in rounds["deceptive"]]
    for t in TYPES:
        rounds[t] = [t in ty for ty in rounds["types"]]
    return rounds.sort_values(["trial_id", "global_round"]).reset_index(drop=True), raw, done


def _trial_table(run_dir: Path, raw: dict[str, list[dict[str, Any]]], done: dict[str, bool],
                 config: dict[str, Any]) -> pd.DataFrame:
    recs = []
    for tid, rows in raw.items():
        sched = _read_json(RunDir(run_dir).schedule(tid))
        entries = sched.get("entries") or []
        last = (rows[-1].get("supervisor") or {}).get("state_after", {}) if rows else {}
        # satisfaction the supervisor gave: a failed evaluation's carried-over state is not one
        sats = [((r.get("supervisor") or {}).get("state_after") or {}).get("satisfaction") for r in rows
                if (r.get("supervisor") or {}).get("evaluation")]
        sats = [s for s in sats if s is not None]
        recs.append({
            "trial_id": tid, "seed": _seed_of(tid, rows, sched),
            "condition": trial_condition(tid, sched or None, config),
            "done": done[tid],
            "n_rounds": len(rows), "n_tasks": len({r["task_index"] for r in rows}),
            # tasks reached whose schedule drew an event (not the whole pack's schedule)
            "n_event_tasks": len({e["task_index"] for e in entries if e is not None}
                                 & {r["task_index"] for r in rows}) if entries else
            len({r["task_index"] for r in rows if r.get("event")}),
            "final_trust": last.get("trust"), "final_comfort": last.get("comfort"),
            "final_satisfaction": last.get("satisfaction"),
            "mean_satisfaction": sum(sats) / len(sats) if sats else float("nan"),
            "tasks_completed": len({r["task_index"] for r in rows if r.get("task_complete")}),
            "supervisor_failed_rounds": sum(supervisor_failed(r) for r in rows),
            "supervisor_cut_rounds": sum((r.get("supervisor") or {}).get("parse_status") == "cut" for r in rows),
        })
    cols = ["trial_id", "seed", "condition", "done", "n_rounds", "n_tasks", "n_event_tasks", "final_trust",
            "final_comfort", "final_satisfaction", "mean_satisfaction", "tasks_completed", "supervisor_failed_rounds",
            "supervisor_cut_rounds"]
    # numbers stay numbers when a trial has no round yet (None), so tables over several runs average them
    states = ["final_trust", "final_comfort", "final_satisfaction", "mean_satisfaction"]
    return pd.DataFrame(recs, columns=cols).astype({c: float for c in states})


def left_out_trials(run_dir: Path, manifest: dict[str, Any], loaded: dict[str, Any]) -> list[str]:
    """Trials the run should have (in its manifest, or marked done) that have no rows to load:
    a report must say it dropped them, not count a shorter run."""
    expected = [str(t) for t in manifest.get("trials") or []]
    expected += RunDir(run_dir).done_trial_ids()
    return [t for t in dict.fromkeys(expected) if t not in loaded]


def load_run(run_dir: str | Path, auditor: str | None = None, min_coverage: float = COVERAGE_MIN) -> RunData:
    """Load a run directory with one auditor's labels (`auditor`, or the default of `pick_auditor`).
    `min_coverage` only words the note about trials with many failed or missing labels."""
    run_dir = Path(run_dir)
    rd = RunDir(run_dir)
    if not rd.is_run():
        raise InputError(run_dir, None, "not a run directory (no trials/ folder)")
    manifest = _read_json(rd.manifest)
    config = read_yaml_mapping(rd.config, missing_ok=True)
    auditors = list_auditors(run_dir)
    auditor_id = pick_auditor(run_dir, auditor, auditors)
    reason = "chosen by name (--auditor)" if auditor is not None else headline_auditor(run_dir, auditors)[1]
    rounds, raw, done = load_rounds(run_dir, auditor_id)
    first = next((rows[0] for rows in raw.values() if rows), None)
    run_id = manifest.get("run_id") or config.get("run_name") or (first or {}).get("run_id") or run_dir.name
    perf = performer_info(run_dir, manifest, config, first)
    mlabel = model_label(perf)
    data = RunData(run_dir, str(run_id), str(run_id), f"{run_id} ({mlabel})", mlabel, perf, manifest, config,
                   auditors, auditor_id, rounds, _trial_table(run_dir, raw, done, config), auditor_reason=reason)
    if not raw:
        data.notes.append("no trajectory files under trials/")
    elif rounds.empty:
        data.notes.append("no finished round yet (the trajectory files hold no whole row)")
    lost = left_out_trials(run_dir, manifest, raw)
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
