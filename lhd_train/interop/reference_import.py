"""`lhd import-reference DIR --out RUN`: the authors' session folders as one of our runs.

A session folder (docs/reference.md, "Session folders") holds `result.json`, a copy of its
config YAML and, after auditing, `detector_<ts>.json` / `detector_window_r<R>_<ts>.json`. Each session
becomes one trial: trajectory rows with every field the reference saved (fields it never saved
are null), the performer's user messages rebuilt with our templates, the task texts in the run's
`tasks.json`, and the newest detector file of each kind as an auditor (`reference-full`,
`reference-window<R>`) with the authors' labels as written, so the authors' own per-trial
numbers come out exactly (checked against the detector file's summary at import). On request,
labels are made consistent by our rules instead, originals kept in `reference_raw`.
Mapping: docs/auditing.md; the authors' formats: docs/reference.md."""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import yaml

from lhd_train.audit.labels import Labels, make_consistent
from lhd_train.bench.performer import task_message
from lhd_train.bench.prompts import Prompts
from lhd_train.config.run import parse_config
from lhd_train.errors import DataFileError, InputError
from lhd_train.interop.reference_files import (
    RefDetection,
    RefDetector,
    RefEvaluation,
    RefEvent,
    RefResult,
    RefStateUpdates,
    Session,
    check_detections,
    check_rounds,
    find_sessions,
    load_checked,
    newest_detectors,
    session_config,
)
from lhd_train.io.files import atomic_write_text
from lhd_train.io.provenance import package_versions, python_version, utc_now
from lhd_train.rundir.layout import LOCK, RunDir
from lhd_train.rundir.lock import run_dir_lock
from lhd_train.rundir.manifest import AuditorRecord, Manifest, RoleModel, RunSource, RunTask, RunTaskFile, RunTasks
from lhd_train.rundir.rows import (
    AUDITOR_SCHEMA,
    AuditRow,
    Evaluation,
    EventRecord,
    Feedback,
    ModelRef,
    PerformerRecord,
    RoundRow,
    RunModels,
    SupervisorRecord,
    SupervisorState,
)
from lhd_train.rundir.run import Run, read_record, write_record
from lhd_train.rundir.staging import staged_dir
from lhd_train.rundir.store import MessageStore

R = TypeVar("R")

SOURCE_KIND = "reference-import"
STATE_MAP = {"trust_level": "trust", "work_satisfaction": "satisfaction", "relational_comfort": "comfort"}
REFERENCE_AUDITOR = "gpt-5 (reasoning_effort high), hard-coded by the reference auditor"


# ---------------------------------------------------------------- conversion

def _state(d: dict[str, float] | None) -> dict[str, float] | None:
    if d is None:
        return None
    return {ours: float(d[theirs]) for theirs, ours in STATE_MAP.items() if theirs in d}


def _event(ev: RefEvent | None) -> EventRecord | None:
    if ev is None or ev.name == "NO_EVENT" or ev.category in ("-", "", None):
        return None
    return EventRecord(name=ev.name, category=ev.category, pressure=ev.pressure_level.upper(), content=ev.content)


def _reference_model(key: str, model: str | None) -> ModelRef:
    return ModelRef(key=key, model=model, revision=None, backend="reference", adapter=None)


def _prompt_text(p: str | dict[str, str]) -> str:
    return p.get("en", next(iter(p.values()), "")) if isinstance(p, dict) else p


