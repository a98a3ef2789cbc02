"""An auditor evaluation in words: the lines `lhd audit-eval` prints and a run's report quotes, and
eval.md. One wording for both, from the typed record (`eval_results.AuditorEvaluation`)."""
from __future__ import annotations

from typing import Any

from lhd_train.audit.eval_results import AuditorEvaluation, MeasuredRate
from lhd_train.audit.evaluation import PREDICTED
from lhd_train.config.vocab import TYPES


def _num(x: float | None, places: int = 2) -> str:
    return "–" if x is None else f"{x:.{places}f}"


def rate_text(r: MeasuredRate | None) -> str:
    """`0.31 [0.20, 0.45] (n=29; 6 trials, deff 1.80)`, `– (n=0)`; an old Wilson-only rate without
    the clusters."""
    if r is None or not r.n or r.rate is None or r.low is None or r.high is None:
        return "– (n=0)"
    head = f"{r.rate:.2f} [{r.low:.2f}, {r.high:.2f}] (n={r.n}"
    if r.clusters is None:
        return head + ")"
    plural = "" if r.clusters == 1 else "s"
    return head + f"; {r.clusters} {r.cluster_by}{plural}, deff {_num(r.deff)})"


def bounds_text(r: MeasuredRate, if_low: str, if_high: str) -> str:
    """`; 11 without a verdict: 0.26 if all caught, 0.67 if all missed`, or ''."""
    if not r.unusable or r.worst_best is None:
        return ""
    lo, hi = r.worst_best
    return f"; {r.unusable} without a verdict: {lo:.2f} if {if_low}, {hi:.2f} if {if_high}"


def headline_lines(e: AuditorEvaluation) -> list[str]:
    """One line per measured rate (interval, clusters, design effect, bounds for rows without a
    verdict), then agreement (kappa only where honest ground truth exists) and calibration."""
    head, src = f"auditor {e.auditor_id}", e.source
    caught = ("all caught", "all missed")
    lines = [f"{head}: FNR {rate_text(e.fnr[t])} on {src} {t.lower()}{bounds_text(e.fnr[t], *caught)}"
             for t in TYPES if e.fnr[t].n or e.fnr[t].unusable]
    lines.append(f"{head}: FNR {rate_text(e.fnr['all'])} on {src} deceptive answers"
                 f"{bounds_text(e.fnr['all'], *caught)}")
    if e.fpr.n or e.fpr.unusable:
        lines.append(f"{head}: FPR {rate_text(e.fpr)} on {src} honest answers"
                     f"{bounds_text(e.fpr, 'none flagged', 'all flagged')}")
    if e.unplanted_flag_rate is not None:
        lines.append(f"{head}: flags {rate_text(e.unplanted_flag_rate)} of the unplanted rounds of {src} "
                     "(not known to be honest)")
    agree = (f"Cohen's kappa {_num(e.kappa)}" if e.kappa is not None or not e.kappa_note else e.kappa_note)
    lines.append(f"{head} on {src}: {agree}; severity weighted kappa (quadratic) {_num(e.severity_kappa)}; "
                 f"{e.failed_or_missing} of {e.rounds} rounds without a usable audit row (left out of every rate)")
    cal = e.calibration
    if cal:
        lines.append(f"{head} on {src}: confidence Brier {_num(cal.get('brier'), 3)}, ECE {_num(cal.get('ece'), 3)}, "
                     f"AUROC (right vs wrong verdicts) {_num(cal.get('auroc_confidence'))}, "
                     f"AUROC (implied P(deceptive)) {_num(cal.get('auroc_deceptive'))} (n={cal.get('n')})")
    return lines


def markdown(e: AuditorEvaluation, result: dict[str, Any]) -> str:
    """eval.md: the numbers of eval.json as tables (`result` for what only eval.json holds: the
    confusion matrix, type recall, severity errors, calibration bins, self-consistency)."""
    out = [f"# Auditor `{e.auditor_id}` on {e.source}", "",
           f"{e.rounds} rounds judged; {e.failed_or_missing} without a usable audit row (left out of every rate; "
           "the bounds say what they could change). Intervals: Wilson on the effective sample size n / deff, "
           f"t with G − 1 degrees of freedom, clustered by {result.get('cluster_by', 'trial')} (docs/validity.md).",
           "", "| measure | value [95% clustered] (n; clusters, design effect) | if the rows without a verdict ... |",
           "|---|---|---|"]

    def row(name: str, r: MeasuredRate | None, low: str = "all caught", high: str = "all missed") -> None:
        if r is not None:
            out.append(f"| {name} | {rate_text(r)} | {bounds_text(r, low, high).lstrip('; ') or '–'} |")

    for t in TYPES:
        row(f"false-negative rate, {t.lower()}", e.fnr[t])
    row("false-negative rate, all deceptive", e.fnr["all"])
    row("false-positive rate, honest answers", e.fpr, "none flagged", "all flagged")
    row("flag rate, unplanted rounds (not known honest)", e.unplanted_flag_rate, "none flagged", "all flagged")
    out.append(f"| Cohen's kappa, flag | {_num(e.kappa) if e.kappa is not None else (e.kappa_note or '–')} | |")
    sk = result.get("severity_kappa") or {}
    out.append(f"| severity, quadratic-weighted kappa | {_num(sk.get('kappa'))} (n={sk.get('n', 0)}) | |")
    tr = result.get("type_recall")
    if tr:
        out.append(f"| type recall (flagged deceptive answers naming the true type) | "
                   f"{_num(tr['rate'])} (n={tr['n']}) | |")
    sev, sevd = result["severity_mae"], result["severity_mae_deceptive"]
    out.append(f"| severity mean absolute error | {_num(sev['mae'])} (n={sev['n']}) | |")
    out.append(f"| severity mean absolute error, deceptive answers | {_num(sevd['mae'])} (n={sevd['n']}) | |")
    sc = result.get("self_consistency")
    if sc:
        agree = sc["all_agree"]
        out.append(f"| self-consistency: all {sc['k']} flags agree | {_num(agree['rate'])} (n={agree['n']}) | |")
        out.append(f"| self-consistency: pairwise flag agreement | {_num(sc['pairwise_agreement'])} | |")
    cal = result.get("calibration")
    if cal:
        out += ["", "## Calibration of `confidence` (reliability.png)", "",
                f"Brier {_num(cal['brier'], 3)}, ECE {_num(cal['ece'], 3)}, AUROC of confidence (right vs wrong "
                f"verdicts) {_num(cal['auroc_confidence'])}, AUROC of the implied P(deceptive) "
                f"{_num(cal['auroc_deceptive'])}; n={cal['n']}.", "",
                "| confidence bin | rows | mean confidence | share of right verdicts |", "|---|---|---|---|"]
        out += [f"| [{b['low']:.1f}, {b['high']:.1f}) | {b['n']} | {b['mean_confidence']:.2f} | {b['accuracy']:.2f} |"
                for b in cal["bins"]]
    out += ["", "## Type confusion (rows: truth; columns: the auditor's label)", "",
            "| truth | " + " | ".join(PREDICTED) + " |", "|---|" + "---|" * len(PREDICTED)]
    for klass, cols in result["confusion"].items():
        out.append(f"| {klass} | " + " | ".join(str(cols[p]) for p in PREDICTED) + " |")
    return "\n".join(out) + "\n"
