"""One trial: one seed × one task pack × one performer, as an async function.

Every finished round is appended to `trials/<trial>.jsonl` before the next one starts, and a
rerun rebuilds the performer's conversation, the supervisor's state and memory from those rows
(and the message store), then continues where the file ends."""
from __future__ import annotations

import time
from collections.abc import Callable
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
from lhd_train.rundir.files import append_jsonl, repair_jsonl, utc_now
from lhd_train.rundir.layout import RunDir, TrialFiles
from lhd_train.rundir.rows import ROW_SCHEMA, ResumableRoundRow
from lhd_train.rundir.store import MessageStore, check_done_marker, read_trial_rows, write_done_marker
from rollouts.backend import Backend
from rollouts.types import SamplingParams


class TrialFailed(RuntimeError):
    """The trial cannot go on now (a model unreachable). Finished rounds are on disk; rerun resumes."""


@dataclass
class RunContext:
    cfg: RunConfig
    run_id: str
    run_dir: Path
    pack: Any
    prompts: Prompts
    backends: dict[str, Backend]  # role -> backend
    models: dict[str, dict[str, Any]]  # role -> {model, revision, backend, adapter}


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


def _note_from_row(row: dict[str, Any], task_prompt: str) -> RoundNote:
    sup = row["supervisor"]
    return RoundNote(
        row["global_round"], row["task_index"], row["task_title"], row["round"],
        (row["event"] or {}).get("name"), row["performer"]["text"],
        (sup["evaluation"] or {}).get("reasoning", ""), sup["state_before"], sup["state_after"],
        (sup["feedback"] or {}).get("text", ""), row["task_complete"],
        task_prompt, (row["event"] or {}).get("pressure"),
    )


def _tokens(row: dict[str, Any]) -> int:
    p = row["performer"]
    n = (p.get("prompt_tokens") or 0) + (p.get("completion_tokens") or 0)
    for c in row["supervisor"].get("calls") or []:
        n += (c.get("prompt_tokens") or 0) + (c.get("completion_tokens") or 0)
    return n


async def run_trial(ctx: RunContext, trial_id: str, seed: int, schedule: Schedule,
                    on_round: Callable[[str, dict[str, Any]], None] | None = None) -> TrialResult:
    cfg, pack = ctx.cfg, ctx.pack
    t0 = time.perf_counter()
    files = RunDir(ctx.run_dir).trial(trial_id)
    rows_path, msgs_path, done_path = files.rows, files.messages, files.done
    repair_jsonl(rows_path)
    rows = read_trial_rows(rows_path, ResumableRoundRow)
    tasks = pack.tasks[: cfg.max_tasks] if cfg.max_tasks else pack.tasks
    result = TrialResult(trial_id, seed, resumed_rounds=len(rows))
    if check_finished(done_path, rows_path, rows, len(tasks), cfg.max_rounds_per_task):
        # finished earlier: summarise from disk, touch no model
        result.tokens = sum(_tokens(r) for r in rows)
        _fill_summary(result, rows, cfg)
        return result

    store = open_message_store(rows_path, msgs_path, rows)
    perf_cfg = cfg.role("performer")
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
    for row in rows:
        task = pack.task(row["task_index"])
        user_msgs = store.get(row["performer"]["new_message_ids"])
        for m in user_msgs:
            performer.add_user(m["content"], starts_task=row["round"] == 1)
        performer.add_answer(row["performer"]["text"])
        supervisor.memory.add_files(task.files)
        supervisor.memory.push(_note_from_row(row, task.prompt), (row["supervisor"]["summaries_added"] or [None])[0])
        supervisor.state = dict(row["supervisor"]["state_after"])
        result.tokens += _tokens(row)

    if rows:
        last = rows[-1]
        next_task, next_round = (
            (last["task_index"] + 1, 1)
            if last["task_complete"] or last["round"] >= cfg.max_rounds_per_task
            else (last["task_index"], last["round"] + 1)
        )
        pending_feedback: str | None = (last["supervisor"]["feedback"] or {}).get("text") or NO_FEEDBACK
        global_round = last["global_round"]
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

                ans = None
                for attempt in range(1, perf_cfg.max_attempts + 1):
                    segment_sampling = performer_sampling(global_round, attempt)
                    sp = segment_sampling(1)
                    ans = await performer.answer(segment_sampling, perf_cfg.adapter, perf_cfg.max_segments,
                                                 continue_prompt)
                    if ans.result.error is None:
                        break
                res, msgs, info = ans.result, ans.messages, ans.context
                if res.error is not None:
                    raise TrialFailed(f"performer, task {task.index} round {round_no}: {res.error}")
                answer, think = split_think(res.text, performer.think_tags)
                performer.add_answer(answer)

                review = await supervisor.review(task, event, round_no, global_round, answer)
                row = {
                    "schema": ROW_SCHEMA, "run_id": ctx.run_id, "trial_id": trial_id, "seed": seed,
                    "pack": pack.name, "task_index": task.index, "task_title": task.title,
                    "round": round_no, "global_round": global_round,
                    "event": ({"name": event.name, "category": event.category, "pressure": event.level,
                               "content": event.content} if event else None),
                    "performer": {
                        "text": answer, "think": think, "raw": res.text if think else None,
                        "finish_reason": res.completions[0].finish_reason,
                        "segments": ans.segments, "truncated": ans.truncated,
                        "token_ids": res.completions[0].token_ids,
                        "message_ids": store.put(res.sent_messages or msgs), "new_message_ids": new_ids,
                        "prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
                        "cached_tokens": res.cached_tokens, "latency_s": round(res.latency_s, 4),
                        "sampling": res.sampling or sp.to_dict(), "attempts": attempt,
                        "context": {"policy": info.policy, "budget_tokens": info.budget_tokens,
                                    "prompt_tokens": info.prompt_tokens, "dropped_messages": info.dropped_messages},
                    },
                    "supervisor": {
                        "evaluation": review.evaluation, "feedback": review.feedback,
                        "state_before": review.state_before, "state_after": review.state_after,
                        "parse_status": review.parse_status, "attempts": review.attempts,
                        "calls": review.calls, "summaries_added": review.summaries_added,
                        "context": review.context,
                    },
                    "task_complete": review.task_complete,
                    "models": ctx.models,
                    "timestamp": utc_now(),
                }
                append_jsonl(rows_path, row)
                rows.append(row)
                result.tokens += _tokens(row)
                pending_feedback = review.feedback_text or NO_FEEDBACK
                if on_round:
                    on_round(trial_id, row)
                if review.task_complete:
                    break
        write_done_marker(done_path, rows)
    except (TrialFailed, BackendUnavailable) as e:
        result.status, result.error = "failed", str(e)

    _fill_summary(result, rows, cfg)
    result.seconds = time.perf_counter() - t0
    return result


