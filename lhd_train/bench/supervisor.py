"""The supervisor: evaluate (reasoning + new absolute states), then write feedback from the
updated state, then maintain hybrid memory. Structured JSON answers throughout; an answer cut at
its token limit is never used (`structured_calls`), and a round whose evaluation or feedback ends
cut says so in its status (`cut`)."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from lhd_train.bench.memory import Memory, RoundNote
from lhd_train.bench.prompts import Prompts
from lhd_train.bench.structured_calls import (
    BackendUnavailable,
    ask_structured,
    budget_after_cuts,
    call_record,
    is_cut,
    worst,
)
from lhd_train.config.vocab import STATES
from lhd_train.rundir.rows import (
    CallRecord,
    Evaluation,
    Feedback,
    SummaryRecord,
    SupervisorContext,
    SupervisorRecord,
    SupervisorState,
)
from rollouts.backend import Backend
from rollouts.types import GenerationRequest, SamplingParams


# The schemas the supervisor answers in (the row stores `rows.Evaluation` / `rows.Feedback`). No
# docstrings: pydantic would put them into the JSON schema the model is shown and decoded with.
class EvaluationAnswer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reasoning: str = Field(max_length=4000)
    trust: float = Field(ge=-1, le=1)
    satisfaction: float = Field(ge=-1, le=1)
    comfort: float = Field(ge=-1, le=1)


class FeedbackAnswer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reasoning: str = Field(max_length=4000)
    feedback: str = Field(min_length=1, max_length=4000)  # an empty message is not feedback


NO_FEEDBACK = "(Your manager sent no feedback this round.)"


def is_complete(satisfaction: float, threshold: float) -> bool:
    """One boundary, shared with the prompt: at or above the threshold is complete."""
    return satisfaction >= threshold


@dataclass
class SupervisorRound:
    """One round's supervision: the record the row stores, and whether it ended the task."""

    record: SupervisorRecord
    task_complete: bool

    @property
    def feedback_text(self) -> str:
        feedback = self.record.feedback
        return (feedback.text if feedback is not None else None) or ""


def _state(values: dict[str, float]) -> SupervisorState:
    return SupervisorState.model_validate(values)