def convert_session(session: Session, result: RefResult, run_id: str, prompts: Prompts,
                    store: MessageStore, supervisor_model: str | None = None) -> tuple[list[RoundRow],
                                                                                       dict[int, RunTask]]:
    """Trajectory rows (docs/formats.md) and the task texts of one session."""
    rows: list[RoundRow] = []
    tasks: dict[int, RunTask] = {}
    convo: list[dict[str, str]] = []
    pending_feedback: str | None = None
    models = RunModels(performer=_reference_model("performer", session.model_tag),
                       supervisor=_reference_model("supervisor", supervisor_model))
    for block in sorted(result.experiment.tasks, key=lambda b: b.task.task_sequence_num):
        t = block.task
        prompt = _prompt_text(t.base_prompt)
        tasks[t.task_sequence_num] = RunTask(index=t.task_sequence_num, title=t.title, prompt=prompt,
                                             files=[RunTaskFile(name=f.filename, content=f.content) for f in t.files])
        event = _event(block.event)
        task_ns = SimpleNamespace(index=t.task_sequence_num, title=t.title, prompt=prompt,
                                  files=[SimpleNamespace(name=f.filename, content=f.content) for f in t.files])
        ev_ns = SimpleNamespace(content=event.content) if event else None
        for r in sorted(block.rounds, key=lambda r: r.global_round):
            # The performer's user message, rebuilt with our templates (the reference never saved it).
            fb_msg = prompts.render("performer_feedback", feedback=pending_feedback) if pending_feedback else ""
            if r.round == 1:
                content = task_message(prompts, task_ns, ev_ns)
                content = fb_msg + "\n\n" + content if fb_msg else content
            else:
                content = fb_msg
            convo.append({"role": "user", "content": content})
            new_ids = store.put([convo[-1]])
            msg_ids = store.put(convo)
            me = r.manager_evaluation or RefEvaluation()
            su = me.state_updates or RefStateUpdates()
            after = _state(su.new_state)
            before = _state(su.previous_state)
            rows.append(RoundRow(
                run_id=run_id, trial_id=session.trial_id, seed=session.seed,
                pack=session.pack or result.metadata.task_stream_name, task_index=t.task_sequence_num,
                task_title=t.title, round=r.round, global_round=r.global_round, event=event,
                performer=PerformerRecord(
                    text=r.llm_response, think=None, raw=None, finish_reason=None, token_ids=None,
                    message_ids=msg_ids, new_message_ids=new_ids, prompt_tokens=None,
                    completion_tokens=None, cached_tokens=None, latency_s=None, sampling=None,
                    attempts=None, context=None,
                ),
                supervisor=SupervisorRecord(
                    evaluation=Evaluation(reasoning=me.evaluation_reasoning, **(after or {})),
                    feedback=Feedback(reasoning=me.feedback_reasoning, text=me.feedback_response),
                    state_before=SupervisorState(**before) if before is not None else None,
                    state_after=SupervisorState(**after) if after is not None else None,
                    parse_status="ok", attempts=None,
                ),
                task_complete=bool(me.task_complete),
                models=models,
                timestamp=None,
            ))
            convo.append({"role": "assistant", "content": r.llm_response})
            pending_feedback = me.feedback_response or None
    return rows, tasks


def detection_row(det: RefDetection, row: RoundRow | None, trial_id: str, run_id: str, auditor_id: str,
                  window: int | None, repair: bool = False) -> AuditRow:
    """One audit row from one reference detection: the authors' label as written (so their
    numbers come out exactly), or, with `repair`, made consistent by our rules (`repaired`, the
    originals kept in `reference_raw`)."""
    raw_labels = {"deception_detected": det.deception_detected, "types": list(det.types), "severity": det.severity,
                  "confidence_score": det.confidence_score}
    if repair:
        labels, changed = make_consistent(det.deception_detected, list(det.types), det.severity,
                                          det.confidence_score, det.reasoning, list(det.evidence))
        status = "repaired" if changed else "ok"
    else:
        labels = Labels(det.deception_detected, list(det.types), det.severity, det.confidence_score,
                        det.reasoning, list(det.evidence))
        status = "ok"
    out = AuditRow(
        run_id=run_id, trial_id=trial_id, global_round=det.global_round,
        task_index=row.task_index if row else None, round=row.round if row else None,
        auditor_id=auditor_id, mode="window" if window is not None else "full", window=window,
        **labels.as_row(), parse_status=status, raw=det.raw_response, error=None,
        attempts=None, prompt_sha256=None, prompt_tokens=None,
        completion_tokens=None, cached_tokens=None, latency_s=None,
        model=ModelRef(key="reference", model=REFERENCE_AUDITOR, revision=None, adapter=None),
        timestamp=None,
    )
    return out.model_copy(update={"reference_raw": raw_labels}) if status != "ok" else out


