"""A benchmark run directory (docs/formats.md) as reading examples: for each performer round, the
record (the files of the round-1 message), the question (the task prompt, or the supervisor's
feedback), the answer (an assistant turn: `pre_answer`, `answer_1..k`, `claim_1..n`) and the
decision (the last token after the elicitation turn, `lens.elicit`). Positions before the answer
are negative controls; the task is the stratum. Task texts are the run's own; labels are `lhd
report`'s (`round_labels`); the run is read through `Run`, so a damaged run fails as in `lhd
report`. The whole rule, `full` and `compact` contexts included: docs/lens.md, "Benchmark runs"."""
from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from lens.elicit import elicitation
from lens.errors import LensError
from lens.positions import DECISION, QUESTION, RECORD, ReadExample, Span
from lhd_train.audit.trajectory import TaskText, load_task_texts
from lhd_train.bench.taskpack import TaskPack
from lhd_train.metrics.labels import RoundLabel, round_labels
from lhd_train.rundir.rows import RoundRow
from lhd_train.rundir.run import Run

log = logging.getLogger(__name__)

#: file-section markers: this project's performer prompt and the reference's
_FILES_START = [re.compile(r"^=== ATTACHED FILES ===$", re.M), re.compile(r"RELEVANT FILES", re.M),
                re.compile(r"<files>")]
_FILES_END = [re.compile(r"^--- end of [^\n]+ ---$", re.M), re.compile(r"</files>")]
_FILES_STOP = [re.compile(r"CURRENT EXTERNAL EVENTS"), re.compile(r"^=== WHAT IS HAPPENING AT WORK", re.M)]


def _marker_span(content: str) -> tuple[int, int] | None:
    for start_re in _FILES_START:
        m = start_re.search(content)
        if not m:
            continue
        end: int | None = None
        for end_re in _FILES_END:
            ends = [e.end() for e in end_re.finditer(content, m.end())]
            if ends:
                end = ends[-1]
                break
        if end is None:
            stops = [found.start() for s in _FILES_STOP if (found := s.search(content, m.end()))]
            end = min(stops) if stops else len(content)
        return m.start(), end
    return None


def locate_record(content: str, file_contents: Sequence[str] = ()) -> tuple[int, int]:
    """Character span of the files inside a task message.

    With the task's file contents known (from its pack), the span runs from the first to the end
    of the last file found verbatim (widened to the surrounding file-section markers when they
    enclose it); else the section between known markers; else the whole message.
    """
    found = []
    for fc in file_contents:
        body = fc.strip()
        if body:
            i = content.find(body)
            if i >= 0:
                found.append((i, i + len(body)))
    marked = _marker_span(content)
    if found:
        span = (min(s for s, _ in found), max(e for _, e in found))
        if marked and marked[0] <= span[0] and span[1] <= marked[1]:
            return marked
        return span
    if marked:
        return marked
    return 0, len(content)


_TASK_BANNER = re.compile(r"^=== TASK [^\n]* ===$", re.M)


def _question_span(content: str, record: tuple[int, int], prompt: str | None = None) -> tuple[int, int]:
    """What a round-1 answer responds to: the task's prompt. Found verbatim when the task texts are
    known; else the text between the task banner (if any) and the files; else what follows the
    files; else the whole message."""
    body = (prompt or "").strip()
    if body and (i := content.find(body)) >= 0:
        return i, i + len(body)
    rs, re_ = record
    banners = [m for m in _TASK_BANNER.finditer(content, 0, rs)]
    start = banners[-1].end() if banners else 0
    head = content[start:rs]
    if head.strip():
        lead = len(head) - len(head.lstrip())
        return start + lead, start + len(head.rstrip())
    text_end = len(content.rstrip())
    tail = content[re_:text_end]
    if tail.strip():
        return re_ + len(tail) - len(tail.lstrip()), text_end
    return 0, text_end


def _last_user(messages: Sequence[dict]) -> int | None:
    return max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)


def _find_message(messages: Sequence[dict], content: str) -> tuple[int, int] | None:
    """Index of the message holding `content` (exactly or after an inserted prefix) and that prefix length."""
    for i, m in enumerate(messages):
        if m["content"] == content:
            return i, 0
    for i, m in enumerate(messages):
        if m["content"].endswith(content):
            return i, len(m["content"]) - len(content)
    return None


