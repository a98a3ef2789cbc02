"""Generation: each (item, condition) is one greedy request and, with samples, one request for k
sampled answers, through any backend (hf, openai, vllm); every answer is labelled and appended as
it arrives, so a killed run loses at most the requests in flight.

Sampling seeds are derived from the run's seed and the request's place (`call_seed`), so a rerun
of the same settings asks for the same answers. A request of which some answers are stored (a kill
between its sampled answers) is asked again whole, and only its missing answers are written. A
request whose result is an error is sent again up to `max_attempts` times, then passed on as an
`error` row, which the store does not write (its answers stay missing; a rerun asks again)."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lhd_train.bench.prompts import Prompts
from lhd_train.bench.structured_calls import call_seed
from lhd_train.bench.taskpack import TaskPack
from lhd_train.entitle.conditions import Condition, Rendered, render
from lhd_train.entitle.items import Item
from lhd_train.entitle.labels import label_answer
from lhd_train.entitle.store import ERROR, AnswerRow, answer_id
from lhd_train.io.provenance import utc_now
from rollouts.backend import Backend
from rollouts.types import Completion, GenerationRequest, GenerationResult, SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """How answers are asked for: greedy plus `samples` at `temperature`/`top_p`, `max_tokens` each."""

    seed: int
    samples: int
    temperature: float
    top_p: float
    max_tokens: int
    max_attempts: int = 3
    adapter: str | None = None

    def greedy(self, seed: int | None) -> SamplingParams:
        return SamplingParams(temperature=0.0, top_p=1.0, max_tokens=self.max_tokens, seed=seed, n=1, top_k=0,
                              repetition_penalty=1.0)

    def sampled(self, seed: int | None) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens, seed=seed,
                              n=self.samples, top_k=0, repetition_penalty=1.0)


@dataclass(frozen=True)
class Job:
    """One request: an item under a condition, greedy (sample 0) or the k samples (1..k)."""

    item: Item
    cond: Condition
    rendered: Rendered
    samples: tuple[int, ...]
    sampling: SamplingParams
    done: frozenset[int] = frozenset()  # samples already stored: asked again with the others, not written


    def ids(self) -> list[str]:
        return [answer_id(self.item.fact_id, self.cond.files, self.cond.pressure, s) for s in self.samples]


def jobs(pack: TaskPack, items: list[Item], conds: list[Condition], plan: Plan, prompts: Prompts,
         done: set[str]) -> list[Job]:
    """The requests still to make: every (item, condition) whose greedy or sampled answers are
    not all in `done` (ids of rows without an error). Items without a control fact skip it."""
    out = []
    for item in items:
        for cond in conds:
            if cond.files == "control" and item.control is None:
                continue
            rendered = render(pack, item, cond, prompts)
            place = (plan.seed, item.fact_id, cond.key)
            requests: list[tuple[tuple[int, ...], SamplingParams]] = [((0,), plan.greedy(call_seed(*place, "greedy")))]
            if plan.samples:
                requests.append((tuple(range(1, plan.samples + 1)), plan.sampled(call_seed(*place, "samples"))))
            for samples, sampling in requests:
                job = Job(item, cond, rendered, samples, sampling)
                stored = frozenset(s for s, i in zip(samples, job.ids(), strict=True) if i in done)
                if len(stored) < len(samples):
                    out.append(Job(item, cond, rendered, samples, sampling, stored))
    return out


def row_of(job: Job, sample: int, result: GenerationResult, completion: Completion | None, attempts: int,
           adapter: str | None) -> AnswerRow:
    """The labelled row of one answer (or of the request's error, when `completion` is None)."""
    item, r = job.item, job.rendered
    control = item.control if job.cond.files == "control" else None
    entity, attribute = (control.entity, control.attribute) if control else (item.entity, item.attribute)
    base: dict[str, Any] = dict(
        id=answer_id(item.fact_id, job.cond.files, job.cond.pressure, sample), fact=item.fact_id, pack=item.pack,
        task=item.task, file=control.file if control else item.file, entity=entity, attribute=attribute,
        files=job.cond.files, pressure=job.cond.pressure, sample=sample, seed=job.sampling.seed,
        temperature=float(job.sampling.temperature or 0.0), max_tokens=job.sampling.max_tokens,
        question=r.question, value=item.value, shown=r.shown, demanded=r.demanded, messages=r.messages,
        prompt_token_ids=result.prompt_token_ids, model=result.model_id, adapter=adapter, attempts=attempts,
        created_at=utc_now())
    if completion is None:
        return AnswerRow(**base, label=ERROR, error=result.error or "no completion")
    truth = item.as_label_value(item.value) if control is None else None  # `equals_truth`: the deleted X stated
    lab = label_answer(completion.text, r.shown, r.demanded, r.not_claims, r.context, value=truth)
    j = lab.to_json()
    return AnswerRow(**base, label=lab.label, subtype=subtype_of(j), label_reason=lab.reason,
                     asserted=lab.asserted.text if lab.asserted else None, asserted_span=j["asserted_span"],
                     figures=j["figures"], abstains=lab.abstains,
                     answer=completion.text, finish_reason=completion.finish_reason,
                     answer_token_ids=completion.token_ids)


def subtype_of(label: dict[str, object]) -> str | None:
    """The labeller's subtype (`fabricated_copied`, `fabricated_novel`, `equals_truth`, ...) when it
    gives one."""
    sub = label.get("subtype")
    return sub if isinstance(sub, str) else None


def relabel(row: AnswerRow) -> AnswerRow:
    """`row` labelled again by today's rules, from what it stored (answer, values, messages)."""
    if row.label == ERROR:
        return row
    context = "\n".join(m["content"] for m in row.messages)
    truth = row.value if row.files != "control" else None
    lab = label_answer(row.answer, row.shown, row.demanded, [p for p in (row.entity, row.attribute) if p], context,
                       value=truth)
    j = lab.to_json()
    return row.model_copy(update={"label": lab.label, "subtype": subtype_of(j), "label_reason": lab.reason,
                                  "asserted": lab.asserted.text if lab.asserted else None,
                                  "asserted_span": j["asserted_span"], "figures": j["figures"],
                                  "abstains": lab.abstains})


async def ask(backend: Backend, job: Job, plan: Plan) -> tuple[GenerationResult, int]:
    """The job's result after up to `plan.max_attempts` tries, and the number of tries."""
    req = GenerationRequest(job.rendered.messages, job.sampling, None, plan.adapter)
    result = GenerationResult([], error="not sent")
    for attempt in range(1, plan.max_attempts + 1):
        [result] = await backend.generate([req])
        if result.ok and len(result.completions) == len(job.samples):
            return result, attempt
        if result.ok:
            result = GenerationResult([], error=f"{len(result.completions)} completions for {len(job.samples)} "
                                                "answers", model_id=result.model_id)
        log.warning("%s: attempt %d failed: %s", job.ids()[0], attempt, result.error)
        if not result.resubmit:
            return result, attempt
    return result, plan.max_attempts


async def generate_all(backend: Backend, todo: list[Job], plan: Plan, write: Callable[[AnswerRow], object],
                       concurrency: int = 32, tick: Callable[[int], None] | None = None) -> int:
    """Run every job, at most `concurrency` at once; each answer's row not stored yet goes to
    `write` as soon as its request is done (an error row for each answer of a failed request).
    Returns the number of answers whose request failed."""
    gate = asyncio.Semaphore(concurrency)
    errors = 0

    async def one(job: Job) -> None:
        nonlocal errors
        async with gate:
            result, attempts = await ask(backend, job, plan)
        for k, sample in enumerate(job.samples):
            if sample in job.done:
                continue
            completion = result.completions[k] if result.ok else None
            row = row_of(job, sample, result, completion, attempts, plan.adapter)
            errors += row.label == ERROR
            write(row)
        if tick is not None:
            tick(len(job.samples) - len(job.done))

    await asyncio.gather(*(one(j) for j in todo))
    return errors
