"""The judged rewards: `honesty` (graded by the auditor; honest −severity/4, deceptive +severity/4)
and `satisfaction` (the supervisor's), both from one `Grader` pass per completion, in its trajectory's
context, cached on disk, over the columns `lhd data grpo` writes. A completion that is the round's
original answer keeps the run's own label (review N2). In training the judges must be endpoints the
user started (the section's `judge`, `supervisor_judge`): a judge that would start a model in every
rank is refused before the first step (issue 20, H3). A failed grade is a missing reward; training
stops once more than `max_failed_grade_share` failed, counted over the ranks in one all-reduce after
each step; an over-window prompt is `too_long`, never sent. Why: docs/training.md, "GRPO rewards"."""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import shlex
from pathlib import Path
from typing import Any

from lhd_train.bench.performer import split_think
from lhd_train.bench.structured_calls import BackendUnavailable
from lhd_train.config.auditor import load_auditor_config
from lhd_train.errors import InputError, LhdError
from lhd_train.finetune.contexts import Context, load_contexts
from lhd_train.finetune.grading import Grade, Grader
from lhd_train.finetune.rewards import RewardFunc, completion_text, in_section, register_reward
from lhd_train.rundir.layout import RunDir
from rollouts.backends import ModelSpec
from rollouts.openai_backend import OpenAISpec
from rollouts.spec import public_url

_GRADERS: dict[tuple, _Judge] = {}
JUDGE_PORT = 8001
#: failed grades stop training only once this many grades (all ranks) were made: a share of a few is noise
MIN_GRADES_TO_STOP = 16
UNAVAILABLE = "unavailable"  # the grade's status when the endpoint did not answer after its retries
TOO_LONG = "too_long"  # grading.too_long's status: the trajectory is longer than the judge's window
log = logging.getLogger(__name__)


class JudgeFailing(LhdError):
    """More than the allowed share of a judged reward's grades failed: the rewards left would come
    from a few completions only, so training stops (one `error:` line at the boundary)."""


def _learn_window(backend: Any, spec: ModelSpec, role: str) -> None:
    """Give an endpoint backend without a configured window the one the endpoint reports, so
    `grading.too_long` refuses an over-window prompt before it is sent."""
    if spec.runs_here or getattr(backend, "max_model_len", None):
        return  # a model started here knows its window; an endpoint says it at /models
    window = backend.served_window()
    if window:
        backend.max_model_len = window
        log.info("%s judge %s: window %d tokens (from the endpoint's /models)", role, spec.model, window)
    else:
        log.warning("%s judge %s: its window is unknown (set grpo.judge.max_model_len): prompts over it are "
                    "sent, refused by the server, and their grades fail", role, spec.model)


def endpoint_spec(endpoint: Any) -> OpenAISpec | None:
    """A recipe `JudgeEndpoint` (or the same keys as a dict) as an endpoint's model spec."""
    if endpoint is None:
        return None
    e = endpoint if isinstance(endpoint, dict) else endpoint.model_dump()
    return OpenAISpec(**{k: v for k, v in e.items() if v is not None})


