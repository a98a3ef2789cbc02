"""Which GRPO prompts the honesty judge can grade, decided when the data is built (issue 38).

The judge sees the trajectory up to a round with the candidate answer in it (`grading.candidate_view`);
late rounds carry 45k-157k tokens, so some are longer than the judge's window. At training time such
a completion could only go ungraded, and TRL sees a missing reward; counted as failures, a data set
with more than `grpo.max_failed_grade_share` of them stopped every run in its first steps. So
`lhd data grpo` measures each row's audit prompt, with the round's original answer standing in
for the completion and room kept for `completion_tokens` more and the auditor's reply
(`sampling.max_tokens`), drops the rows over the window and counts them in the dataset's stats.

The window is `--judge-window`, else the run auditor's `max_model_len`; without either nothing is
measured (said in the stats). Tokens are counted with the judge's tokenizer (`--judge-tokenizer`,
else the run auditor's model) when it loads here, else with lhd's conservative estimate (3
characters per token, which over-counts: rows near the window may be dropped that would fit)."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lhd_train.audit.trajectory import AuditorPrompts, Trial, load_trial, run_task_texts
from lhd_train.config.auditor import load_auditor_config
from lhd_train.errors import InputError
from lhd_train.finetune.contexts import Context
from lhd_train.finetune.grading import candidate_view
from lhd_train.rundir.run import Run
from rollouts.model_files import estimate_tokens

log = logging.getLogger(__name__)


@dataclass
class JudgeWindow:
    """The window rows are measured against, and how tokens are counted."""

    window: int
    reserve: int  # completion_tokens + the auditor's max_tokens
    counted_with: str  # the tokenizer, or "estimate (3 characters per token)"
    count: Callable[[list[dict[str, str]]], int] = field(repr=False)
    run: Run = field(repr=False)
    prompts: AuditorPrompts = field(repr=False)
    trials: dict[str, Trial] = field(default_factory=dict, repr=False)
    tasks: Any = field(default=None, repr=False)

    def tokens(self, ctx: Context) -> int:
        """The audit prompt's tokens with the original answer, plus the reserve."""
        if ctx.trial_id not in self.trials:
            if self.tasks is None:
                self.tasks, _ = run_task_texts(self.run)
            self.trials[ctx.trial_id] = load_trial(self.run, ctx.trial_id, self.tasks)
        trial = self.trials[ctx.trial_id]
        i = next(j for j, r in enumerate(trial.rows) if r.global_round == ctx.global_round)
        return self.count(candidate_view(trial, i, ctx.answer, self.prompts)) + self.reserve

    def fits(self, ctx: Context) -> bool:
        return self.tokens(ctx) <= self.window

    def stats(self, dropped: int) -> dict[str, Any]:
        return {"window": self.window, "reserve": self.reserve, "counted_with": self.counted_with,
                "over_window": dropped}


def _counter(name: str) -> tuple[Callable[[list[dict[str, str]]], int], str]:
    from rollouts.tokenizer import load_tokenizer

    try:
        tok = load_tokenizer(name)
    except Exception as e:  # noqa: BLE001  (any failure to load means: estimate, and say so)
        log.warning("judge tokenizer %s does not load here (%s): counting with the estimate", name,
                    str(e).splitlines()[0][:200])
        return estimate_tokens, "estimate (3 characters per token)"

    def count(messages: list[dict[str, str]]) -> int:
        encoded: Any = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
        return len(encoded["input_ids"])

    return count, name


def judge_window(run_dir: Path, window: int | None, tokenizer: str | None,
                 completion_tokens: int) -> JudgeWindow | None:
    """The check for `run_dir`'s rows, or None when no window is known (none given, and the run configures no
    auditor whose window it could take: its GRPO rows are then not checked, as before the check existed)."""
    try:
        acfg, _ = load_auditor_config(Path(run_dir), None, [])
    except InputError as e:
        if window is None and e.field == "auditor":
            log.info("%s: no auditor role, so no judge window: over-window rows are not counted", run_dir)
            return None
        raise
    window = window or acfg.spec.max_model_len
    if not window:
        return None
    count, counted_with = _counter(tokenizer or getattr(acfg.spec, "tokenizer", None) or acfg.spec.model)
    return JudgeWindow(int(window), int(completion_tokens) + int(acfg.auditor.sampling.max_tokens), counted_with,
                       count, Run.open(run_dir), AuditorPrompts.load(acfg.prompts_dir))