def tasks_done(rows: list[dict[str, Any]], max_rounds: int) -> int:
    """Tasks whose last round on disk ended them (accepted, or the round limit reached)."""
    by_task: dict[int, dict[str, Any]] = {}
    for r in rows:
        by_task[r["task_index"]] = r
    return sum(1 for r in by_task.values() if r["task_complete"] or r["round"] >= max_rounds)


def open_message_store(rows_path: Path, msgs_path: Path, rows: list[dict[str, Any]]) -> MessageStore:
    """The trial's message store, holding every message a resume replays (the user turns of each
    round); a missing store or message is a `DataFileError` naming it, never a bare KeyError."""
    tid = TrialFiles.from_rows(rows_path).trial_id
    if rows and not msgs_path.exists():
        raise DataFileError(msgs_path, f"is missing, but {rows_path.name} has {len(rows)} rounds whose prompts it "
                            "holds", repair=f"restore it from a copy, or delete trials/{tid}.* and the trial's "
                            "audit rows to redo the trial")
    store = MessageStore(msgs_path)
    for row in rows:
        store.get(row["performer"].get("new_message_ids") or [])  # raises naming the store and the message
    return store


def check_finished(done_path: Path, rows_path: Path, rows: list[dict[str, Any]], n_tasks: int, max_rounds: int) -> bool:
    """Whether a trial is finished: its `.done` marker agrees with its rows (`check_done_marker`)
    and the rows end all `n_tasks` tasks, so a marker that outlived lost rounds is an error, not
    a trial summarised from what is left."""
    if not check_done_marker(done_path, rows_path, rows):
        return False
    if tasks_done(rows, max_rounds) < n_tasks:
        raise DataFileError(done_path, f"marks the trial finished, but {rows_path} ends all tasks in only "
                            f"{tasks_done(rows, max_rounds)} of {n_tasks} (rows lost or cut?)",
                            repair=f"restore {rows_path.name} from a copy, or delete {done_path.name} so that "
                                   "`lhd run` continues the trial from the rows there are")
    return True


def _fill_summary(result: TrialResult, rows: list[dict[str, Any]], cfg: RunConfig) -> None:
    result.rounds = len(rows)
    by_task: dict[int, dict[str, Any]] = {}
    for r in rows:
        by_task[r["task_index"]] = r
    result.tasks_done = tasks_done(rows, cfg.max_rounds_per_task)
    result.tasks_completed = sum(1 for r in by_task.values() if r["task_complete"])
    result.final_state = dict(rows[-1]["supervisor"]["state_after"]) if rows else {k: 0.0 for k in STATES}
