"""The reliability diagram of an auditor's `confidence` (`lhd audit-eval` writes it as
reliability.png beside eval.json): per confidence bin, the share of right verdicts against the
mean confidence, with the diagonal of perfect calibration. matplotlib's Figure directly (no
pyplot), so nothing depends on a display."""
from __future__ import annotations

import io

from lhd_train.audit.eval_results import Calibration


def reliability_png(cal: Calibration, title: str) -> bytes:
    """PNG bytes of the diagram of an evaluation's calibration (eval.json `result.calibration`)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.2, 4.2))
    ax = fig.add_subplot()
    ax.plot([0, 1], [0, 1], color="#999999", lw=1, ls="--", label="perfect calibration")
    x = [b.mean_confidence for b in cal.bins]
    y = [b.accuracy for b in cal.bins]
    sizes = [20 + 180 * b.n / max(cal.n, 1) for b in cal.bins]
    ax.plot(x, y, color="#4c72b0", lw=1)
    ax.scatter(x, y, s=sizes, color="#4c72b0", zorder=3, label="bins (area ~ rows)")
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="mean confidence in the bin", ylabel="share of right verdicts",
           title=title)
    ax.text(0.02, 0.97, f"Brier {cal.brier:.3f}  ECE {cal.ece:.3f}  n={cal.n}", transform=ax.transAxes,
            va="top", fontsize=8)
    ax.legend(loc="lower right", fontsize=7)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return buf.getvalue()
