"""Audit every round of every finished trial of a run, concurrently and resumably.

All rounds are submitted at once (bounded by a semaphore) so the backend batches them and a
prefix cache reuses each trial's trajectory. Each finished round is one appended, fsynced line; a
rerun skips rounds already there and is refused when the settings or the auditor's model files
differ from `auditor.json`. Unparsable rounds are `failed`, unreachable ones left missing; rounds
of unfinished trials are labelled again once the trial is done. docs/auditing.md, "Failure semantics"."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from lhd_train.audit.labels import CheckedAuditAnswer, failed_labels, make_consistent
from lhd_train.audit.trajectory import AuditorPrompts, Trial, build_messages, load_trial, prompt_sha256, run_task_texts
from lhd_train.bench.structured_calls import BackendUnavailable, StructuredOutcome, ask_structured, call_seed
from lhd_train.config.auditor import AuditOptions, AuditorConfig
from lhd_train.errors import DataFileError, InputError
from lhd_train.io.files import StorageError, repair_jsonl
from lhd_train.io.provenance import package_versions, python_version, utc_now
from lhd_train.rundir.lock import run_dir_lock
from lhd_train.rundir.manifest import AuditorRecord
from lhd_train.rundir.rows import AUDITOR_SCHEMA, AuditRow, CallRecord, ModelRef
from lhd_train.rundir.run import AuditorStore, Run
from lhd_train.rundir.store import NO_LABEL_STATUSES, message_id
from rollouts.backend import Backend
from rollouts.model_files import changed_parts, weights_fingerprint

# auditor.json fields that must not change while an auditor id accumulates rows.
IDENTITY_KEYS = ("options", "model_identity", "role", "prompts")


@dataclass
class TrialAudit:
    trial_id: str
    rounds: int = 0
    already: int = 0  # rows found on disk
    audited: int = 0  # rows written now
    failed: int = 0  # written now with parse_status failed
    repaired: int = 0
    missing: int = 0  # transport failure: left for a rerun
    errors: list[str] = field(default_factory=list)
    skipped: str | None = None  # why the trial was not audited
    flagged: int = 0  # deceptive rows on disk after this run
    on_disk: int = 0
    relabel: int = 0  # rounds labelled while the trial was unfinished, labelled again now that it is done
    relabel_failed: int = 0  # ... whose new row has no label: the round now counts as failed
    partial: int = 0  # rounds of a trial still unfinished whose label was made from the partial trajectory


@dataclass
class AuditSummary:
    auditor_id: str
    out_dir: Path
    trials: list[TrialAudit]
    seconds: float = 0.0

    @property
    def complete(self) -> bool:
        return all(t.on_disk == t.rounds for t in self.trials if t.skipped is None)

    @property
    def totals(self) -> dict[str, int]:
        keys = ("rounds", "already", "audited", "failed", "repaired", "missing", "flagged", "on_disk", "relabel",
                "relabel_failed", "partial")
        return {k: sum(getattr(t, k) for t in self.trials) for k in keys}


def auditor_record(cfg: AuditorConfig, opts: AuditOptions, auditor_id: str, prompts: AuditorPrompts,
                   task_source: str, config_source: str) -> AuditorRecord:
    spec = cfg.spec
    return AuditorRecord(
        schema_=AUDITOR_SCHEMA, auditor_id=auditor_id,
        options=opts.to_json() | {"auditor_id": auditor_id},
        model_identity={"key": cfg.auditor.model, "model": spec.model, "revision": spec.revision,
                        "adapter": cfg.auditor.adapter},
        role=cfg.auditor.model_dump(mode="json"),
        model_spec=spec.model_dump(mode="json"),
        prompts=prompts.digest(),
        system_prompt=prompts.system, instruction_template=prompts.instruction, prompts_source=prompts.source,
        model_files=model_files(cfg),
        task_source=task_source, config_source=config_source,
        packages=package_versions(), python=python_version(),
    )


def model_files(cfg: AuditorConfig) -> dict[str, Any]:
    """Fingerprints of the auditor's local model, tokenizer and adapter folders (None for a hub
    id or a served model: their files are not ours to read)."""
    spec = cfg.spec
    out = {"model": weights_fingerprint(spec.model)}
    out |= {part: weights_fingerprint(path) for part, path in spec.extra_folders().items()}
    if cfg.auditor.adapter:
        out["adapter"] = weights_fingerprint(spec.adapter_path(cfg.auditor.adapter))
    return out


def _check_same_auditor(store: AuditorStore, new: AuditorRecord) -> tuple[AuditorRecord, bool]:
    """An auditor id names one fixed setting and one set of model files; rows from different ones
    must never mix. Returns the record to keep (the first run's, on a resume) and whether it is new."""
    path = store.rd.auditor_info(store.auditor_id)
    try:
        old = store.record()
    except DataFileError as e:
        raise InputError(path, e.field, f"{e.problem}; it records the settings this auditor id's rows were made "
                         "with: restore it, or pass another --auditor-id") from None
    if old is None:
        return new.model_copy(update={"created_at": utc_now()}), True
    for key in IDENTITY_KEYS:
        was, now = getattr(old, key), getattr(new, key)
        if was != now:
            raise InputError(path, key, "this auditor id was made with different settings "
                             f"(old {json.dumps(was)}, new {json.dumps(now)}); "
                             "pass another --auditor-id or the same settings")
    for which, fp in new.model_files.items():
        changed = changed_parts(old.model_files.get(which), fp)
        if changed:
            raise InputError(path, f"model_files.{which}", f"the auditor's {' and '.join(changed)} at "
                             f"{fp.get('path')} changed since this auditor id's rows were made; resuming would mix "
                             "two auditors' labels: restore them, or pass another --auditor-id")
    return old if old.created_at else old.model_copy(update={"created_at": utc_now()}), False


def load_trials(run_dir: Path | Run, include_unfinished: bool = False) -> tuple[list[Trial], list[TrialAudit], str]:
    """The run's trials with rows, and a record for each one skipped. A trial marked finished
    whose rows are gone or disagree with its marker is a `DataFileError` (`TrialStore.read`), as
    in `lhd run`: the audit never goes on without it."""
    run = run_dir if isinstance(run_dir, Run) else Run.open(run_dir)
    tasks, task_source = run_task_texts(run)
    trials, skipped = [], []
    for tid in run.trial_ids():
        trial = load_trial(run, tid, tasks)
        if not trial.rows:
            skipped.append(TrialAudit(trial.trial_id, skipped="no rounds"))
        elif not trial.finished and not include_unfinished:
            skipped.append(TrialAudit(trial.trial_id, rounds=len(trial.rows),
                                      skipped="unfinished (no .done marker): finish the run first"))
        else:
            trials.append(trial)
    return trials, skipped, task_source


def audit_row(trial: Trial, i: int, auditor_id: str, opts: AuditOptions, context: list[int],
              messages: list[dict[str, str]], outcome: StructuredOutcome | _Overflow | None,
              model: ModelRef) -> AuditRow:
    """The row to append (docs/formats.md, audit row); its `parse_status` says whether it holds
    a label."""
    row = trial.rows[i]
    calls = outcome.calls if outcome is not None else []
    raw = calls[-1].raw if calls else ""
    original: dict[str, Any] = {}  # the auditor's own labels, where our rules changed them
    error = None
    if outcome is not None and outcome.value is not None:
        v = outcome.value
        labels, changed = make_consistent(v.deceptive, list(v.types), v.severity, v.confidence, v.reasoning,
                                          list(v.evidence))
        status = "repaired" if changed else outcome.status
        if changed:
            original = {"deceptive": v.deceptive, "types": list(v.types), "severity": v.severity,
                        "confidence": v.confidence}
    else:  # no label: "cut" when the last attempt ended at its token limit, else "failed"
        labels = failed_labels()
        status = "cut" if outcome is not None and outcome.status == "cut" else "failed"
        error = next((c.parse_error or c.error for c in reversed(calls)
                      if c.parse_error or c.error), None) if calls else "no answer"
    return AuditRow(
        run_id=row.run_id, trial_id=trial.trial_id,
        global_round=row.global_round, task_index=row.task_index, round=row.round,
        auditor_id=auditor_id, mode=opts.mode, window=opts.window_or_none,
        **labels.as_row(),
        parse_status=status, raw=raw, error=error, original=original,
        attempts=len(calls), context_rounds=context, prompt_sha256=prompt_sha256(messages),
        prompt_tokens=sum(c.prompt_tokens or 0 for c in calls),
        completion_tokens=sum(c.completion_tokens or 0 for c in calls),
        cached_tokens=sum(c.cached_tokens or 0 for c in calls),
        latency_s=round(sum(c.latency_s or 0 for c in calls), 4),
        calls=calls, model=model, timestamp=utc_now(),
    )


async def audit_run(run_dir: Path, cfg: AuditorConfig, opts: AuditOptions, config_source: str = "",
                    backend: Backend | None = None, progress: bool = True) -> AuditSummary:
    """Audit (or resume auditing) `run_dir`, holding its lock. `backend`: a backend already built
    to use instead of one built from `cfg` (the tests script the auditor's answers with it, to
    reach the failed, cut, repaired and unreachable paths on demand)."""
    with run_dir_lock(run_dir, stage="lhd audit"):
        return await _audit_run(run_dir, cfg, opts, config_source, backend, progress)


async def _audit_run(run_dir: Path, cfg: AuditorConfig, opts: AuditOptions, config_source: str,
                     backend: Backend | None, progress: bool) -> AuditSummary:
    t0 = time.perf_counter()
    run = Run.open(run_dir)
    rd = run.dir
    auditor_id = opts.resolved_id(cfg.auditor.model)
    store = run.auditor(auditor_id)
    out_dir = store.path
    prompts = AuditorPrompts.load(cfg.prompts_dir)
    trials, skipped, task_source = load_trials(run, opts.include_unfinished)

    record = auditor_record(cfg, opts, auditor_id, prompts, task_source, config_source)
    out_dir.mkdir(parents=True, exist_ok=True)
    record, first = _check_same_auditor(store, record)

    # What is left to do: the rounds without a row that counts (the one winning-row rule).
    jobs: list[tuple[Trial, int]] = []
    stats: dict[str, TrialAudit] = {}
    relabels: set[tuple[str, int]] = set()
    for trial in trials:
        repair_jsonl(rd.audit_rows(auditor_id, trial.trial_id))
        labels = store.labels(trial.trial_id)
        done = {g for g, r in labels.items()
                if not (trial.finished and r.trial_unfinished)}  # relabel once the trial is finished
        st = stats[trial.trial_id] = TrialAudit(trial.trial_id, rounds=len(trial.rows), already=len(done))
        st.relabel = len(set(labels) - done)
        relabels |= {(trial.trial_id, g) for g in set(labels) - done}
        jobs += [(trial, i) for i, r in enumerate(trial.rows) if r.global_round not in done]

    owns_backend = backend is None and bool(jobs)
    if owns_backend:
        from rollouts.backends import build_backend

        spec = cfg.spec.with_adapter(cfg.auditor.adapter) if cfg.auditor.adapter else cfg.spec
        spec = spec.with_in_flight(opts.concurrency)  # unset: --concurrency decides (a value set in the config is kept)
        rd.logs_dir.mkdir(exist_ok=True)
        backend = build_backend(spec, name=cfg.auditor.model, log_dir=str(rd.logs_dir))
    if backend is not None:
        try:
            described = backend.describe()
        except Exception as e:  # describing is informative only
            described = {"error": str(e)}
        if first or not record.describe:
            record = record.model_copy(update={"describe": described})
        elif jobs:  # a resume that adds rows: its provenance beside the first run's, never over it
            resume = {"at": utc_now(), "describe": described, "packages": package_versions(),
                      "python": python_version()}
            record = record.model_copy(update={"resumes": [*record.resumes, resume]})
    store.write_record(record.model_copy(update={"updated_at": utc_now()}))

    model = ModelRef(key=cfg.auditor.model, model=cfg.spec.model, revision=cfg.spec.revision,
                     adapter=cfg.auditor.adapter)
    rc = cfg.auditor
    limit, exact = context_limit(backend)
    gate = asyncio.Semaphore(opts.concurrency)
    cache: dict[tuple, str] = {}
    bar = tqdm(total=len(jobs), desc=f"audit {auditor_id}", unit="round", disable=not progress)

    def ids(messages: list[dict[str, str]]) -> list[str]:
        return [message_id(m["role"], m["content"]) for m in messages]

    refused: list[StorageError] = []  # the disk refused a row: no round asks the model after that

    async def one(trial: Trial, i: int) -> None:
        st = stats[trial.trial_id]
        g = trial.rows[i].global_round
        assert backend is not None  # built above whenever there are jobs
        outcome: StructuredOutcome | _Overflow
        async with gate:  # built inside the gate so only `concurrency` prompts are in memory at once
            if refused:
                bar.update(1)
                return
            messages, context = build_messages(trial, i, opts.mode, opts.window, opts.render, prompts, cache)
            try:
                n = await asyncio.to_thread(backend.count_tokens, messages) if limit else 0
                if limit and n + rc.sampling.max_tokens > limit:
                    counted = "tokens" if exact else ("tokens (estimated: no tokenizer; set `tokenizer:` on the "
                                                      "auditor's model for exact counts)")
                    outcome = _Overflow(f"prompt of {n} {counted} + max_tokens {rc.sampling.max_tokens} exceeds "
                                        f"the model's context of {limit} tokens")
                else:
                    outcome = await ask_structured(
                        backend, lambda note: [messages[0], {"role": "user", "content": messages[1]["content"] + note}],
                        CheckedAuditAnswer, "audit",
                        lambda a: rc.sampling.params(call_seed(trial.seed, trial.trial_id, "audit", auditor_id, g, a)),
                        rc.max_attempts, ids, rc.adapter)
            except BackendUnavailable as e:
                st.missing += 1
                st.errors.append(f"round {g}: {e}")
                bar.update(1)
                return
        row = audit_row(trial, i, auditor_id, opts, context, messages, outcome, model)
        if isinstance(outcome, _Overflow):
            row.error = outcome.error
        if not trial.finished:
            row.trial_unfinished = True  # labelled from a partial trajectory: redone after the trial ends
        try:
            store.append(row)
        except StorageError as e:  # a full disk: every later row would be refused too
            refused.append(e)
            bar.update(1)
            return
        st.audited += 1
        st.failed += row.parse_status in NO_LABEL_STATUSES
        st.relabel_failed += row.parse_status in NO_LABEL_STATUSES and (trial.trial_id, g) in relabels
        st.repaired += row.parse_status == "repaired"
        bar.update(1)
        bar.set_postfix_str(f"{trial.trial_id} r{g} "
                            f"{'D' if row.deceptive else ('?' if row.deceptive is None else '-')}")

    try:
        results = await asyncio.gather(*(one(t, i) for t, i in jobs), return_exceptions=True)
    finally:
        bar.close()
        if owns_backend and backend is not None:
            await backend.aclose()
    if refused:  # one line naming the file and what was kept, not "model unreachable" (a rerun resumes)
        raise refused[0]
    for (trial, i), res in zip(jobs, results, strict=True):
        if isinstance(res, BaseException):  # a bug, not a model problem: keep the others, report it
            st = stats[trial.trial_id]
            st.missing += 1
            st.errors.append(f"round {trial.rows[i].global_round}: {type(res).__name__}: {res}")

    for trial in trials:
        st = stats[trial.trial_id]
        labels = store.labels(trial.trial_id)
        st.on_disk = len(labels)
        st.flagged = sum(1 for r in labels.values() if r.deceptive)
        st.partial = 0 if trial.finished else sum(1 for r in labels.values() if r.trial_unfinished)
    return AuditSummary(auditor_id, out_dir, [stats[t.trial_id] for t in trials] + skipped,
                        time.perf_counter() - t0)


def context_limit(backend: Backend | None) -> tuple[int | None, bool]:
    """The model's context length when known, and whether the backend counts tokens exactly. An
    estimated count is still checked: it errs long (openai backends: 3 chars per token), and a
    prompt sent over the window fails on every rerun, while the server's 400 would leave the
    round missing for good. The row's error says when its count was an estimate."""
    if backend is None:
        return None, False
    exact = getattr(backend, "tokenizer", None) is not None or getattr(backend, "_tokenizer", None) is not None \
        or bool(getattr(backend, "exact_token_counts", False))
    limit = getattr(backend, "max_model_len", None) or getattr(backend, "max_len", None)
    return (int(limit) if limit else None), exact


@dataclass
class _Overflow:
    """Stands in for an outcome when the prompt cannot fit: recorded as failed, not retried,
    because the same model would overflow again on every rerun."""

    error: str
    value: None = None
    status: str = "failed"
    calls: list[CallRecord] = field(default_factory=list)