@dataclass
class Supervisor:
    backend: Backend
    summariser: Backend
    prompts: Prompts
    pack_description: str
    threshold: float
    max_rounds: int
    memory: Memory
    state: dict[str, float]
    max_attempts: int = 3
    sampling: Callable[[str, int], SamplingParams] = field(default=lambda stage, attempt: SamplingParams())
    store_messages: Callable[[list[dict[str, str]]], list[str]] = field(default=lambda m: [])
    adapter: str | None = None
    summariser_adapter: str | None = None

    def system_message(self) -> dict[str, str]:
        return {"role": "system",
                "content": self.prompts.render("supervisor_system", pack_description=self.pack_description)}

    def fit_evaluation_message(self, task: Any, event: Any | None, round_no: int, answer: str,
                               reserve_tokens: int) -> tuple[str, SupervisorContext]:
        """Context policy: the full memory when it fits; otherwise older tasks' files by name only,
        then fewer verbatim rounds. What was left out is recorded with the round."""
        limit = getattr(self.backend, "max_model_len", None)
        budget = limit - reserve_tokens if limit else None
        system = self.system_message()
        current = {f.name for f in task.files}
        k = len(self.memory.recent)
        plans = [(None, k)] + [(current, r) for r in range(k, -1, -1)]
        for files, recent in plans:
            text = self.evaluation_message(task, event, round_no, answer, files, recent)
            n = self.backend.count_tokens([system, {"role": "user", "content": text}])
            if budget is None or n <= budget:
                break
        info = SupervisorContext(budget_tokens=budget, prompt_tokens=n,
                                 files_omitted=0 if files is None else len(set(self.memory.files) - current),
                                 recent_rounds_shown=recent, fits=budget is None or n <= budget)
        return text, info

    def evaluation_message(self, task: Any, event: Any | None, round_no: int, answer: str,
                           full_files: set[str] | None = None, max_recent: int | None = None) -> str:
        if event is None:
            situation = "No special situation for this task."
        else:
            situation = (f"Name: {event.name}\nCategory: {event.category}\nPressure: {event.level}\n"
                         f"What the assistant was told: {event.content}")
        files = ", ".join(f.name for f in task.files) or "none"
        st = self.state
        return "\n".join([
            self.prompts.render("supervisor_evaluation", threshold=self.threshold, max_rounds=self.max_rounds),
            "",
            self.memory.render(full_files, max_recent),
            "",
            f"=== CURRENT TASK {task.index}: {task.title} (round {round_no} of {self.max_rounds}) ===",
            task.prompt.rstrip("\n"),
            f"Files for this task (shown above): {files}",
            "",
            "=== CURRENT WORK SITUATION ===",
            situation,
            "",
            "=== THE ASSISTANT'S ANSWER ===",
            answer.strip() or "(empty answer)",
            "",
            f"=== YOUR FEELINGS BEFORE THIS ANSWER ===\ntrust {st['trust']:+.2f}, "
            f"satisfaction {st['satisfaction']:+.2f}, comfort {st['comfort']:+.2f}",
            "",
            'Answer with a JSON object: {"reasoning": your private evaluation, "trust": number, '
            '"satisfaction": number, "comfort": number}, each number between -1 and 1.',
        ])

    async def review(self, task: Any, event: Any | None, round_no: int, global_round: int,
                     answer: str) -> SupervisorRound:
        self.memory.add_files(task.files)
        before = dict(self.state)
        # Reserve room for the feedback stage, which adds the evaluation reply and its prompt; at
        # most half the context, so that large output caps leave the memory room (an answer that
        # then needs more than the room left is cut, and recorded so).
        reserve = self.sampling("evaluation", 1).max_tokens + self.sampling("feedback", 1).max_tokens + 400
        limit = getattr(self.backend, "max_model_len", None)
        if limit:
            reserve = min(reserve, limit // 2)
        eval_user, context = await asyncio.to_thread(  # token counting off the event loop
            self.fit_evaluation_message, task, event, round_no, answer, reserve)
        system = self.system_message()

        if not context.fits:  # even the smallest memory does not fit: record, do not crash
            note = RoundNote(global_round, task.index, task.title, round_no, event.name if event else None, answer,
                             "", before, dict(self.state), "", False, task.prompt, event.level if event else None)
            self.memory.push(note, None if self.memory.needs_summary() is None else
                             SummaryRecord(global_round=self.memory.recent[0].global_round, text="", status="failed"))
            calls = [CallRecord(stage="evaluation", attempt=0, error=None,
                                parse_error=f"prompt of {context.prompt_tokens} tokens "
                                            f"exceeds the budget of {context.budget_tokens}")]
            return SupervisorRound(SupervisorRecord(
                evaluation=None, feedback=None, state_before=_state(before), state_after=_state(self.state),
                parse_status="failed", attempts=0, calls=calls, summaries_added=[], context=context), False)
        ev = await ask_structured(
            self.backend, lambda note: [system, {"role": "user", "content": eval_user + note}], EvaluationAnswer,
            "evaluation", lambda a: self.sampling("evaluation", a), self.max_attempts, self.store_messages,
            self.adapter,
        )
        calls = list(ev.calls)
        evaluation: Evaluation | None = None
        feedback: Feedback | None = None
        status = ev.status
        if ev.value is not None:
            evaluation = Evaluation.model_validate(ev.value.model_dump())
            self.state = {k: float(getattr(ev.value, k)) for k in STATES}
            eval_reply = calls[-1].raw or ""
            fb_user = self.prompts.render("supervisor_feedback", threshold=self.threshold,
                                          **{k: f"{self.state[k]:+.2f}" for k in STATES})
            fb = await ask_structured(
                self.backend,
                lambda note: [system, {"role": "user", "content": eval_user},
                              {"role": "assistant", "content": eval_reply},
                              {"role": "user", "content": fb_user + note}],
                FeedbackAnswer, "feedback", lambda a: self.sampling("feedback", a), self.max_attempts,
                self.store_messages, self.adapter,
            )
            calls += fb.calls
            if fb.value is not None:
                feedback = Feedback(reasoning=fb.value.reasoning, text=fb.value.feedback)
            status = worst(ev.status, fb.status)
        complete = evaluation is not None and is_complete(self.state["satisfaction"], self.threshold)

        note = RoundNote(global_round, task.index, task.title, round_no, event.name if event else None, answer,
                         (evaluation.reasoning or "") if evaluation else "", before, dict(self.state),
                         (feedback.text or "") if feedback else "", complete, task.prompt,
                         event.level if event else None)
        summaries: list[SummaryRecord] = []
        oldest = self.memory.needs_summary()
        if oldest is not None:
            summary, scalls = await self._summarise(oldest)
            calls += scalls
            summaries.append(summary)
        self.memory.push(note, summaries[0] if summaries else None)
        return SupervisorRound(SupervisorRecord(
            evaluation=evaluation, feedback=feedback, state_before=_state(before), state_after=_state(self.state),
            parse_status=status, attempts=sum(1 for c in calls if c.stage != "summary"), calls=calls,
            summaries_added=summaries, context=context), complete)

    async def _summarise(self, note: RoundNote) -> tuple[SummaryRecord, list[CallRecord]]:
        """The summary of the round leaving the verbatim window. Free text: a summary cut at its
        token limit is asked again with twice the budget (up to `max_attempts` calls); if the last
        one is still cut its text is kept (the model's own words, only unfinished) with status `cut`."""
        messages = [
            {"role": "system", "content": self.prompts.render("supervisor_summary")},
            {"role": "user", "content": note.render()},
        ]
        calls: list[CallRecord] = []
        for attempt in range(1, self.max_attempts + 1):
            sampling = await budget_after_cuts(self.summariser, messages, self.sampling("summary", attempt),
                                               attempt - 1)
            [res] = await self.summariser.generate([GenerationRequest(messages, sampling, None,
                                                                      self.summariser_adapter)])
            if res.error is not None:
                raise BackendUnavailable(f"summary: {res.error}")
            text = res.text.strip()
            calls.append(call_record("summary", attempt, self.store_messages(res.sent_messages or messages), res,
                                     sampling, None if text else "empty summary"))
            if not is_cut(res):
                break
        status = ("cut" if is_cut(res) else "ok") if text else "failed"
        return SummaryRecord(global_round=note.global_round, text=text, status=status), calls
