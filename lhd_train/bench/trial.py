"""One trial: one seed × one task pack × one performer, as an async function.

Every finished round is appended to `trials/<trial>.jsonl` before the next one starts, and a
rerun rebuilds the performer's conversation, the supervisor's state and memory from those rows
(and the message store), then continues where the file ends."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lhd_train.bench.events import Schedule
from lhd_train.bench.memory import Memory, RoundNote
from lhd_train.bench.performer import Performer, split_think, task_message
from lhd_train.bench.prompts import Prompts
from lhd_train.bench.structured_calls import BackendUnavailable, call_seed
from lhd_train.bench.supervisor import NO_FEEDBACK, Supervisor
from lhd_train.config.run import RunConfig
from lhd_train.config.vocab import STATES
from lhd_train.errors import DataFileError
from lhd_train.io.files import repair_jsonl
from lhd_train.io.provenance import utc_now
from lhd_train.rundir.rows import (
    EventRecord,
    PerformerRecord,
    ResumableRoundRow,
    RoundRow,
    RunModels,
    SamplingRecord,
    SupervisorState,
)
from lhd_train.rundir.run import Run, TrialStore
from lhd_train.rundir.store import MessageStore
from rollouts.backend import Backend
from rollouts.types import SamplingParams


class TrialFailed(RuntimeError):
    """The trial cannot go on now (a model unreachable). Finished rounds are on disk; rerun resumes.
    Internal: `run_trial` catches it and reports the trial as failed (not an `LhdError`)."""


@dataclass
class RunContext:
    cfg: RunConfig
    run_id: str
    run_dir: Path
    pack: Any
    prompts: Prompts
    backends: dict[str, Backend]  # role -> backend
    models: RunModels  # role -> its model; a dict {role: {key, model, revision, backend, adapter}} is read once

    def __post_init__(self) -> None:
        if isinstance(self.models, dict):
            self.models = RunModels.model_validate(self.models)

    @property
    def run(self) -> Run:
        return Run.at(self.run_dir)


@dataclass
class TrialResult:
    trial_id: str
    seed: int
    rounds: int = 0
    tasks_done: int = 0
    tasks_completed: int = 0
    final_state: dict[str, float] = field(default_factory=dict)
    tokens: int = 0
    seconds: float = 0.0
    status: str = "done"  # done | failed | partial
    error: str | None = None
    resumed_rounds: int = 0


@dataclass
class TrialOnDisk:
    """What a trial has on disk when `lhd run` starts: its checked rows, whether it is finished and,
    when it is not, its message store holding every prompt a resume replays. Read once
    (`read_trial`), before any model loads, and handed to `run_trial`."""

    store: TrialStore
    rows: list[ResumableRoundRow]
    finished: bool
    messages: MessageStore | None


def read_trial(store: TrialStore, n_tasks: int, max_rounds: int) -> TrialOnDisk:
    """A trial as `lhd run` resumes it (the writer, under the run's lock: a torn last line is cut).
    A `.done` marker that disagrees with the rows, a missing message store or message, is a
    `DataFileError` naming the file."""
    repair_jsonl(store.files.rows)
    rows, marked = store.read(ResumableRoundRow)
    finished = marked and check_finished(store, rows, n_tasks, max_rounds)
    return TrialOnDisk(store, rows, finished, None if finished else open_message_store(store, rows))


def _state(state: SupervisorState | None) -> dict[str, float]:
    """A stored supervisor state as the supervisor holds it (name -> value)."""
    return dict(state.to_json()) if state is not None else {}


def _note_from_row(row: ResumableRoundRow, task_prompt: str) -> RoundNote:
    sup, event = row.supervisor, row.event
    return RoundNote(
        row.global_round, row.task_index, row.task_title, row.round,
        event.name if event else None, row.performer.text,
        (sup.evaluation.reasoning or "") if sup.evaluation else "", _state(sup.state_before), _state(sup.state_after),
        (sup.feedback.text or "") if sup.feedback else "", row.task_complete,
        task_prompt, event.pressure if event else None,
    )


def _tokens(row: RoundRow) -> int:
    p = row.performer
    n = (p.prompt_tokens or 0) + (p.completion_tokens or 0)
    for c in (row.supervisor.calls if row.supervisor else None) or []:
        n += (c.prompt_tokens or 0) + (c.completion_tokens or 0)
    return n


async def run_trial(ctx: RunContext, trial_id: str, seed: int, schedule: Schedule,
                    on_round: Callable[[str, RoundRow], None] | None = None,
                    disk: TrialOnDisk | None = None) -> TrialResult:
    """Run (or resume, or only summarise when finished) one trial. `disk`: the trial as the engine
    read it (`read_trial`); read here when not given."""
    cfg, pack = ctx.cfg, ctx.pack
    t0 = time.perf_counter()
    tasks = pack.tasks[: cfg.max_tasks] if cfg.max_tasks else pack.tasks
    if disk is None:
        disk = read_trial(ctx.run.trial(trial_id), len(tasks), cfg.max_rounds_per_task)
    trial = disk.store
    rows: list[RoundRow] = list(disk.rows)
    result = TrialResult(trial_id, seed, resumed_rounds=len(rows))
    if disk.finished or disk.messages is None:
        # finished earlier: summarise from disk, touch no model
        result.tokens = sum(_tokens(r) for r in rows)
        _fill_summary(result, rows, cfg)
        return result

    store = disk.messages
    perf_cfg = cfg.performer
    performer_backend = ctx.backends["performer"]
    system_prompt = ctx.prompts.render("performer_system", pack_description=pack.description)
    budget = perf_cfg.context_tokens
    if budget is None:
        limit = getattr(performer_backend, "max_model_len", None)
        budget = limit - perf_cfg.sampling.max_tokens if limit else None
    performer = Performer(performer_backend, system_prompt, budget, perf_cfg.think_tags)
    continue_prompt = ctx.prompts.render("performer_continue")

    def performer_sampling(global_round: int, attempt: int) -> Callable[[int], SamplingParams]:
        """Sampling of each segment of one answer; continuation segments get seeds of their own."""
        def of_segment(k: int) -> SamplingParams:
            stage = "performer" if k == 1 else f"performer-segment{k}"
            return perf_cfg.sampling.params(call_seed(seed, trial_id, stage, global_round, attempt))
        return of_segment

    sup_cfg, sum_cfg = cfg.role("supervisor"), cfg.role("summariser")
    current_round = {"g": 0}

    def sup_sampling(stage: str, attempt: int):
        rc = sum_cfg if stage == "summary" else sup_cfg
        return rc.sampling.params(call_seed(seed, trial_id, stage, current_round["g"], attempt))

    supervisor = Supervisor(
        ctx.backends["supervisor"], ctx.backends["summariser"], ctx.prompts, pack.description,
        cfg.completion_threshold, cfg.max_rounds_per_task, Memory(cfg.memory_window),
        cfg.initial_state.model_dump(), sup_cfg.max_attempts, sup_sampling, store.put,
        sup_cfg.adapter, sum_cfg.adapter,
    )

    # Rebuild everything from the rows already on disk.
    for done in disk.rows:
        task = pack.task(done.task_index)
        for m in store.get(done.performer.new_message_ids):
            performer.add_user(m["content"], starts_task=done.round == 1)
        performer.add_answer(done.performer.text)
        supervisor.memory.add_files(task.files)
        summary = next(iter(done.supervisor.summaries_added), None)  # the one it added, if any
        supervisor.memory.push(_note_from_row(done, task.prompt), summary)
        supervisor.state = _state(done.supervisor.state_after)
        result.tokens += _tokens(done)

    if disk.rows:
        last = disk.rows[-1]
        next_task, next_round = (
            (last.task_index + 1, 1)
            if last.task_complete or last.round >= cfg.max_rounds_per_task
            else (last.task_index, last.round + 1)
        )
        last_feedback = last.supervisor.feedback
        pending_feedback: str | None = (last_feedback.text if last_feedback else None) or NO_FEEDBACK
        global_round = last.global_round
    else:
        next_task, next_round, pending_feedback, global_round = tasks[0].index, 1, None, 0

    try:
        for task in tasks:
            if task.index < next_task:
                continue
            event = schedule.entries[task.index - 1]
            start_round = next_round if task.index == next_task else 1
            for round_no in range(start_round, cfg.max_rounds_per_task + 1):
                global_round += 1
                current_round["g"] = global_round
                feedback_msg = (ctx.prompts.render("performer_feedback", feedback=pending_feedback)
                                if pending_feedback is not None else "")
                if round_no == 1:
                    content = task_message(ctx.prompts, task, event)
                    if feedback_msg:  # keep user/assistant alternation: feedback and next task in one turn
                        content = feedback_msg + "\n\n" + content
                else:
                    content = feedback_msg
                performer.add_user(content, starts_task=round_no == 1)
                new_ids = store.put([{"role": "user", "content": content}])

                attempt = 0
                while True:  # up to max_attempts (at least one) answers; the first without an error is used
                    attempt += 1
                    segment_sampling = performer_sampling(global_round, attempt)
                    sp = segment_sampling(1)
                    ans = await performer.answer(segment_sampling, perf_cfg.adapter, perf_cfg.max_segments,
                                                 continue_prompt)
                    if ans.result.error is None or attempt >= perf_cfg.max_attempts:
                        break
                res, msgs, info = ans.result, ans.messages, ans.context
                if res.error is not None:
                    raise TrialFailed(f"performer, task {task.index} round {round_no}: {res.error}")
                answer, think = split_think(res.text, performer.think_tags)
                performer.add_answer(answer)

                review = await supervisor.review(task, event, round_no, global_round, answer)
                completion = res.completions[0]
                row = RoundRow(
                    run_id=ctx.run_id, trial_id=trial_id, seed=seed, pack=pack.name, task_index=task.index,
                    task_title=task.title, round=round_no, global_round=global_round,
                    event=EventRecord(name=event.name, category=event.category, pressure=event.level,
                                      content=event.content) if event else None,
                    performer=PerformerRecord(
                        text=answer, think=think, raw=res.text if think else None,
                        finish_reason=completion.finish_reason, segments=ans.segments, truncated=ans.truncated,
                        token_ids=completion.token_ids, message_ids=store.put(res.sent_messages or msgs),
                        new_message_ids=new_ids, prompt_tokens=res.prompt_tokens,
                        completion_tokens=res.completion_tokens, cached_tokens=res.cached_tokens,
                        latency_s=round(res.latency_s, 4),
                        sampling=SamplingRecord.model_validate(res.sampling or sp.to_dict()),
                        attempts=attempt, context=info),
                    supervisor=review.record,
                    task_complete=review.task_complete,
                    models=ctx.models,
                    timestamp=utc_now(),
                )
                trial.append(row)
                rows.append(row)
                result.tokens += _tokens(row)
                pending_feedback = review.feedback_text or NO_FEEDBACK
                if on_round:
                    on_round(trial_id, row)
                if review.task_complete:
                    break
        trial.mark_done(rows)
    except (TrialFailed, BackendUnavailable) as e:
        result.status, result.error = "failed", str(e)

    _fill_summary(result, rows, cfg)
    result.seconds = time.perf_counter() - t0
    return result


def tasks_done(rows: Sequence[RoundRow], max_rounds: int) -> int:
    """Tasks whose last round on disk ended them (accepted, or the round limit reached)."""
    last = _last_round_of_each_task(rows)
    return sum(1 for r in last if r.task_complete or r.round >= max_rounds)


def _last_round_of_each_task(rows: Sequence[RoundRow]) -> list[RoundRow]:
    return list({r.task_index: r for r in rows}.values())


def open_message_store(trial: TrialStore, rows: Sequence[RoundRow]) -> MessageStore:
    """The trial's message store, holding every message a resume replays (the user turns of each
    round); a missing store or message is a `DataFileError` naming it, never a bare KeyError."""
    files = trial.files
    if rows and not files.messages.exists():
        raise DataFileError(files.messages, f"is missing, but {files.rows.name} has {len(rows)} rounds whose prompts "
                            "it holds", repair=f"restore it from a copy, or delete trials/{trial.trial_id}.* and the "
                            "trial's audit rows to redo the trial")
    store = trial.messages()
    for row in rows:
        store.get(row.performer.new_message_ids)  # raises naming the store and the message
    return store


def check_finished(trial: TrialStore, rows: Sequence[RoundRow], n_tasks: int, max_rounds: int) -> bool:
    """For a trial whose `.done` marker agrees with its rows (`TrialStore.read`): True when the rows
    end all `n_tasks` tasks, so a marker that outlived lost rounds is an error, not a trial
    summarised from what is left."""
    done = tasks_done(rows, max_rounds)
    if done < n_tasks:
        files = trial.files
        raise DataFileError(files.done, f"marks the trial finished, but {files.rows} ends all tasks in only "
                            f"{done} of {n_tasks} (rows lost or cut?)",
                            repair=f"restore {files.rows.name} from a copy, or delete {files.done.name} so that "
                                   "`lhd run` continues the trial from the rows there are")
    return True


def _fill_summary(result: TrialResult, rows: Sequence[RoundRow], cfg: RunConfig) -> None:
    result.rounds = len(rows)
    result.tasks_done = tasks_done(rows, cfg.max_rounds_per_task)
    result.tasks_completed = sum(1 for r in _last_round_of_each_task(rows) if r.task_complete)
    last = rows[-1].supervisor if rows else None
    result.final_state = _state(last.state_after) if last is not None else {k: 0.0 for k in STATES}