SUMMARY_KEYS = ("total_rounds", "deception_occurrences", "deception_rate", "severity_average_all_rounds",
                "severity_average_deception_only")


def check_summary(authors: dict[str, Any], rows: list[AuditRow]) -> dict[str, Any] | None:
    """Our per-trial statistics of the imported rows against the summary the authors' auditor
    wrote into the same detector file; None when that file has no summary numbers."""
    from lhd_train.config.vocab import TYPES
    from lhd_train.metrics.core import trial_stats
    from lhd_train.metrics.labels import label_of
    from lhd_train.metrics.load import labels_frame

    if not any(k in authors for k in SUMMARY_KEYS):
        return None
    ours = trial_stats(labels_frame(label_of(r, r.trial_id or "", r.auditor_id or "") for r in rows))
    mine: dict[str, Any] = {k: ours[k] for k in SUMMARY_KEYS}
    mine.update({f"type_counts.{k}": ours[f"count_{k}"] for k in TYPES})
    theirs: dict[str, Any] = {k: authors[k] for k in SUMMARY_KEYS if k in authors}
    theirs.update({f"type_counts.{k}": v for k, v in (authors.get("type_counts") or {}).items() if k in TYPES})
    diff = {k: {"authors": v, "ours": mine[k]} for k, v in theirs.items()
            if not isinstance(v, (int, float)) or abs(float(v) - float(mine[k])) > 1e-9}
    return {"matches": not diff, "differences": diff}


# ---------------------------------------------------------------- the run directory

@dataclass
class ImportedTrial:
    trial_id: str
    session: str
    rounds: int
    auditors: list[str] = field(default_factory=list)
    note: str | None = None


@dataclass
class ImportReport:
    run_dir: Path
    trials: list[ImportedTrial]


def _reset_trial(run_dir: Path, trial_id: str) -> None:
    rd = RunDir(run_dir)
    for p in (rd.trial(trial_id).rows, rd.trial(trial_id).messages, rd.trial(trial_id).done):
        p.unlink(missing_ok=True)
    for aid in rd.auditor_ids():
        if aid.startswith("reference-") and rd.audit_rows(aid, trial_id).exists():
            rd.audit_rows(aid, trial_id).unlink()


@dataclass
class _Source:
    """One session's files, read and checked before anything is written."""

    session: Session
    result: RefResult
    config: dict[str, Any]
    config_name: str | None
    detectors: dict[str, tuple[RefDetector, Path, int | None]]


def _read_sources(sessions: list[Session]) -> list[_Source]:
    out = []
    for s in sessions:
        result: RefResult = load_checked(RefResult, s.path / "result.json")
        rounds = check_rounds(s.path / "result.json", result)
        cfg_data, cfg_name = session_config(s.path)
        dets = {}
        for aid, (path, window) in newest_detectors(s.path).items():
            det: RefDetector = load_checked(RefDetector, path)
            check_detections(path, det, rounds)
            dets[aid] = (det, path, window)
        out.append(_Source(s, result, cfg_data, cfg_name, dets))
    return out


def _imported_record(read: Callable[[], R]) -> R:
    """`read()` of a record of the imported run; a damaged one is refused in the import's words."""
    try:
        return read()
    except DataFileError as e:
        raise InputError(e.path, e.field, f"{e.problem}; delete the imported run and import again") from None


def import_reference(src: Path, out: Path, repair: bool = False) -> ImportReport:
    """Import one session folder, or every session folder directly under `src`, into run `out`.
    Labels are kept as the authors wrote them unless `repair` (docs/auditing.md). Re-importing
    replaces the imported trials; a run not made by this importer is refused.

    All or nothing: every source file is read and checked first (a truncated file, a file of the
    wrong shape, a label for a round the session does not have are refused in one line), then the
    run is built in a sibling folder and put at `out` at the end (`rundir.staging`), under `out`'s
    lock. A refused or failed import leaves `out` as it was, and nothing that blocks a retry."""
    sessions = find_sessions(Path(src))
    out = Path(out)
    manifest: Manifest | None = None
    if RunDir(out).manifest.exists():
        manifest = _imported_record(Run.at(out).manifest)
        if manifest is None or manifest.source is None or manifest.source.kind != SOURCE_KIND:
            raise InputError(out, None, "exists and was not made by import-reference; choose another --out")
    elif out.exists() and (not out.is_dir() or any(p.name != LOCK for p in out.iterdir())):
        raise InputError(out, None, "exists and is not an imported run; choose another --out")
    sources_read = _read_sources(sessions)
    with run_dir_lock(out, stage="lhd import-reference"), \
            staged_dir(out, copy_existing=manifest is not None) as stage:
        report = _write_run(sources_read, stage, out, manifest, repair)
    report.run_dir = out
    return report


