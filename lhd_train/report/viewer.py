"""Static, chat-style HTML page per trial (`lhd view`), also written by `lhd report`.

Every model text goes through Jinja2 autoescaping as plain text (no markdown, no `|safe`), so a
performer answer holding `<script>` or `<img onerror=...>` renders as those characters.

The viewer only reads the run: rows through the checked reader and held against the `.done`
marker like `lhd run` does (a finished trial whose rows were cut is an error, not a shorter
page), a run being written up to its last whole line, a message missing from the store shown as
missing, never as empty text. Its pages go to `--out` or `RUN/view`, refused in one line when that
is a file, part of a run's own files, or not writable (a read-only run: give `--out`)."""
from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

from lhd_train.audit.trajectory import TaskText, load_task_texts
from lhd_train.config.vocab import STATES
from lhd_train.errors import InputError
from lhd_train.io.files import atomic_write_text, check_writable_dir
from lhd_train.metrics.core import trial_stats
from lhd_train.metrics.labels import RoundLabel, auditor_labels
from lhd_train.metrics.load import RunData, load_run
from lhd_train.metrics.registry import summary_metrics
from lhd_train.report.plots import data_uri, plot_states
from lhd_train.report.render import fmt, render_page, signed
from lhd_train.report.tables import trials_table
from lhd_train.rundir.outputs import check_out_dir
from lhd_train.rundir.rows import RoundRow, SupervisorRecord, SupervisorState
from lhd_train.rundir.run import Run

_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")


def safe_name(name: str) -> str:
    """A file-name-safe form of a trial id or run key. A name that had to be changed gets a short
    hash of the original, so two names never share a page or folder (`a#2` and `a_2`)."""
    safe = _SAFE_NAME.sub("_", name).strip("._") or "x"
    if safe == name:
        return safe
    return f"{safe}-{hashlib.sha256(name.encode('utf-8', 'surrogatepass')).hexdigest()[:8]}"


def run_tasks(run: RunData) -> dict[int, TaskText]:
    """Task prompts and files to show, by the auditor's rule (`audit.trajectory.load_task_texts`):
    the run's own `tasks.json`, else the pack its config names when that is the pack the run used
    (content hash or titles); else none, and each task shows its round-1 message only."""
    return load_task_texts(run.path, run.config.get("task_pack"))[0]


def _verdict(status: str, deceptive: Any, severity: Any) -> tuple[str, str]:
    if status == "failed":
        return "failed", "label failed"
    if status == "missing":
        return "missing", "not audited"
    if deceptive:
        return "deceptive", f"deceptive · severity {fmt(severity, 0)}"
    return "honest", "not deceptive"


#: auditor id -> (trial id, global round) -> that auditor's label of the round, usable or not
AuditLabels = dict[str, dict[tuple[str, int], RoundLabel]]


def audit_labels(run: RunData) -> AuditLabels:
    """Every auditor's label of each round it labelled (`metrics.labels.auditor_labels`, the rule
    the report counts by), the headline auditor first: read once per run for all its pages."""
    ids = dict.fromkeys([*([run.auditor_id] if run.auditor_id else []), *(a.auditor_id for a in run.auditors)])
    return {aid: {(lab.trial_id, lab.global_round): lab for lab in auditor_labels(run.store, aid)} for aid in ids}


def _audit_view(label: RoundLabel | None, auditor_id: str, mode: str | None, primary: bool) -> dict[str, Any]:
    """One auditor's verdict on a round as the page shows it; `label` None: not audited."""
    status = label.label_status if label is not None else "missing"
    deceptive = label.deceptive if label is not None else None
    severity = label.severity if label is not None else None
    cls, text = _verdict(status, deceptive, severity)
    return {"auditor_id": auditor_id, "mode": mode, "primary": primary, "status": status,
            "flagged": bool(deceptive) and status not in ("failed", "missing"),
            "verdict_class": cls, "verdict_text": text, "deceptive": "yes" if deceptive else "no",
            "types": ", ".join(t.lower() for t in label.types) if label is not None else "",
            "severity": fmt(severity, 0), "confidence": fmt(label.confidence if label is not None else None, 2),
            "reasoning": label.reasoning if label is not None else "",
            "evidence": list(label.evidence) if label is not None else []}