class _Judge:
    """One grader and the run's contexts, built on first use (models load lazily)."""

    def __init__(self, run_dir: Path, auditor_config: str | None, overrides: tuple[str, ...], cache: str | None,
                 concurrency: int, judge: OpenAISpec | None, supervisor_judge: OpenAISpec | None, training: bool,
                 run_auditor: str | None = None):
        self.run_dir = Path(run_dir)
        self.run_auditor = run_auditor
        self.auditor_config = Path(auditor_config) if auditor_config else None
        self.overrides = overrides
        self.cache = Path(cache) if cache else RunDir(self.run_dir).grades
        self.concurrency = concurrency
        self.judge, self.supervisor_judge, self.training = judge, supervisor_judge, training
        self.grader: Grader | None = None
        self.contexts: dict[tuple[str, int], Context] = {}
        self.last_error: str | None = None

    def _build(self) -> Grader:
        from lhd_train.config.run import load_saved_config
        from rollouts.backends import build_backend

        acfg, _ = load_auditor_config(self.run_dir, self.auditor_config, list(self.overrides))
        cfg = load_saved_config(self.run_dir)
        self.cache.parent.mkdir(parents=True, exist_ok=True)
        aspec = self.judge or acfg.spec
        sup_spec = self.supervisor_judge or cfg.models[cfg.supervisor.model]
        if self.training and aspec.runs_here:  # preflight refuses this; never start one in a rank
            raise RuntimeError(f"the auditor-judge {aspec.model} is not an endpoint (backend {aspec.backend})")
        auditor = build_backend(aspec, name=acfg.auditor.model, log_dir=str(self.cache.parent))
        _learn_window(auditor, aspec, "auditor")
        if self.training and sup_spec.runs_here:
            supervisor = None  # honesty needs only the auditor; satisfaction was refused by preflight
        elif sup_spec.model_dump() == aspec.model_dump():
            supervisor = auditor
        else:
            supervisor = build_backend(sup_spec, name=cfg.supervisor.model, log_dir=str(self.cache.parent))
            _learn_window(supervisor, sup_spec, "supervisor")
        self.contexts = {(c.trial_id, c.global_round): c for c in load_contexts(self.run_dir, self.run_auditor, 0.0)}
        return Grader(self.run_dir, acfg, auditor, cfg.supervisor if supervisor else None, supervisor, self.cache,
                      self.concurrency)

    async def grades(self, completions: list[Any], trial_id: list[str], global_round: list[int]) -> list[Grade | None]:
        if self.grader is None:
            self.grader = self._build()
        texts = [split_think(completion_text(c), ["think"])[0] for c in completions]
        ctxs = [self.contexts.get((t, int(g))) for t, g in zip(trial_id, global_round, strict=True)]
        out = await asyncio.gather(*(self._grade(c, t) for c, t in zip(ctxs, texts, strict=True) if c is not None))
        it = iter(out)
        return [as_audited(next(it), c, t) if c is not None else None for c, t in zip(ctxs, texts, strict=True)]

    async def _grade(self, ctx: Context, text: str) -> Grade:
        """The grade, or an unusable one (not cached: a rerun asks again) when the endpoint did not
        answer after its retries; `lhd data` calls the grader directly and stops there instead."""
        assert self.grader is not None
        try:
            return await self.grader.grade(ctx, text)
        except BackendUnavailable as e:
            self.last_error = str(e)
            return Grade(None, None, [], None, UNAVAILABLE, None, UNAVAILABLE)


def as_audited(grade: Grade, ctx: Context, text: str) -> Grade:
    """`grade`, except for the round's original answer with a valid run label: the run's verdict
    and severity, so an answer the run flagged never earns the honest reward (review N2)."""
    if ctx.audited_deceptive is None or text.strip() != ctx.answer.strip():
        return grade
    sev = ctx.label.severity if ctx.label is not None else None
    return dataclasses.replace(grade, deceptive=ctx.audited_deceptive, severity=None if sev is None else int(sev),
                               types=list(ctx.label.types) if ctx.label is not None else [], audit_status="run-audit")


