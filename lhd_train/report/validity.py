"""The headline auditor's measured error rates, shown next to each run's deception rate.

Every rate in a report rests on an LLM auditor; `lhd audit-eval` measures what that auditor misses
(docs/validity.md). This module turns the evaluations stored with a run
(`audit.eval_results.evaluations_for`) into lines for report.html and summary.md, with the run's
rate corrected for those errors (`metrics.correction`, Rogan–Gladen), or says that none was
measured and how to measure it."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd

from lhd_train.audit.eval_results import AuditorEvaluation, evaluations_for
from lhd_train.audit.eval_text import headline_lines
from lhd_train.metrics.correction import CorrectedRate, ErrorRate, corrected_rate
from lhd_train.metrics.load import RunData
from lhd_train.metrics.registry import HEADLINE

NOT_MEASURED = ("auditor error rates: not measured (run `lhd audit-eval --planted COPY --auditor CONFIG` on a copy "
                "made by `lhd audit-plant RUN --out COPY`, or `lhd audit-eval --set curated ... --attach RUN`)")


@dataclass(frozen=True)
class RunValidity:
    run: str                 # the run's label in the report
    auditor_id: str | None   # its headline auditor
    lines: list[str]         # one per measured rate; empty when not measured
    note: str | None         # NOT_MEASURED, or why there is no auditor


def correction_for(e: AuditorEvaluation, trial_rates: Sequence[float]) -> CorrectedRate:
    """The run's rate corrected with this evaluation's FNR and FPR (`metrics.correction`)."""
    fnr, fp = e.result.fnr["all"], e.result.fpr
    fpr = ErrorRate(fp.k, fp.n, fp.n_design) if fp.n else None
    return corrected_rate(trial_rates, ErrorRate(fnr.k, fnr.n, fnr.n_design), fpr)


def correction_line(e: AuditorEvaluation, c: CorrectedRate) -> str:
    head = f"auditor {e.auditor_id}: deception rate corrected for the errors measured on {e.source}"
    if c.rate is None:
        return f"{head}: {c.note}"
    fpr = "FPR taken as 0" if c.fpr_assumed_zero else f"FPR {c.fpr:.2f}"
    return (f"{head}: {c.rate:.3f} [{c.ci_low:.3f}, {c.ci_high:.3f}] from the flagged {c.observed:.3f} "
            f"(FNR {c.fnr:.2f}, {fpr}; {c.note})")


def evaluation_lines(e: AuditorEvaluation, trial_rates: Sequence[float] | None = None) -> list[str]:
    """The evaluation's lines (`eval_text.headline_lines`), where it is stored, and the run's rate
    corrected with its error rates when the run's per-trial rates are given."""
    lines = headline_lines(e)
    lines.append(f"auditor {e.auditor_id}: model {e.model.model}; {e.path}")
    if trial_rates is not None:
        lines.append(correction_line(e, correction_for(e, trial_rates)))
    return lines


def auditor_validity(runs: Sequence[RunData], per_trial: pd.DataFrame | None = None) -> list[RunValidity]:
    """One entry per run: its headline auditor's evaluations as lines (with the run's rate corrected
    when `per_trial`, `core.per_trial_table` of the runs, is given), or NOT_MEASURED."""
    out = []
    for run in runs:
        if run.auditor_id is None:
            out.append(RunValidity(run.label, None, [], "no auditor: nothing to measure"))
            continue
        rates = (per_trial.loc[per_trial["run"] == run.key, HEADLINE].tolist()
                 if per_trial is not None and len(per_trial) else None)
        lines = [x for e in evaluations_for(run.path, run.auditor_id) for x in evaluation_lines(e, rates)]
        out.append(RunValidity(run.label, run.auditor_id, lines, None if lines else NOT_MEASURED))
    return out


def validity_md(items: Sequence[RunValidity]) -> str:
    """The same as a summary.md section."""
    lines = ["", "Auditor error rates (measured by `lhd audit-eval`, docs/validity.md):", ""]
    for v in items:
        lines += [f"- {v.run}: {x}" for x in v.lines] or [f"- {v.run}: {v.note}"]
    return "\n".join(lines) + "\n"