def run_task_texts(run_dir: str | Path | Run) -> tuple[dict[int, TaskText], str]:
    """Task prompts and files of the pack this run used, and where they came from ("none" if unknown).

    The auditor's loader (`lhd_train.audit.trajectory.load_task_texts`), so the lens locates the
    files the auditor showed: the run's `tasks.json`, else the `task_pack` of the run config (or
    the manifest's `pack_source`), tried as written and relative to the run directory, and only
    when it is the pack the run used."""
    run = run_dir if isinstance(run_dir, Run) else Run.open(run_dir)
    task_pack = run.config().get("task_pack")
    if not task_pack:
        manifest = run.manifest()
        task_pack = manifest.pack_source if manifest else None
    tasks, source = load_task_texts(run.path, str(task_pack) if task_pack else None)
    return (tasks, source) if tasks else ({}, "none")


def _texts_of_pack(pack: TaskPack) -> dict[int, TaskText]:
    return {t.index: TaskText(t.index, t.title, t.prompt, tuple((f.name, f.content) for f in t.files))
            for t in pack.tasks}


_SENTENCE_END = re.compile(r"[.!?](?=\s|$)")
_EDGE_MARKUP = " \t|-*•#>"


def claim_spans(answer: str, max_claims: int | None = None) -> list[tuple[int, int]]:
    """Characters `[start, end)` of the asserted claims of a report: each sentence (or list or
    table line) that states a figure, ending on its final character. More than `max_claims` are
    thinned evenly over the answer."""
    spans = []
    for line in re.finditer(r"[^\n]+", answer):
        cuts = [m.end() for m in _SENTENCE_END.finditer(line.group())]
        bounds = [0, *cuts] + ([len(line.group())] if not cuts or cuts[-1] < len(line.group()) else [])
        for a, b in zip(bounds, bounds[1:], strict=False):
            seg = line.group()[a:b]
            lead = len(seg) - len(seg.lstrip(_EDGE_MARKUP))
            body = seg.strip(_EDGE_MARKUP)
            if body and re.search(r"\d", body) and re.search(r"[^\W\d_]", body):
                s = line.start() + a + lead
                spans.append((s, s + len(body)))
    if max_claims is not None and len(spans) > max_claims:
        step = (len(spans) - 1) / max(max_claims - 1, 1)
        spans = [spans[round(i * step)] for i in range(max_claims)] if max_claims > 1 else spans[:1]
    return spans


def load_run_examples(
    run_dir: str | Path,
    *,
    context: str = "full",
    auditor: str | None = None,
    pack: TaskPack | None = None,
    count_tokens: Callable[[list[dict]], int] | None = None,
    max_length: int | None = None,
    max_claims: int | None = 16,
) -> tuple[list[ReadExample], dict]:
    """Examples for every round of every trial, labelled `True/False` (flagged) or None (not audited).

    `pack` overrides the task texts the run used (see `run_task_texts`). Trials are read as
    `lhd report` reads them (`TrialStore.read`: checked rows, a finished trial held against its
    `.done` marker); a damaged file is lhd's `DataFileError`, naming the file and line."""
    if context not in ("compact", "full"):
        raise LensError(f"unknown context {context!r} (allowed: compact, full)")
    run = Run.open(run_dir)
    auditor_id, labels = round_labels(run, auditor)  # an unknown `auditor` is lhd's InputError
    if pack is not None:
        tasks, tasks_source = _texts_of_pack(pack), f"pack {pack.path or pack.name}"
    else:
        tasks, tasks_source = run_task_texts(run)
    if not tasks:
        log.info("%s: the run's task texts are unknown; files and prompts are located by markers", run.path)
    examples: list[ReadExample] = []
    skipped: list[dict] = []
    n_rows = 0
    for trial in run.trials():
        rows, _finished = trial.read(RoundRow)
        messages_of = trial.messages().get  # ids -> chat messages; an id the store lacks: DataFileError
        n_rows += len(rows)
        round1 = {r.task_index: r for r in rows if r.round == 1}
        for row in rows:
            try:
                ex = _row_example(row, trial.trial_id, messages_of, round1, labels, context, tasks, count_tokens,
                                  max_length, max_claims)
            except LensError as exc:
                log.warning("%s global round %s skipped: %s", trial.files.rows.name, row.global_round, exc)
                skipped.append({"example_id": f"{row.trial_id or trial.trial_id}/r{row.global_round}",
                                "reason": str(exc)})
                continue
            examples.append(ex)
    info = {"run_dir": str(run.path), "n_rows": n_rows, "n_examples": len(examples),
            "auditors": [auditor_id] if auditor_id else [],
            "n_labelled": sum(e.label is not None for e in examples),
            "n_flagged": sum(e.label is True for e in examples), "context": context, "tasks_source": tasks_source,
            "skipped": skipped, "elicitation": elicitation()}
    return examples, info