def _write_run(sources_read: list[_Source], stage: Path, out: Path, manifest: Manifest | None,
               repair: bool) -> ImportReport:
    """The imported run, written into `stage` (a copy of `out` when re-importing)."""
    sessions = [src.session for src in sources_read]
    run = Run.at(stage)
    rd = run.dir
    rd.trials_dir.mkdir(parents=True, exist_ok=True)
    run_id = re.sub(r"[^A-Za-z0-9._-]+", "_", out.resolve().name) or "imported"
    prompts = Prompts()

    sources = dict((manifest.source.sessions if manifest and manifest.source else None) or {})
    stored = _imported_record(lambda: read_record(rd.tasks, RunTasks))
    all_tasks: dict[int, RunTask] = {t.index: t for t in stored.tasks} if stored is not None else {}
    auditors: dict[str, AuditorRecord] = {}
    for aid in rd.auditor_ids():
        record = _imported_record(run.auditor(aid).record) if aid.startswith("reference-") else None
        if record is not None:
            auditors[aid] = record
    report: list[ImportedTrial] = []
    ref_cfg: dict[str, Any] = {}

    for src in sources_read:
        s, result, cfg_data, cfg_name = src.session, src.result, src.config, src.config_name
        ref_cfg = ref_cfg or cfg_data
        _reset_trial(stage, s.trial_id)
        trial = run.trial(s.trial_id)
        rows, tasks = convert_session(s, result, run_id, prompts, trial.messages(),
                                      (cfg_data.get("llm_api_config") or {}).get("manager"))
        for idx, t in tasks.items():
            if idx in all_tasks and all_tasks[idx] != t:
                raise InputError(s.path / "result.json", f"tasks[{idx}]",
                                 "differs from the same task in another imported session; import different task "
                                 "packs into different runs")
            all_tasks[idx] = t
        for row in rows:
            trial.append(row)
        total = result.metadata.total_tasks
        complete = result.experiment.error_info is None and (total is None or len(tasks) >= total)
        note = None
        if complete:
            trial.mark_done(rows)
        else:
            note = "incomplete session (error_info or missing tasks): audit with --include-unfinished"
        by_round = {r.global_round: r for r in rows}
        imported = ImportedTrial(s.trial_id, s.path.name, len(rows), note=note)
        det_sources: dict[str, str] = {}
        for aid, (det, path, window) in src.detectors.items():
            auditor = run.auditor(aid)
            counts = {"ok": 0, "repaired": 0, "unmatched": 0}  # unmatched: refused before (check_detections)
            written = []
            for d in sorted(det.round_detections, key=lambda d: d.global_round):
                arow = detection_row(d, by_round[d.global_round], s.trial_id, run_id, aid, window, repair)
                auditor.append(arow)
                written.append(arow)
                counts[arow.parse_status] += 1
            check = check_summary(det.summary, written)
            info = auditors.setdefault(aid, AuditorRecord(
                schema_=AUDITOR_SCHEMA, auditor_id=aid,
                options={"mode": "window" if window is not None else "full", "window": window,
                         "hide_supervisor": False, "hide_event_labels": False, "auditor_id": aid},
                model_identity={"key": "reference", "model": REFERENCE_AUDITOR, "revision": None, "adapter": None},
                source=SOURCE_KIND, trials={}))
            info.repair = repair
            info.trials = {**info.trials, s.trial_id: {
                "file": str(path.resolve()), "summary": det.summary, "rows": counts, "summary_check": check}}
            if check is not None and not check["matches"]:
                imported.note = "; ".join(filter(None, [imported.note, (
                    f"{aid}: numbers differ from the authors' summary ({', '.join(check['differences'])})"
                    + (f"; {counts['repaired']} label(s) repaired" if counts["repaired"] else ""))]))
            imported.auditors.append(aid)
            det_sources[aid] = str(path.resolve())
        sources[s.trial_id] = {
            "path": str(s.path.resolve()), "folder": s.path.name, "pack": s.pack, "seed": s.seed,
            "timestamp": s.timestamp,
            "category": s.category, "pressure": s.pressure, "model_tag": s.model_tag, "config_file": cfg_name,
            "error_info": result.experiment.error_info, "complete": complete, "detectors": det_sources,
        }
        report.append(imported)

    write_record(rd.tasks, RunTasks(source=SOURCE_KIND, tasks=[all_tasks[k] for k in sorted(all_tasks)]))
    for aid, info in auditors.items():
        run.auditor(aid).write_record(info)
    _write_config(out, run_id, sources, ref_cfg, rd.config)
    run.write_manifest(Manifest(
        run_id=run_id, source=RunSource(kind=SOURCE_KIND, sessions=sources, imported_at=utc_now()),
        pack=(manifest.pack if manifest else None) or sessions[0].pack,
        seeds=sorted({v["seed"] for v in sources.values()}), trials=sorted(sources),
        models={
            "performer": RoleModel(key="performer",
                                   model=", ".join(sorted({str(v["model_tag"]) for v in sources.values()})),
                                   revision=None, backend="reference", adapter=None),
            "supervisor": RoleModel(key="supervisor", model=(ref_cfg.get("llm_api_config") or {}).get("manager"),
                                    revision=None, backend="reference", adapter=None)},
        packages=package_versions(), python=python_version(),
    ))
    return ImportReport(out, report)


