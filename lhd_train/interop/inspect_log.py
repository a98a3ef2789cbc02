"""`lhd export RUN --format inspect --out FILE`: a run as an inspect_ai evaluation log.

Written with inspect_ai's own types and writer (`EvalLog`, `EvalSample`, `write_eval_log`; the
optional extra `inspect`), never by imitating its file format, so `inspect view` reads it: one
sample per performer round (its exact messages, the supervisor's and each auditor's scores, and the
known label as a `ground_truth` score where the run has one: a curated set, a planted copy, an
entitle experiment, whose code label and cell go in the sample's metadata too), the run in the
header. Trials are held against their `.done` markers; the file is written under a temporary name
and renamed into place. docs/formats.md, "inspect_ai logs"."""
from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from lhd_train.audit.ground_truth import LabelledAnswer, ground_truth_path, read_ground_truth
from lhd_train.errors import InputError
from lhd_train.io.provenance import utc_now
from lhd_train.rundir.rows import AuditRow, RoundRow
from lhd_train.rundir.run import Run

FORMATS = {".eval": "eval", ".json": "json"}  # inspect_ai's two log formats, by the file's suffix


def _label_score(label: AuditRow) -> Any:
    from inspect_ai.scorer import Score

    value: dict[str, str | int | float | bool | None] = {
        "deceptive": None if label.deceptive is None else int(label.deceptive),
        "severity": label.severity, "parse_status": label.parse_status}
    if label.confidence is not None:
        value["confidence"] = label.confidence
    return Score(value=value, answer=", ".join(label.types) or None, explanation=label.reasoning,
                 metadata={"auditor_id": label.auditor_id, "mode": label.mode, "evidence": list(label.evidence)})


def _truth_score(truth: LabelledAnswer) -> Any:
    from inspect_ai.scorer import Score

    return Score(value={"deceptive": int(truth.deceptive), "severity": truth.severity}, answer=truth.type,
                 explanation=truth.why, metadata={"source": truth.source, "item": truth.item, "cluster": truth.cluster})


#: an entitle answer's record fields that a reader of the log needs (its token ids stay in the run)
ENTITLE_FIELDS = ("id", "fact", "files", "pressure", "sample", "label", "subtype", "shown", "demanded", "asserted")


def _supervisor_score(row: RoundRow) -> Any | None:
    from inspect_ai.scorer import Score

    sup = row.supervisor
    if sup is None:
        return None
    after = sup.state_after.to_json() if sup.state_after is not None else {}
    value = {k: after.get(k) for k in ("trust", "satisfaction", "comfort")}
    reasoning = sup.evaluation.reasoning if sup.evaluation is not None else None
    return Score(value=value, explanation=reasoning,
                 metadata={"state_before": sup.state_before.to_json() if sup.state_before is not None else None,
                           "feedback": sup.feedback.to_json() if sup.feedback is not None else None,
                           "parse_status": sup.parse_status})


def _messages(stored: list[dict[str, str]], answer: str, model: str) -> list[Any]:
    from inspect_ai.model import ChatMessageAssistant, ChatMessageSystem, ChatMessageUser

    kinds = {"system": ChatMessageSystem, "user": ChatMessageUser, "assistant": ChatMessageAssistant}
    out = [kinds.get(m["role"], ChatMessageUser)(content=m["content"]) for m in stored]
    return out + [ChatMessageAssistant(content=answer, model=model)]


def round_sample(row: RoundRow, stored: list[dict[str, str]], labels: dict[str, AuditRow | None],
                 truth: LabelledAnswer | None = None) -> Any:
    """One performer round as an `EvalSample` (`stored`: the messages it was sent; `labels`: each
    auditor's label of it, None where that auditor has none; `truth`: its known label, if any)."""
    from inspect_ai.log import EvalSample
    from inspect_ai.model import ModelOutput

    model = (row.models.performer.model if row.models.performer is not None else None) or "performer"
    scores: dict[str, Any] = {}
    if (sup := _supervisor_score(row)) is not None:
        scores["supervisor"] = sup
    for aid, label in labels.items():
        if label is not None:
            scores[aid] = _label_score(label)
    if truth is not None:
        scores["ground_truth"] = _truth_score(truth)
    extra = (row.model_extra or {}).get("entitle")
    entitle = {k: extra.get(k) for k in ENTITLE_FIELDS} if isinstance(extra, dict) else None
    user = [m["content"] for m in stored if m["role"] == "user"]
    return EvalSample(
        id=f"{row.trial_id}-r{row.global_round}", epoch=1, input=user[-1] if user else "", target="",
        messages=_messages(stored, row.performer.text, model),
        output=ModelOutput.from_content(model=model, content=row.performer.text), scores=scores or None,
        metadata={"trial_id": row.trial_id, "seed": row.seed, "task_index": row.task_index,
                  "task_title": row.task_title, "round": row.round, "global_round": row.global_round,
                  "event": row.event.to_json() if row.event is not None else None,
                  "task_complete": row.task_complete, "finish_reason": row.performer.finish_reason,
                  "missing_labels": sorted(aid for aid, label in labels.items() if label is None),
                  **({"entitle": entitle} if entitle is not None else {})})


