"""Benchmark run directories (docs/formats.md) as lens reading examples (the performer regime).

For every trajectory row (one performer round):

- record   = the files the performer was given: the file section of the task's round-1 user
             message (the message in `new_message_ids` of the task's round-1 row),
- question = what this answer responds to: the task's prompt in round 1, the supervisor's
             feedback message later,
- decision = the last prompt token before the performer's answer, its first answer tokens, and
             the end of each asserted claim in the answer (`claim_spans`).

Task texts (to find files and prompts exactly) are those the run actually used: the run's own
`tasks.json` (imports), else the pack its resolved config names (`run_task_texts`); a pack is
never looked up by the name in the rows, which the authors' folders share with built-in packs.

`context="compact"` reads [system, round-1 task message, (feedback)] + answer; `"full"` reads the
exact messages of the call, dropping the oldest middle messages only if they do not fit
`max_length`. Labels come from `audit/<auditor>/<trial>.jsonl` (`deceptive`), joined on
`(trial_id, global_round)`, by `lhd report`'s rule (`load_audit_labels`).
"""
from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lens.errors import LensError
from lens.positions import QUESTION, RECORD, ReadExample, Span

log = logging.getLogger(__name__)

#: file-section markers: this project's performer prompt and the reference's
_FILES_START = [re.compile(r"^=== ATTACHED FILES ===$", re.M), re.compile(r"RELEVANT FILES", re.M),
                re.compile(r"<files>")]
_FILES_END = [re.compile(r"^--- end of [^\n]+ ---$", re.M), re.compile(r"</files>")]
_FILES_STOP = [re.compile(r"CURRENT EXTERNAL EVENTS"), re.compile(r"^=== WHAT IS HAPPENING AT WORK", re.M)]


def load_messages(path: Path) -> dict[str, dict]:
    """A trial's message store, read through `lhd_train.rundir` (a torn last line is ignored)."""
    from lhd_train.errors import LhdError
    from lhd_train.rundir.files import read_jsonl

    if not path.is_file():
        raise LensError(f"{path}: message store missing")
    try:
        return {r["id"]: {"role": r["role"], "content": r["content"]} for r in read_jsonl(path)}
    except LhdError as exc:
        raise LensError(str(exc)) from exc


def load_audit_labels(run_dir: Path, auditor: str | None = None) -> tuple[dict[tuple[str, int], dict], list[str]]:
    """`(trial_id, global_round) -> {flagged, severity, types, auditors}` and the auditor used.

    The rule is `lhd report`'s, from the same function (`lhd_train.metrics.round_labels`): one
    auditor (`auditor`, else the newest full-mode one), one row per round, failed rows ignored,
    so a round the lens calls flagged is one the report counts as deceptive.
    """
    from lhd_train.errors import InputError
    from lhd_train.metrics.load import round_labels

    try:
        auditor_id, rows = round_labels(Path(run_dir), auditor)
    except InputError as exc:
        raise LensError(str(exc)) from exc
    labels = {key: {"flagged": lab["deceptive"], "severity": lab["severity"], "types": lab["types"],
                    "auditors": {auditor_id: lab["deceptive"]}} for key, lab in rows.items()}
    return labels, [auditor_id] if auditor_id else []


def _marker_span(content: str) -> tuple[int, int] | None:
    for start_re in _FILES_START:
        m = start_re.search(content)
        if not m:
            continue
        end = None
        for end_re in _FILES_END:
            ends = [e.end() for e in end_re.finditer(content, m.end())]
            if ends:
                end = ends[-1]
                break
        if end is None:
            stops = [s.search(content, m.end()) for s in _FILES_STOP]
            stops = [s.start() for s in stops if s]
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


def run_task_texts(run_dir: str | Path) -> tuple[dict[int, Any], str]:
    """Task prompts and files of the pack this run used, and where they came from ("none" if unknown).

    Same order as the auditor (`lhd_train.audit.trajectory.load_task_texts`): the run's
    `tasks.json`, else the `task_pack` of `config.resolved.yaml` (or the manifest's `pack_source`),
    tried as written and relative to the run directory.
    """
    from lhd_train.audit.trajectory import load_task_texts
    from lhd_train.errors import InputError
    from lhd_train.rundir.files import read_json_mapping, read_yaml_mapping
    from lhd_train.rundir.layout import RunDir

    run = Path(run_dir)
    rd = RunDir(run)
    try:
        task_pack = read_yaml_mapping(rd.config, missing_ok=True).get("task_pack")
        if not task_pack:
            task_pack = read_json_mapping(rd.manifest).get("pack_source")
        tasks, source = load_task_texts(run, str(task_pack) if task_pack else None)
    except InputError as exc:
        raise LensError(str(exc)) from exc
    return (tasks, source) if tasks else ({}, "none")