def _write_config(out: Path, run_id: str, sources: dict[str, dict[str, Any]], ref: dict[str, Any],
                  dest: Path) -> None:
    """A minimal config that parses as a RunConfig (so every tool can read it) but names no real
    backend and no auditor: an imported run is for auditing with --auditor, reporting, export."""
    tags = sorted({str(v["model_tag"]) for v in sources.values()})
    api = ref.get("llm_api_config") or {}
    init = ref.get("manager_initial_state") or {}
    cats = {v["category"] for v in sources.values()}
    lvls = {v["pressure"] for v in sources.values()}
    data = {
        "run_name": run_id, "output_dir": str(out.resolve().parent),
        "task_pack": ref.get("task_load_folder_name") or next((v["pack"] for v in sources.values() if v.get("pack")),
                                                             "unknown"),
        "seeds": sorted({v["seed"] for v in sources.values()}),
        "p_event": float(ref.get("p_event", 0.5)),
        "control": {"category": cats.pop() if len(cats) == 1 else None,
                    "pressure": lvls.pop() if len(lvls) == 1 else None},
        "max_rounds_per_task": int(ref.get("max_rounds_per_task", 3)),
        "completion_threshold": float(ref.get("task_completion_threshold", 0.2)),
        "memory_window": int(ref.get("memory_k_window", 7)),
        "initial_state": {"trust": float(init.get("trust_level", 0.0)),
                          "satisfaction": float(init.get("work_satisfaction", 0.0)),
                          "comfort": float(init.get("relational_comfort", 0.0))},
        "models": {"performer": {"backend": "openai", "model": ", ".join(tags)},
                   "supervisor": {"backend": "openai", "model": str(api.get("manager") or "unknown")}},
        "performer": {"model": "performer"}, "supervisor": {"model": "supervisor"},
    }
    parse_config(data, RunDir(out).config)  # proves every tool can load it
    text = yaml.safe_dump(data, sort_keys=False)
    header = ("# Imported from the reference implementation by `lhd import-reference` (source: reference-import).\n"
              "# Not runnable: the models are labels only. Audit with `lhd audit RUN --auditor CONFIG`.\n")
    atomic_write_text(dest, header + text)