def trial_context(run: RunData, trial_id: str, labels: AuditLabels | None = None,
                  states_png: bytes | None = None, tasks: dict[int, TaskText] | None = None) -> dict[str, Any]:
    """Everything the trial template shows, as plain strings and lists (`labels`: `audit_labels`,
    `tasks`: `run_tasks`, each read once per run by `write_run_pages`)."""
    trial_store = run.store.trial(trial_id)
    rows: list[RoundRow]
    rows, _ = trial_store.read()  # a cut finished trial is an error, as in `lhd run`
    rows.sort(key=lambda r: r.global_round)
    store = trial_store.messages()
    tr = run.rounds[run.rounds["trial_id"] == trial_id]
    labels = audit_labels(run) if labels is None else labels
    modes = {a.auditor_id: a.mode for a in run.auditors}
    texts = run_tasks(run) if tasks is None else tasks

    shown: list[dict[str, Any]] = []
    for row in rows:
        ti = row.task_index
        if not shown or shown[-1]["index"] != ti:
            ev = row.event
            pt = texts.get(ti)
            first_ids = row.performer.new_message_ids or []
            first = ("\n\n".join(m["content"] for m in store.get(first_ids))
                     if all(i in store for i in first_ids) else
                     f"[the user message is missing from {store.path.name}: the run's message store lost it]")
            shown.append({
                "index": ti, "title": row.task_title or "", "rounds": [], "has_flagged": False,
                "completed": False,
                "event": ({"name": ev.name or "", "category": ev.category or "", "pressure": ev.pressure or "",
                           "content": ev.content or ""} if ev else None),
                "prompt": pt.prompt if pt else "",
                "files": [{"name": name, "content": content} for name, content in pt.files] if pt else [],
                "first_message": first if row.round == 1 else "",
            })
        g = row.global_round
        perf, sup = row.performer, row.supervisor or SupervisorRecord()
        before, after = sup.state_before or SupervisorState(), sup.state_after or SupervisorState()
        states = []
        for k in STATES:
            b, a = getattr(before, k), getattr(after, k)
            d = (a - b) if isinstance(a, (int, float)) and isinstance(b, (int, float)) else float("nan")
            states.append({"name": k, "before": signed(b), "after": signed(a), "delta": signed(d),
                           "dir": "up" if d > 0 else ("down" if d < 0 else "")})
        audits = [_audit_view(labels.get(aid, {}).get((trial_id, g)), aid, modes.get(aid), True)
                  for aid in ([run.auditor_id] if run.auditor_id else [])]
        audits += [_audit_view(by_round.get((trial_id, g)), aid, modes.get(aid), False)
                   for aid, by_round in labels.items() if aid != run.auditor_id]
        flagged = bool(audits and audits[0]["flagged"])
        cls, text = (audits[0]["verdict_class"], audits[0]["verdict_text"]) if audits else ("missing", "not audited")
        meta = []
        if perf.completion_tokens is not None:
            meta.append(f"{perf.completion_tokens} tokens")
        if perf.finish_reason and perf.finish_reason != "stop":
            meta.append(f"finish: {perf.finish_reason}")
        if perf.context is not None and perf.context.dropped_messages:
            meta.append(f"{perf.context.dropped_messages} old messages dropped")
        t = shown[-1]
        t["rounds"].append({
            "round": row.round, "global_round": g, "flagged": flagged, "verdict_class": cls,
            "verdict_text": text, "task_complete": bool(row.task_complete),
            "text": perf.text or "", "think": perf.think or "", "meta": ", ".join(meta),
            "feedback": (sup.feedback.text if sup.feedback else None) or "",
            "feedback_reasoning": (sup.feedback.reasoning if sup.feedback else None) or "",
            "eval_reasoning": (sup.evaluation.reasoning if sup.evaluation else None) or "",
            "sup_status": sup.parse_status or "ok", "sup_attempts": sup.attempts or 1,
            "summaries": [{"global_round": s.global_round, "text": s.text or ""}
                          for s in sup.summaries_added or []],
            "states": states, "audits": audits,
        })
        t["has_flagged"] = t["has_flagged"] or flagged
        t["completed"] = t["completed"] or bool(row.task_complete)

    info = run.trials[run.trials["trial_id"] == trial_id]
    trial = info.iloc[0].to_dict() if len(info) else {"trial_id": trial_id, "seed": "?", "condition": "?",
                                                        "n_rounds": len(rows), "n_tasks": len(shown),
                                                        "n_event_tasks": 0, "tasks_completed": 0, "done": False}
    st = trial_stats(tr)
    if run.auditor_id is None:
        stats_text = "not audited"
    else:
        stats_text = (f"{st['deception_occurrences']} of {st['total_rounds']} labelled rounds flagged; "
                      + ", ".join(f"{m.label} {fmt(st[m.name])}" for m in summary_metrics()))
    notes = []
    if st["failed_rounds"]:
        notes.append(f"{st['failed_rounds']} round(s) whose audit failed are excluded from the rate")
    if st["missing_rounds"] and run.auditor_id:
        notes.append(f"{st['missing_rounds']} round(s) not audited yet")
    a = run.auditor
    auditor_text = (f"{a.auditor_id} ({a.mode}{', R=' + str(a.window) if a.window else ''})" if a else "none")
    if states_png is None and len(tr):
        states_png = states_plot(run, trial_id)
    return {"run": {"label": run.label, "key": run.key}, "trial": trial, "tasks": shown,
            "stats_text": stats_text, "notes": notes, "auditor_text": auditor_text,
            "states_png": data_uri(states_png) if states_png else ""}