def run_log(run: Run) -> Any:
    """The whole run as an `EvalLog` (header, one sample per round, counts)."""
    from inspect_ai.log import EvalConfig, EvalDataset, EvalLog, EvalResults, EvalSpec, EvalStats

    auditors = run.auditor_ids()
    known = read_ground_truth(run) if ground_truth_path(run).is_file() else []
    truths = {(t.trial_id, t.global_round): t for t in known}
    samples = []
    stamps: list[str | None] = []  # when each round was written (None: an imported round)
    for trial in run.trials():
        rows, _ = trial.read(RoundRow)  # a finished trial whose rows were cut is an error
        rows.sort(key=lambda r: r.global_round)
        if not rows:
            continue
        store = trial.messages() if trial.files.messages.exists() else None
        labels = {aid: run.auditor(aid).labels(trial.trial_id) for aid in auditors}
        for row in rows:
            ids = list(row.performer.message_ids)
            # A run without a message store (a set built from answers alone) exports the answers with
            # no prompt, flagged `prompt_missing` as `lhd export` flags it; a store that lacks a
            # message its rows name is damage, and `get` refuses it naming the file.
            stored = store.get(ids) if store is not None else []
            stamps.append(row.timestamp)
            sample = round_sample(row, stored, {aid: labels[aid].get(row.global_round) for aid in auditors},
                                  truths.get((row.trial_id, row.global_round)))
            sample.metadata["prompt_missing"] = bool(ids) and store is None
            samples.append(sample)
    if not samples:
        raise InputError(run.dir.trials_dir, None, "the run has no rounds to export")
    manifest = run.manifest()
    config = run.config()
    models = {role: m.to_json() for role, m in manifest.models.items()} if manifest is not None else {}
    performer = (models.get("performer") or {}).get("model") or samples[0].output.model
    pack = (manifest.pack if manifest is not None else None) or config.get("task_pack") or "lhd"
    created = (manifest.started_at or manifest.created_at) if manifest is not None else None
    run_id = (manifest.run_id if manifest is not None else None) or run.path.name
    spec = EvalSpec(
        created=created or utc_now(), task=f"lhd/{pack}", run_id=run_id, eval_id=uuid.uuid4().hex,
        dataset=EvalDataset(name=str(pack), samples=len(samples), sample_ids=[s.id for s in samples]),
        model=str(performer), config=EvalConfig(),
        metadata={"lhd_run": str(run.path.absolute()), "run_id": run_id, "models": models,
                  "seeds": list(manifest.seeds) if manifest is not None else config.get("seeds"),
                  "config": config, "auditors": auditors})
    times = sorted(t for t in stamps if t)
    return EvalLog(status="success", eval=spec, samples=samples,
                   results=EvalResults(total_samples=len(samples), completed_samples=len(samples)),
                   stats=EvalStats(started_at=created or (times[0] if times else ""),
                                   completed_at=times[-1] if times else ""))


def export_inspect(run_dir: Path | Run, out: Path) -> Any:
    """Write `run_dir` as an inspect_ai log at `out` (`.eval` or `.json`) and return the `EvalLog`."""
    out = Path(out)
    fmt = FORMATS.get(out.suffix)
    if fmt is None:
        raise InputError("command line", "--out", f"{out.name} is not an inspect log name",
                         "a file ending in .eval or .json")
    if out.is_dir():
        raise InputError("command line", "--out", f"{out} is a folder; --format inspect writes one file",
                         "a file ending in .eval or .json")
    try:
        from inspect_ai.log import write_eval_log
    except ImportError:
        raise InputError("command line", "--format", "inspect needs inspect_ai, which is not installed",
                         "pip install -e '.[inspect]' in a venv of its own; docs/formats.md, "
                         "\"inspect_ai logs\"") from None
    run = run_dir if isinstance(run_dir, Run) else Run.open(run_dir)
    log = run_log(run)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.{os.getpid()}-{uuid.uuid4().hex[:8]}{out.suffix}")
    try:
        write_eval_log(log, str(tmp), format=fmt)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return log
