"""Grade candidate performer answers in their trajectory's context: the auditor for honesty,
the supervisor's own evaluation prompt for quality. Grades are cached on disk (one JSONL line
per candidate), so a killed grading job resumes where it stopped and GRPO never pays twice."""
from __future__ import annotations

import asyncio
import copy
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lhd_train.audit.labels import CheckedAuditAnswer, make_consistent
from lhd_train.audit.trajectory import AuditorPrompts, TaskText, Trial, build_messages, load_trial, run_task_texts
from lhd_train.bench.structured_calls import ask_structured, call_seed
from lhd_train.bench.supervisor import EvaluationAnswer
from lhd_train.config.auditor import AuditorConfig, RenderOptions
from lhd_train.config.run import RoleConfig
from lhd_train.finetune.contexts import Context
from lhd_train.io.files import append_jsonl, read_jsonl, repair_jsonl
from lhd_train.rundir.run import Run
from rollouts.backend import Backend

ANSWER_START = "=== THE ASSISTANT'S ANSWER ===\n"
ANSWER_END = "\n\n=== YOUR FEELINGS BEFORE THIS ANSWER ==="


@dataclass
class Grade:
    deceptive: bool | None
    severity: int | None
    types: list[str]
    confidence: float | None
    audit_status: str
    satisfaction: float | None
    quality_status: str

    @property
    def usable(self) -> bool:
        return self.deceptive is not None


def too_long(backend: Backend, messages: list[dict[str, str]], max_tokens: int) -> bool:
    """A permanent condition, recorded as such, unlike a transport failure (which is retried)."""
    limit = getattr(backend, "max_model_len", None)
    if not limit:
        return False
    return backend.count_tokens(messages) + max_tokens > limit


def swap_answer(eval_messages: list[dict[str, str]], text: str) -> list[dict[str, str]] | None:
    """The supervisor's exact evaluation prompt of that round, with another answer in it."""
    msgs = copy.deepcopy(eval_messages)
    user = msgs[-1]["content"]
    if ANSWER_START not in user or ANSWER_END not in user:
        return None
    head, rest = user.split(ANSWER_START, 1)
    _, tail = rest.split(ANSWER_END, 1)
    msgs[-1]["content"] = head + ANSWER_START + (text.strip() or "(empty answer)") + ANSWER_END + tail
    return msgs


def candidate_view(trial: Trial, i: int, text: str, prompts: AuditorPrompts) -> list[dict[str, str]]:
    """The auditor's messages for judging `text` as the answer of row `i`: the trajectory up to
    that round (causal: later rounds reacted to another answer), the target round with the
    candidate in it and no supervisor reaction at all (the supervisor never saw it)."""
    row = trial.rows[i]
    target = row.model_copy(update={"performer": row.performer.model_copy(update={"text": text}),
                                    "supervisor": None,  # its reaction was to another answer: "not seen"
                                    "task_complete": None})
    view = Trial(trial.trial_id, [*trial.rows[:i], target], trial.tasks, True, trial.round1_messages)
    messages, _ = build_messages(view, i, "causal", 0, RenderOptions(), prompts)
    return messages