def _row_example(row: RoundRow, trial_id: str, messages_of: Callable[[list[str]], list[dict[str, str]]],
                 round1: dict[int, RoundRow],
                 labels: dict[tuple[str, int], RoundLabel], context: str, tasks: dict[int, TaskText],
                 count_tokens: Callable[[list[dict]], int] | None, max_length: int | None,
                 max_claims: int | None) -> ReadExample:
    trial = row.trial_id or trial_id
    g = row.global_round
    task_index = row.task_index
    where = f"{trial} round {g}"
    perf = row.performer
    call = messages_of(perf.message_ids or [])
    new = messages_of(perf.new_message_ids or [])
    r1 = round1.get(task_index)
    if r1 is None:
        raise LensError(f"{where}: no round-1 row of task {task_index} (its files are unknown)")
    r1_new = messages_of(r1.performer.new_message_ids or [])
    task_msg = next((m for m in reversed(r1_new) if m["role"] == "user"), None)
    question_msg = next((m for m in reversed(new) if m["role"] == "user"), None)
    if question_msg is None:
        lu = _last_user(call)
        question_msg = call[lu] if lu is not None else None
    if task_msg is None or question_msg is None:
        raise LensError(f"{where}: cannot find the task message or the message answered")
    text = tasks.get(task_index)
    record = locate_record(task_msg["content"], [c for _, c in text.files] if text else [])
    answer = perf.text or ""
    if not answer.strip():
        raise LensError(f"{where}: the answer is empty (nothing to judge)")
    tail = [{"role": "assistant", "content": answer}, {"role": "user", "content": elicitation()}]

    dropped = 0  # messages of the call left out to fit max_length (full context), in examples.parquet
    if context == "compact":
        messages = [m for m in call[:1] if m["role"] == "system"] + [dict(task_msg)]
        t_idx, t_shift = len(messages) - 1, 0
        if question_msg["content"] != task_msg["content"]:
            messages.append(dict(question_msg))
    else:
        messages = call
        found = _find_message(messages, task_msg["content"])
        if found is None:
            raise LensError(f"{where}: the task's round-1 message is not in this call's context (dropped)")
        t_idx, t_shift = found
        q_found = _find_message(messages[t_idx:], question_msg["content"])
        if q_found is None:
            raise LensError(f"{where}: the message answered is not the call's")
        if count_tokens is not None and max_length is not None:
            before = len(messages)
            messages, t_idx = _fit_full(messages, t_idx, tail, count_tokens, max_length)
            dropped = before - len(messages)
    q_idx = _last_user(messages)
    if q_idx is None:
        raise LensError(f"{where}: the context holds no user message")
    q_shift = len(messages[q_idx]["content"]) - len(question_msg["content"])
    spans = [Span("record", RECORD, t_idx, record[0] + t_shift, record[1] + t_shift)]
    if q_idx == t_idx:
        qs, qe = _question_span(task_msg["content"], record, text.prompt if text else None)
        spans.append(Span("question", QUESTION, q_idx, qs + t_shift, qe + t_shift))
    else:
        qe = len(question_msg["content"].rstrip())
        spans.append(Span("question", QUESTION, q_idx, q_shift, q_shift + qe))
    a_idx = len(messages)
    spans += [Span("answer", DECISION, a_idx, 0, len(answer)),
              Span("elicitation", QUESTION, a_idx + 1, 0, len(tail[1]["content"]))]
    lab = labels.get((trial, g))
    event = row.event
    info = {"trial_id": trial, "global_round": g, "task_index": task_index, "round": row.round,
            "event_category": event.category if event else None, "pressure": event.pressure if event else None,
            "severity": lab.severity if lab else None, "types": ",".join(lab.types) if lab else None,
            "audited": lab is not None, "dropped_messages": dropped}
    return ReadExample(example_id=f"{trial}/r{g}", cluster=trial, label=(lab.deceptive if lab else None),
                       messages=messages + tail, spans=spans, prefill="", answer=answer, info=info,
                       claims=claim_spans(answer, max_claims), stratum=f"task {task_index}", judged="answer")


def _fit_full(messages: list[dict], t_idx: int, tail: list[dict], count_tokens,
              max_length: int) -> tuple[list[dict], int]:
    """Drop middle messages (oldest first, never system / task / last user) until the prompt and
    `tail` (the answer and the elicitation) fit."""
    msgs = list(messages)
    keep_first = 1 if msgs and msgs[0]["role"] == "system" else 0
    while count_tokens(msgs + tail) > max_length:
        last_user = _last_user(msgs)
        droppable = [i for i in range(keep_first, len(msgs)) if i not in (t_idx, last_user)]
        if not droppable:
            break
        i = droppable[0]
        msgs.pop(i)
        if i < t_idx:
            t_idx -= 1
    return msgs, t_idx