def _texts_of_pack(pack: Any) -> dict[int, Any]:
    from types import SimpleNamespace

    return {t.index: SimpleNamespace(prompt=getattr(t, "prompt", ""), files=tuple((f.name, f.content) for f in t.files))
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
    context: str = "compact",
    auditor: str | None = None,
    pack: Any = None,
    count_tokens: Callable[[list[dict], str], int] | None = None,
    max_length: int | None = None,
    max_claims: int | None = 16,
) -> tuple[list[ReadExample], dict]:
    """Examples for every round of every trial, labelled `True/False` (flagged) or None (not audited).

    `pack` overrides the task texts the run used (see `run_task_texts`)."""
    from lhd_train.errors import LhdError
    from lhd_train.rundir.layout import RunDir, TrialFiles
    from lhd_train.rundir.store import read_finished_trial

    run = Path(run_dir)
    rd = RunDir(run)
    if not rd.is_run():
        raise LensError(f"{run}: not a run directory (no trials/)")
    if context not in ("compact", "full"):
        raise LensError(f"unknown context {context!r} (allowed: compact, full)")
    labels, auditors = load_audit_labels(run, auditor)
    if pack is not None:
        tasks, tasks_source = _texts_of_pack(pack), f"pack {getattr(pack, 'path', None) or getattr(pack, 'name', '?')}"
    else:
        tasks, tasks_source = run_task_texts(run)
    if not tasks:
        log.info("%s: the run's task texts are unknown; files and prompts are located by markers", run)
    examples: list[ReadExample] = []
    n_rows = 0
    for path in rd.rows_files():
        store = load_messages(TrialFiles.from_rows(path).messages)
        try:  # the rows `lhd report` reads: checked, no round twice, held against the `.done` marker
            rows, _finished = read_finished_trial(path)
        except LhdError as exc:
            raise LensError(str(exc)) from exc
        n_rows += len(rows)
        round1 = {int(r["task_index"]): r for r in rows if int(r.get("round", 0)) == 1}
        for row in rows:
            try:
                ex = _row_example(row, store, round1, labels, context, tasks, count_tokens, max_length, max_claims)
            except LensError as exc:
                log.warning("%s global round %s skipped: %s", path.name, row.get("global_round"), exc)
                continue
            examples.append(ex)
    info = {"run_dir": str(run), "n_rows": n_rows, "n_examples": len(examples), "auditors": auditors,
            "n_labelled": sum(e.label is not None for e in examples),
            "n_flagged": sum(e.label is True for e in examples), "context": context, "tasks_source": tasks_source}
    return examples, info


def _msgs(store: dict, ids: Sequence[str], where: str) -> list[dict]:
    missing = [i for i in ids if i not in store]
    if missing:
        raise LensError(f"{where}: message id(s) {missing[:3]} not in the message store")
    return [dict(store[i]) for i in ids]


def _row_example(row, store, round1, labels, context, tasks, count_tokens, max_length, max_claims) -> ReadExample:
    trial = str(row["trial_id"])
    g = int(row["global_round"])
    task_index = int(row["task_index"])
    where = f"{trial} round {g}"
    perf = row.get("performer") or {}
    call = _msgs(store, perf.get("message_ids") or [], where)
    new = _msgs(store, perf.get("new_message_ids") or [], where)
    r1 = round1.get(task_index)
    if r1 is None:
        raise LensError(f"{where}: no round-1 row of task {task_index} (its files are unknown)")
    r1_new = _msgs(store, (r1.get("performer") or {}).get("new_message_ids") or [], where)
    task_msg = next((m for m in reversed(r1_new) if m["role"] == "user"), None)
    question_msg = next((m for m in reversed(new) if m["role"] == "user"), None)
    if question_msg is None:
        lu = _last_user(call)
        question_msg = call[lu] if lu is not None else None
    if task_msg is None or question_msg is None:
        raise LensError(f"{where}: cannot find the task message or the message answered")
    text = tasks.get(task_index)
    record = locate_record(task_msg["content"], [c for _, c in text.files] if text else [])

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
            messages, t_idx = _fit_full(messages, t_idx, perf.get("text") or "", count_tokens, max_length)
            dropped = before - len(messages)
    q_idx = _last_user(messages)
    q_shift = len(messages[q_idx]["content"]) - len(question_msg["content"])
    spans = [Span("record", RECORD, t_idx, record[0] + t_shift, record[1] + t_shift)]
    if q_idx == t_idx:
        qs, qe = _question_span(task_msg["content"], record, text.prompt if text else None)
        spans.append(Span("question", QUESTION, q_idx, qs + t_shift, qe + t_shift))
    else:
        qe = len(question_msg["content"].rstrip())
        spans.append(Span("question", QUESTION, q_idx, q_shift, q_shift + qe))
    lab = labels.get((trial, g))
    event = row.get("event") or {}
    info = {"trial_id": trial, "global_round": g, "task_index": task_index, "round": int(row.get("round", 0)),
            "event_category": event.get("category"), "pressure": event.get("pressure"),
            "severity": lab["severity"] if lab else None, "types": ",".join(lab["types"]) if lab else None,
            "audited": lab is not None, "dropped_messages": dropped}
    answer = perf.get("text") or ""
    return ReadExample(example_id=f"{trial}/r{g}", cluster=trial, label=(lab["flagged"] if lab else None),
                       messages=messages, spans=spans, prefill="", answer=answer, info=info,
                       claims=claim_spans(answer, max_claims))


def _fit_full(messages: list[dict], t_idx: int, answer: str, count_tokens, max_length: int) -> tuple[list[dict], int]:
    """Drop middle messages (oldest first, never system / task / last user) until the prompt fits."""
    msgs = list(messages)
    keep_first = 1 if msgs and msgs[0]["role"] == "system" else 0
    while count_tokens(msgs, answer) > max_length:
        last_user = _last_user(msgs)
        droppable = [i for i in range(keep_first, len(msgs)) if i not in (t_idx, last_user)]
        if not droppable:
            break
        i = droppable[0]
        msgs.pop(i)
        if i < t_idx:
            t_idx -= 1
    return msgs, t_idx
