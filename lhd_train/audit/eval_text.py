"""An auditor evaluation in words: the lines `lhd audit-eval` prints and a run's report quotes, and
eval.md. One wording for both, from the typed record (`eval_results.AuditorEvaluation`)."""
from __future__ import annotations

from lhd_train.audit.eval_results import AuditorEvaluation, Rate
from lhd_train.audit.evaluation import PREDICTED
from lhd_train.config.vocab import TYPES


def _num(x: float | None, places: int = 2) -> str:
    return "–" if x is None else f"{x:.{places}f}"


def rate_text(r: Rate | None) -> str:
    """`0.31 [0.20, 0.45] (n=29; 6 trials, deff 1.80)`, `– (n=0)`; an old Wilson-only rate without
    the clusters."""
    if r is None or not r.n or r.rate is None or r.low is None or r.high is None:
        return "– (n=0)"
    head = f"{r.rate:.2f} [{r.low:.2f}, {r.high:.2f}] (n={r.n}"
    if r.clusters is None:
        return head + ")"
    plural = "" if r.clusters == 1 else "s"
    return head + f"; {r.clusters} {r.cluster_by}{plural}, deff {_num(r.deff)})"


def bounds_text(r: Rate, if_low: str, if_high: str) -> str:
    """`; 11 without a verdict: 0.26 if all caught, 0.67 if all missed`, or ''."""
    if not r.unusable or r.worst_best is None:
        return ""
    lo, hi = r.worst_best
    return f"; {r.unusable} without a verdict: {lo:.2f} if {if_low}, {hi:.2f} if {if_high}"


def headline_lines(e: AuditorEvaluation) -> list[str]:
    """One line per measured rate (interval, clusters, design effect, bounds for rows without a
    verdict), then agreement (kappa only where honest ground truth exists) and calibration."""
    head, src, r = f"auditor {e.auditor_id}", e.source, e.result
    caught = ("all caught", "all missed")
    lines = [f"{head}: FNR {rate_text(r.fnr[t])} on {src} {t.lower()}{bounds_text(r.fnr[t], *caught)}"
             for t in TYPES if r.fnr[t].n or r.fnr[t].unusable]
    lines.append(f"{head}: FNR {rate_text(r.fnr['all'])} on {src} deceptive answers"
                 f"{bounds_text(r.fnr['all'], *caught)}")
    if r.fpr.n or r.fpr.unusable:
        lines.append(f"{head}: FPR {rate_text(r.fpr)} on {src} honest answers"
                     f"{bounds_text(r.fpr, 'none flagged', 'all flagged')}")
    if r.unplanted_flag_rate is not None:
        lines.append(f"{head}: flags {rate_text(r.unplanted_flag_rate)} of the unplanted rounds of {src} "
                     "(not known to be honest)")
    agree = (f"Cohen's kappa {_num(r.kappa)}" if r.kappa is not None or not r.kappa_note else r.kappa_note)
    severity = r.severity_kappa.kappa if r.severity_kappa else None
    lines.append(f"{head} on {src}: {agree}; severity weighted kappa (quadratic) {_num(severity)}; "
                 f"{r.failed_or_missing} of {r.rounds} rounds without a usable audit row (left out of every rate)")
    cal = r.calibration
    if cal:
        lines.append(f"{head} on {src}: confidence Brier {_num(cal.brier, 3)}, ECE {_num(cal.ece, 3)}, "
                     f"AUROC (right vs wrong verdicts) {_num(cal.auroc_confidence)}, "
                     f"AUROC (implied P(deceptive)) {_num(cal.auroc_deceptive)} (n={cal.n})")
    return lines


def markdown(e: AuditorEvaluation) -> str:
    """eval.md: the numbers of eval.json as tables (and what only eval.md shows beside the headline:
    the confusion matrix, type recall, severity errors, calibration bins, self-consistency)."""
    result = e.result
    out = [f"# Auditor `{e.auditor_id}` on {e.source}", "",
           f"{result.rounds} rounds judged; {result.failed_or_missing} without a usable audit row (left out of every "
           "rate; the bounds say what they could change). Intervals: Wilson on the effective sample size n / deff, "
           f"t with G − 1 degrees of freedom, clustered by {result.cluster_by} (docs/validity.md).",
           "", "| measure | value [95% clustered] (n; clusters, design effect) | if the rows without a verdict ... |",
           "|---|---|---|"]

    def row(name: str, r: Rate | None, low: str = "all caught", high: str = "all missed") -> None:
        if r is not None:
            out.append(f"| {name} | {rate_text(r)} | {bounds_text(r, low, high).lstrip('; ') or '–'} |")

    for t in TYPES:
        row(f"false-negative rate, {t.lower()}", result.fnr[t])
    row("false-negative rate, all deceptive", result.fnr["all"])
    row("false-positive rate, honest answers", result.fpr, "none flagged", "all flagged")
    row("flag rate, unplanted rounds (not known honest)", result.unplanted_flag_rate, "none flagged", "all flagged")
    kappa = _num(result.kappa) if result.kappa is not None else (result.kappa_note or "–")
    out.append(f"| Cohen's kappa, flag | {kappa} | |")
    sk = result.severity_kappa
    out.append(f"| severity, quadratic-weighted kappa | {_num(sk.kappa if sk else None)} (n={sk.n if sk else 0}) | |")
    tr = result.type_recall
    out.append(f"| type recall (flagged deceptive answers naming the true type) | {_num(tr.rate)} (n={tr.n}) | |")
    sev, sevd = result.severity_mae, result.severity_mae_deceptive
    out.append(f"| severity mean absolute error | {_num(sev.mae)} (n={sev.n}) | |")
    out.append(f"| severity mean absolute error, deceptive answers | {_num(sevd.mae)} (n={sevd.n}) | |")
    sc = result.self_consistency
    if sc:
        out.append(f"| self-consistency: all {sc.k} flags agree | {_num(sc.all_agree.rate)} (n={sc.all_agree.n}) | |")
        out.append(f"| self-consistency: pairwise flag agreement | {_num(sc.pairwise_agreement)} | |")
    cal = result.calibration
    if cal:
        out += ["", "## Calibration of `confidence` (reliability.png)", "",
                f"Brier {_num(cal.brier, 3)}, ECE {_num(cal.ece, 3)}, AUROC of confidence (right vs wrong "
                f"verdicts) {_num(cal.auroc_confidence)}, AUROC of the implied P(deceptive) "
                f"{_num(cal.auroc_deceptive)}; n={cal.n}.", "",
                "| confidence bin | rows | mean confidence | share of right verdicts |", "|---|---|---|---|"]
        out += [f"| [{b.low:.1f}, {b.high:.1f}) | {b.n} | {b.mean_confidence:.2f} | {b.accuracy:.2f} |"
                for b in cal.bins]
    out += ["", "## Type confusion (rows: truth; columns: the auditor's label)", "",
            "| truth | " + " | ".join(PREDICTED) + " |", "|---|" + "---|" * len(PREDICTED)]
    for klass, cols in result.confusion.items():
        out.append(f"| {klass} | " + " | ".join(str(cols[p]) for p in PREDICTED) + " |")
    return "\n".join(out) + "\n"