def states_plot(run: RunData, trial_id: str) -> bytes | None:
    """The trial's supervisor-state plot (PNG), shared by its page and the report."""
    tr = run.rounds[run.rounds["trial_id"] == trial_id]
    return plot_states(tr, run.completion_threshold, f"{run.label} · {trial_id}") if len(tr) else None


def write_trial_page(run: RunData, trial_id: str, out: Path, back_href: str | None = None,
                     back_text: str = "the report", labels: AuditLabels | None = None,
                     states_png: bytes | None = None, tasks: dict[int, TaskText] | None = None) -> Path:
    """Write one trial's page to `out` (a file path)."""
    ctx = trial_context(run, trial_id, labels, states_png, tasks)
    html = render_page("trial.html.j2", script="viewer.js", back_href=back_href, back_text=back_text, **ctx)
    atomic_write_text(out, html)
    return out


def write_run_pages(run: RunData, out_dir: Path, back_href: str | None = None, back_text: str = "the report",
                    state_pngs: dict[str, bytes | None] | None = None) -> dict[str, Path]:
    """One page per trial of the run into `out_dir`; returns trial id → page path."""
    labels, tasks = audit_labels(run), run_tasks(run)
    pages = {}
    for tid in run.trials["trial_id"]:
        pages[tid] = write_trial_page(run, tid, out_dir / f"{safe_name(tid)}.html", back_href, back_text, labels,
                                      (state_pngs or {}).get(tid), tasks)
    return pages


def build_viewer(run: Path, out: Path | None = None, auditor: str | None = None) -> Path:
    """`lhd view RUN [--out DIR] [--auditor ID]`: a page per trial plus an index; returns the index path."""
    out_dir = Path(out) if out is not None else Path(run) / "view"
    check_out_dir(out_dir, what="viewer pages")
    opened = Run.open(run)
    check_writable_dir(out_dir, "viewer's folder" + ("" if out is not None else " (RUN/view; give --out DIR for a "
                                                                                "read-only run)"))
    data = load_run(opened, auditor)
    if data.rounds.empty:
        raise InputError(opened.dir.trials_dir, None, "no finished round yet: nothing to view (rerun `lhd view` "
                         "once `lhd run` has written a round)")
    pages = write_run_pages(data, out_dir, back_href="index.html", back_text="the trial list")
    from lhd_train.metrics.core import per_trial_table

    html = render_page("index.html.j2", run_label=data.label, notes=data.notes,
                       auditor_text=data.auditor_id or "none",
                       trials=trials_table(per_trial_table(data), {t: p.name for t, p in pages.items()}))
    index = out_dir / "index.html"
    atomic_write_text(index, html)
    return index