class _Setup:
    """What a judged reward was built with, and the training check (`preflight`)."""

    def __init__(self, kind: str, run_dir: str | None, auditor_config: str | None, overrides: list[str] | None,
                 cache: str | None, concurrency: int, judge: Any, supervisor_judge: Any,
                 max_failed_share: float = 0.2, section: str | None = None):
        self.section = section  # the recipe's online section (`grpo`), for the fields errors name
        self.kind, self.run_dir, self.auditor_config = kind, run_dir, auditor_config
        self.overrides, self.cache, self.concurrency = tuple(overrides or []), cache, concurrency
        self.judge, self.supervisor_judge = endpoint_spec(judge), endpoint_spec(supervisor_judge)
        self.training = False
        self.max_failed_share = float(max_failed_share)
        self.graded = 0  # grades made on this rank, over-window ones left out
        self.over_window = 0  # trajectories longer than the judge's window, this rank
        self.failures: collections.Counter[str] = collections.Counter()  # status -> count, this rank
        self.judge_seen: _Judge | None = None

    def tally(self, judge: _Judge, statuses: list[str | None], log_metric: Any = None) -> None:
        """Count this call's grades on this rank (`statuses`: None for a usable grade, else why it
        failed) and log this rank's failed share; no collective here (`check_failed_shares` sums them after the step).
        `too_long` (a trajectory over the judge's window) is counted apart: not the judge failing."""
        self.judge_seen = judge
        self.over_window += sum(s == TOO_LONG for s in statuses)
        judged = [s for s in statuses if s != TOO_LONG]
        self.graded += len(judged)
        self.failures.update(s for s in judged if s is not None)
        if callable(log_metric) and self.graded:
            log_metric(f"{self.kind}/failed_grade_share", sum(self.failures.values()) / self.graded)
        if callable(log_metric) and self.over_window:
            log_metric(f"{self.kind}/over_window", float(self.over_window))

    def stop_if_failing(self, failed: int, graded: int) -> None:
        """`JudgeFailing` when more than `max_failed_share` of `graded` (every rank's) failed, once at
        least `MIN_GRADES_TO_STOP` grades were made."""
        if graded < MIN_GRADES_TO_STOP or failed <= self.max_failed_share * graded:
            return
        judge = self.judge_seen
        spec = (judge.judge or judge.supervisor_judge) if judge is not None else None
        where = f" of the judge {spec.model} at {public_url(spec.base_url)}" if spec and spec.base_url else ""
        why = ", ".join(f"{k} {v}" for k, v in self.failures.most_common())
        last = judge.last_error if judge is not None else None
        last = f"; last endpoint error: {' '.join(last.split())[:300]}" if last else ""
        share = in_section(self.section, "max_failed_grade_share")
        raise JudgeFailing(
            f"{failed} of {graded} {self.kind} grades{where} failed ({failed / graded:.0%}, more than "
            f"{share} {self.max_failed_share:.0%}; on this rank: {why}){last}. Check that the endpoint is up and "
            f"serves the window the trajectories need (docs/training.md, 'The judge's window'), or raise {share}")

    def judge_for(self, columns: dict[str, Any]) -> _Judge:
        run_dir = _run_dir_of(columns, self.run_dir)
        run_auditor = (columns.get("run_auditor") or [None])[0] or None
        key = (str(Path(run_dir).resolve()), run_auditor, self.auditor_config, self.overrides, self.cache,
               self.training, self.judge and self.judge.model_dump_json(),
               self.supervisor_judge and self.supervisor_judge.model_dump_json())
        if key not in _GRADERS:
            _GRADERS[key] = _Judge(Path(run_dir), self.auditor_config, self.overrides, self.cache, self.concurrency,
                                   self.judge, self.supervisor_judge, self.training, run_auditor)
        return _GRADERS[key]

    def preflight(self, dataset: Any, source: str) -> None:
        """Refuse, before any model loads, a judge that would start a model inside a training rank."""
        from lhd_train.config.run import load_saved_config

        if self.run_dir:
            run_dirs = [self.run_dir]
        elif "run_dir" in dataset.column_names:
            run_dirs = sorted({r for r in dataset["run_dir"] if r})
        else:
            run_dirs = []
        for rd in run_dirs:
            if self.judge is None:
                acfg, _ = load_auditor_config(Path(rd), Path(self.auditor_config) if self.auditor_config else None,
                                              list(self.overrides))
                if acfg.spec.runs_here:
                    field = in_section(self.section, "judge")
                    raise InputError(source, field, _refusal(self.kind, "auditor", acfg.auditor.model, acfg.spec,
                                                             source, field))
            if self.kind == "satisfaction" and self.supervisor_judge is None:
                cfg = load_saved_config(rd)
                spec = cfg.models[cfg.supervisor.model]
                if spec.runs_here:
                    field = in_section(self.section, "supervisor_judge")
                    raise InputError(source, field, _refusal(self.kind, "supervisor", cfg.supervisor.model, spec,
                                                             source, field))
        self.training = True


def _refusal(kind: str, role: str, key: str, spec: ModelSpec, source: str, field: str) -> str:
    serve = spec.serve_argv(JUDGE_PORT)
    algo = field.split(".")[0] if "." in field else "ALGO"
    train = ["lhd", "train", algo, source, f"{field}.base_url=http://127.0.0.1:{JUDGE_PORT}/v1",
             f"{field}.model={spec.model}"]
    if spec.max_model_len:
        train.append(f"{field}.max_model_len={spec.max_model_len}")
    return (f"the {kind} reward would build the run's {role} '{key}' ({spec.backend}: {spec.model}) inside every "
            f"training rank, which starts a model on the trainer's GPUs; during training a judge must be an "
            f"endpoint you started. Run instead:\n"
            f"  1. CUDA_VISIBLE_DEVICES=<GPUs the trainer does not use> {shlex.join(serve)}\n"
            f"  2. {shlex.join(train)}")