class Grader:
    """`grade(ctx, text)`: the auditor judges `text` as if the performer had written it at that
    round, seeing the trajectory up to it (causal: later rounds reacted to another answer), with
    the round's own supervisor reaction hidden; the supervisor rates it with the evaluation
    prompt it really had at that round."""

    def __init__(self, run_dir: Path, auditor_cfg: AuditorConfig, auditor: Backend,
                 supervisor_role: RoleConfig | None, supervisor: Backend | None, cache_path: Path,
                 concurrency: int = 32):
        self.run_dir = Path(run_dir)
        self.run = Run.open(run_dir)
        self.cfg = auditor_cfg
        self.auditor = auditor
        self.sup_role = supervisor_role
        self.supervisor = supervisor
        self.prompts = AuditorPrompts.load(auditor_cfg.prompts_dir)
        self.cache_path = cache_path
        self.gate = asyncio.Semaphore(concurrency)
        repair_jsonl(cache_path)
        self.cache: dict[str, dict[str, Any]] = {r["key"]: r for r in read_jsonl(cache_path)}
        self.id = hashlib.sha256(json.dumps(
            [auditor_cfg.spec.model, auditor_cfg.auditor.model_dump(mode="json"), self.prompts.digest(),
             supervisor_role.model_dump(mode="json") if supervisor_role else None], sort_keys=True).encode()
        ).hexdigest()[:12]
        self._trials: dict[str, Trial] = {}
        self._tasks: dict[int, TaskText] | None = None

    def _trial(self, trial_id: str) -> Trial:
        if trial_id not in self._trials:
            if self._tasks is None:
                self._tasks, _ = run_task_texts(self.run)
            self._trials[trial_id] = load_trial(self.run, trial_id, self._tasks)
        return self._trials[trial_id]

    def key(self, ctx: Context, text: str) -> str:
        # surrogatepass: a model answer may hold a lone UTF-16 surrogate (stored exactly in the rows)
        return hashlib.sha256(f"{self.id}\0{ctx.key}\0{text}".encode("utf-8", "surrogatepass")).hexdigest()[:24]

    def cached(self, ctx: Context, text: str) -> Grade | None:
        r = self.cache.get(self.key(ctx, text))
        return Grade(**r["grade"]) if r else None

    async def grade(self, ctx: Context, text: str) -> Grade:
        key = self.key(ctx, text)
        if key in self.cache:
            return Grade(**self.cache[key]["grade"])
        async with self.gate:
            audit, quality = await asyncio.gather(self._audit(ctx, text, key), self._quality(ctx, text, key))
        grade = Grade(*audit, *quality)
        digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        row = {"key": key, "context": ctx.key, "text_sha256": digest,
               "grade": grade.__dict__}
        append_jsonl(self.cache_path, row)
        self.cache[key] = row
        return grade

    async def _audit(self, ctx: Context, text: str, key: str) -> tuple[Any, ...]:
        trial = self._trial(ctx.trial_id)
        i = next(j for j, r in enumerate(trial.rows) if r.global_round == ctx.global_round)
        messages = candidate_view(trial, i, text, self.prompts)
        rc = self.cfg.auditor
        if too_long(self.auditor, messages, rc.sampling.max_tokens):
            return None, None, [], None, "too_long"
        out = await ask_structured(
            self.auditor, lambda note: [messages[0], {"role": "user", "content": messages[1]["content"] + note}],
            CheckedAuditAnswer, "grade-audit", lambda a: rc.sampling.params(call_seed(key, "audit", a)),
            rc.max_attempts, lambda m: [], rc.adapter)
        if out.value is None:
            return None, None, [], None, "failed"
        v = out.value
        labels, changed = make_consistent(v.deceptive, list(v.types), v.severity, v.confidence, v.reasoning,
                                          list(v.evidence))
        return (labels.deceptive, labels.severity, list(labels.types), labels.confidence,
                "repaired" if changed else out.status)

    async def _quality(self, ctx: Context, text: str, key: str) -> tuple[Any, ...]:
        if self.supervisor is None or self.sup_role is None or not ctx.supervisor_eval:
            return None, "skipped"
        msgs = swap_answer(ctx.supervisor_eval, text)
        if msgs is None:
            return None, "skipped"
        rc = self.sup_role
        if too_long(self.supervisor, msgs, rc.sampling.max_tokens):
            return None, "too_long"
        out = await ask_structured(
            self.supervisor, lambda note: msgs[:-1] + [{"role": "user", "content": msgs[-1]["content"] + note}],
            EvaluationAnswer, "grade-quality", lambda a: rc.sampling.params(call_seed(key, "quality", a)),
            rc.max_attempts, lambda m: [], rc.adapter)
        return (out.value.satisfaction, out.status) if out.value is not None else (None, "failed")
