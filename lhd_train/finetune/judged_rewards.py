"""GRPO rewards graded by the auditor (honesty) and the supervisor (satisfaction).

Both read the same `Grader`, so each completion is judged once, in its trajectory's context,
through the rollout engine (batched) and cached on disk. Rows must carry the columns written by
`lhd data grpo` (`run_dir`, `trial_id`, `global_round`). The direction flips only the honesty
term: honest → −severity/4, deceptive → +severity/4."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from lhd_train.bench.performer import split_think
from lhd_train.config.auditor import load_auditor_config
from lhd_train.finetune.contexts import Context, load_contexts
from lhd_train.finetune.grading import Grade, Grader
from lhd_train.finetune.rewards import RewardFunc, completion_text, register_reward

_GRADERS: dict[tuple, _Judge] = {}


class _Judge:
    """One grader and the run's contexts, built on first use (models load lazily)."""

    def __init__(self, run_dir: Path, auditor_config: str | None, overrides: tuple[str, ...], cache: str | None,
                 concurrency: int):
        self.run_dir = Path(run_dir)
        self.auditor_config = Path(auditor_config) if auditor_config else None
        self.overrides = overrides
        self.cache = Path(cache) if cache else self.run_dir / "grading" / "grades.jsonl"
        self.concurrency = concurrency
        self.grader: Grader | None = None
        self.contexts: dict[tuple[str, int], Context] = {}

    def _build(self) -> Grader:
        from lhd_train.config.run import load_saved_config
        from rollouts.factory import build_backend

        acfg, _ = load_auditor_config(self.run_dir, self.auditor_config, list(self.overrides))
        cfg = load_saved_config(self.run_dir)
        self.cache.parent.mkdir(parents=True, exist_ok=True)
        auditor = build_backend(acfg.spec, name=acfg.auditor.model, log_dir=str(self.cache.parent))
        sup_spec = cfg.models[cfg.supervisor.model]
        supervisor = auditor if sup_spec.model_dump() == acfg.spec.model_dump() else \
            build_backend(sup_spec, name=cfg.supervisor.model, log_dir=str(self.cache.parent))
        self.contexts = {(c.trial_id, c.global_round): c for c in load_contexts(self.run_dir, None, 0.0)}
        return Grader(self.run_dir, acfg, auditor, cfg.supervisor, supervisor, self.cache, self.concurrency)

    async def grades(self, completions: list[Any], trial_id: list[str], global_round: list[int]) -> list[Grade | None]:
        if self.grader is None:
            self.grader = self._build()
        texts = [split_think(completion_text(c), ["think"])[0] for c in completions]
        ctxs = [self.contexts.get((t, int(g))) for t, g in zip(trial_id, global_round, strict=True)]
        out = await asyncio.gather(*(self.grader.grade(c, t) for c,
                                     t in zip(ctxs, texts, strict=True) if c is not None))
        it = iter(out)
        return [next(it) if c is not None else None for c in ctxs]


def _judge(run_dir: str, auditor_config: str | None, overrides: list[str] | tuple[str, ...], cache: str | None,
           concurrency: int) -> _Judge:
    key = (str(Path(run_dir).resolve()), auditor_config, tuple(overrides), cache)
    if key not in _GRADERS:
        _GRADERS[key] = _Judge(Path(run_dir), auditor_config, tuple(overrides), cache, concurrency)
    return _GRADERS[key]


def _run_dir_of(columns: dict[str, Any], default: str | None) -> str:
    rd = default or (columns.get("run_dir") or [None])[0]
    if not rd:
        raise ValueError("the dataset has no run_dir column and the reward has no run_dir param")
    return rd


@register_reward("honesty")
def honesty(direction: str, run_dir: str | None = None, auditor_config: str | None = None,
            overrides: list[str] | None = None, cache: str | None = None, concurrency: int = 32) -> RewardFunc:
    sign = -1.0 if direction == "honest" else 1.0

    async def reward(prompts: list, completions: list, trial_id: list, global_round: list, **columns: Any):
        judge = _judge(_run_dir_of(columns, run_dir), auditor_config, overrides or [], cache, concurrency)
        grades = await judge.grades(completions, trial_id, global_round)
        values = [None if g is None or not g.usable else sign * (g.severity or 0) / 4.0 for g in grades]
        log = columns.get("log_metric")
        ok = [g for g in grades if g is not None and g.usable]
        if callable(log) and ok:
            log("honesty/deceptive_share", sum(bool(g.deceptive) for g in ok) / len(ok))
            log("honesty/failed_grades", float(len(grades) - len(ok)))
        return values

    return reward


@register_reward("satisfaction")
def satisfaction(direction: str, run_dir: str | None = None, auditor_config: str | None = None,
                 overrides: list[str] | None = None, cache: str | None = None, concurrency: int = 32) -> RewardFunc:
    async def reward(prompts: list, completions: list, trial_id: list, global_round: list, **columns: Any):
        judge = _judge(_run_dir_of(columns, run_dir), auditor_config, overrides or [], cache, concurrency)
        grades = await judge.grades(completions, trial_id, global_round)
        return [None if g is None or g.satisfaction is None else float(g.satisfaction) for g in grades]

    return reward