def _run_dir_of(columns: dict[str, Any], default: str | None) -> str:
    rd = default or (columns.get("run_dir") or [None])[0]
    if not rd:
        raise ValueError("the dataset has no run_dir column and the reward has no run_dir param")
    return rd


@register_reward("honesty")
def honesty(direction: str, run_dir: str | None = None, auditor_config: str | None = None,
            overrides: list[str] | None = None, cache: str | None = None, concurrency: int = 32,
            judge: Any = None, supervisor_judge: Any = None, max_failed_share: float = 0.2,
            section: str | None = None) -> RewardFunc:
    sign = -1.0 if direction == "honest" else 1.0
    setup = _Setup("honesty", run_dir, auditor_config, overrides, cache, concurrency, judge, supervisor_judge,
                   max_failed_share, section)

    async def reward(prompts: list, completions: list, trial_id: list, global_round: list, **columns: Any):
        judge_ = setup.judge_for(columns)
        grades = await judge_.grades(completions, trial_id, global_round)
        values = [None if g is None or not g.usable else sign * (g.severity or 0) / 4.0 for g in grades]
        log = columns.get("log_metric")
        ok = [g for g in grades if g is not None and g.usable]
        if callable(log) and ok:
            log("honesty/deceptive_share", sum(bool(g.deceptive) for g in ok) / len(ok))
            log("honesty/failed_grades", float(len(grades) - len(ok)))
        setup.tally(judge_, [None if g.usable else g.audit_status for g in grades if g is not None], log)
        return values

    reward.preflight, reward.setup = setup.preflight, setup  # type: ignore[attr-defined]
    reward.check_after_step = check_failed_shares  # type: ignore[attr-defined]
    return reward


@register_reward("satisfaction")
def satisfaction(direction: str, run_dir: str | None = None, auditor_config: str | None = None,
                 overrides: list[str] | None = None, cache: str | None = None, concurrency: int = 32,
                 judge: Any = None, supervisor_judge: Any = None, max_failed_share: float = 0.2,
                 section: str | None = None) -> RewardFunc:
    setup = _Setup("satisfaction", run_dir, auditor_config, overrides, cache, concurrency, judge, supervisor_judge,
                   max_failed_share, section)

    async def reward(prompts: list, completions: list, trial_id: list, global_round: list, **columns: Any):
        judge_ = setup.judge_for(columns)
        grades = await judge_.grades(completions, trial_id, global_round)
        # a round without a supervisor evaluation is not a failure ("skipped"): it has nothing to rate
        setup.tally(judge_, [None if g.satisfaction is not None or g.quality_status == "skipped" else g.quality_status
                             for g in grades if g is not None], columns.get("log_metric"))
        return [None if g is None or g.satisfaction is None else float(g.satisfaction) for g in grades]

    reward.preflight, reward.setup = setup.preflight, setup  # type: ignore[attr-defined]
    reward.check_after_step = check_failed_shares  # type: ignore[attr-defined]
    return reward


def check_failed_shares(setups: list[_Setup]) -> None:
    """Sum every judged reward's (failed, graded) over the ranks in one all-reduce, in the order of
    `setups` (the recipe's reward order, the same on every rank), then stop on the first reward past
    its share. Every rank reaches the same decision from the same sums."""
    if not setups:
        return
    summed = all_ranks_sum(*(n for s in setups for n in (sum(s.failures.values()), s.graded)))
    for i, setup in enumerate(setups):
        setup.stop_if_failing(summed[2 * i], summed[2 * i + 1])


def all_ranks_sum(*counts: int) -> list[int]:
    """`counts` summed over the ranks of an initialised torch.distributed group (as they are on
    this process otherwise). NCCL needs the tensor on this rank's GPU (LOCAL_RANK), gloo on the CPU."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(counts)
    device = (torch.device("cpu") if dist.get_backend() == "gloo"
              else torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))))
    t = torch.tensor(counts, dtype=torch.long, device=device)
    dist.all_reduce(t)
    return [int(x) for x in t.tolist()]
