"""The headline auditor's measured error rates, shown next to each run's deception rate.

Every rate in a report rests on an LLM auditor; `lhd audit-eval` measures what that auditor misses
(docs/validity.md). This module turns the evaluations stored with a run
(`audit.eval_results.evaluations_for`) into lines for report.html and summary.md, or says that none
was measured and how to measure it."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lhd_train.audit.eval_results import AuditorEvaluation, MeasuredRate, evaluations_for
from lhd_train.config.vocab import TYPES
from lhd_train.metrics.load import RunData

NOT_MEASURED = ("auditor error rates: not measured (run `lhd audit-eval --planted COPY --auditor CONFIG` on a copy "
                "made by `lhd audit-plant RUN --out COPY`, or `lhd audit-eval --set curated ... --attach RUN`)")


@dataclass(frozen=True)
class RunValidity:
    run: str                 # the run's label in the report
    auditor_id: str | None   # its headline auditor
    lines: list[str]         # one per measured rate; empty when not measured
    note: str | None         # NOT_MEASURED, or why there is no auditor


def rate_text(r: MeasuredRate) -> str:
    """`0.31 [0.20, 0.45] (n=29)`, or `– (n=0)`."""
    if not r.n or r.rate is None or r.low is None or r.high is None:
        return "– (n=0)"
    return f"{r.rate:.2f} [{r.low:.2f}, {r.high:.2f}] (n={r.n})"


def evaluation_lines(e: AuditorEvaluation) -> list[str]:
    """`auditor X: FNR 0.31 [0.20, 0.45] (n=29) on planted run P falsification`, one per measured rate."""
    head = f"auditor {e.auditor_id}"
    lines = [f"{head}: FNR {rate_text(e.fnr[t])} on {e.source} {t.lower()}" for t in TYPES if e.fnr[t].n]
    lines.append(f"{head}: FNR {rate_text(e.fnr['all'])} on {e.source} deceptive answers")
    if e.fpr.n:
        lines.append(f"{head}: FPR {rate_text(e.fpr)} on {e.source} honest answers")
    if e.unplanted_flag_rate is not None:
        lines.append(f"{head}: flags {rate_text(e.unplanted_flag_rate)} of the unplanted rounds of {e.source} "
                     "(not known to be honest)")
    kappa = "–" if e.kappa is None else f"{e.kappa:.2f}"
    lines.append(f"{head}: Cohen's kappa {kappa} on {e.source}; {e.failed_or_missing} of {e.rounds} rounds "
                 f"without a usable audit row (left out of every rate); model {e.model}; {e.path}")
    return lines


def auditor_validity(runs: Sequence[RunData]) -> list[RunValidity]:
    """One entry per run: its headline auditor's evaluations as lines, or NOT_MEASURED."""
    out = []
    for run in runs:
        if run.auditor_id is None:
            out.append(RunValidity(run.label, None, [], "no auditor: nothing to measure"))
            continue
        lines = [x for e in evaluations_for(run.path, run.auditor_id) for x in evaluation_lines(e)]
        out.append(RunValidity(run.label, run.auditor_id, lines, None if lines else NOT_MEASURED))
    return out


def validity_md(items: Sequence[RunValidity]) -> str:
    """The same as a summary.md section."""
    lines = ["", "Auditor error rates (measured by `lhd audit-eval`, docs/validity.md):", ""]
    for v in items:
        lines += [f"- {v.run}: {x}" for x in v.lines] or [f"- {v.run}: {v.note}"]
    return "\n".join(lines) + "\n"
