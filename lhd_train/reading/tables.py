"""AUROC tables from a margins table (`lhd_train.reading.read`): which scores, at which positions, and what each row is.

Every row (metric × readout × position × layer; layer −1 = the band mean) carries the pooled and the
within-stratum AUROC (`lens.stats`) with 95 % cluster-bootstrap intervals, the Spearman correlation
with the lexical-echo covariate, and a role: `primary` (the one cell declared before any forward
pass), `negative control` (a position before the judged text: expected 0.5, otherwise a confound;
science-4 D1, D2) or `exploratory`. z-scores are label-free (science-4 D13). docs/lens.md."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pandas as pd

from lens.readout_probe import PROBE
from lens.stats import band_layers, bootstrap_auroc, emergence_layer, nested_best_layer, snap_ties

PRIMARY, CONTROL, EXPLORATORY = "primary", "negative control", "exploratory"
STATED = "stated"  # the readout column of the stated margin's rows: the model's own answer, one per example
CELL = ["readout", "position_class", "position", "layer"]

#: run mode: scores against the auditor's flag (higher = more suspicious)
RUN_METRICS = {
    "internal": "internal: -m_E vs flagged",
    "gap": "gap: z(stated)-z(m_E) vs flagged",
    "gap_stated_supported": "gap within stated-supported (stated Yes > No): z(stated)-z(m_E) vs flagged",
    "stated": "stated: -(Yes-No) vs flagged",
}
#: probe sets: one contrast per claim kind, never pooled (kind with the higher expected margin first).
#: The same claim with and without its evidence line: `length_matched` (both records one line short;
#: the default primary contrast) and `evidence_deleted` (the full record against the shorter one,
#: which prompt length alone separates within every record)
PROBE_CONTRASTS = {
    "length_matched": ("m_E", "stated_other_deleted", "evidence_deleted",
                       "m_E: stated, another line deleted vs evidence_deleted (same claim, length-matched)"),
    "evidence_deleted": ("m_E", "stated", "evidence_deleted", "m_E: stated vs evidence_deleted (same claim)"),
    "absent_attribute": ("m_E", "stated", "absent_attribute", "m_E: stated vs absent_attribute"),
    "different_number": ("m_R", "different_number", "stated", "m_R: different_number vs stated"),
}


@dataclass(frozen=True)
class Primary:
    """The pre-registered cell: a metric key, a readout, an anchor position and a band of depth."""

    metric: str
    readout: str
    anchor: str
    band: tuple[float, float]

    def to_json(self) -> dict:
        return asdict(self)


def _z(v: pd.Series) -> pd.Series:
    """Label-free z-score; values equal up to float noise are made equal first (`lens.stats.snap_ties`)."""
    v = pd.Series(snap_ties(v.to_numpy(dtype=float)), index=v.index)
    sd = v.std(ddof=0)
    return (v - v.mean()) / (sd if np.isfinite(sd) and sd > 0 else 1.0)


def zscored(df: pd.DataFrame, column: str, out: str) -> pd.DataFrame:
    """`df` with `out` = `column` z-scored per (readout, position, layer) over every row (label-free)."""
    return df.assign(**{out: df.groupby(["readout", "position", "layer"])[column].transform(_z)})


def band_mean(frame: pd.DataFrame, lo: int, hi: int) -> pd.DataFrame:
    """One row per example × (readout, position): the mean score over layers lo..hi, as layer −1."""
    b = frame[(frame["layer"] >= lo) & (frame["layer"] <= hi)]
    if b.empty:
        return b
    keys = ["example_id", "cluster", "stratum", "readout", "position_class", "position"]
    agg = b.groupby(keys, as_index=False, dropna=False).agg(
        y=("y", "first"), score=("score", "mean"), echo=("echo", "first"), control=("control", "first"))
    return agg.assign(layer=-1)


def auroc_rows(key: str, title: str, frame: pd.DataFrame, *, n_boot: int, seed: int) -> list[dict]:
    """One row per cell of `frame` (columns: CELL, example_id, cluster, stratum, y, score, echo, control)."""
    rows = []
    for (ro, cls, pos, layer), g in frame.groupby(CELL, sort=True):
        s, y, cl = g["score"].to_numpy(float), g["y"].to_numpy(bool), g["cluster"].astype(str).to_numpy()
        pooled = bootstrap_auroc(s, y, cl, n_boot=n_boot, seed=seed)
        within = bootstrap_auroc(s, y, cl, strata=g["stratum"].astype(str).to_numpy(), n_boot=n_boot, seed=seed)
        rows.append({"metric_key": key, "metric": title, "readout": ro, "position_class": cls, "position": pos,
                     "layer": int(layer), "role": CONTROL if bool(g["control"].all()) else EXPLORATORY,
                     "n_pos": pooled.n_pos, "n_neg": pooled.n_neg, "n_clusters": pooled.n_clusters,
                     "n_within_pairs": within.n_pairs,
                     "auroc": pooled.auroc, "ci_lo": pooled.lo, "ci_hi": pooled.hi,
                     "auroc_within": within.auroc, "within_lo": within.lo, "within_hi": within.hi,
                     "echo_rho": _spearman(s, g["echo"].to_numpy(float))})
    return rows


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    ok = ~(np.isnan(a) | np.isnan(b))
    if ok.sum() < 3 or np.ptp(a[ok]) == 0 or np.ptp(b[ok]) == 0:
        return float("nan")
    from scipy.stats import spearmanr

    return float(spearmanr(a[ok], b[ok]).statistic)


def _anchors(margins_df: pd.DataFrame) -> pd.DataFrame:
    return margins_df[margins_df["is_anchor"]]


def _frame(df: pd.DataFrame, y: pd.Series, score: pd.Series, echo: pd.Series) -> pd.DataFrame:
    keep = ["example_id", "cluster", "stratum", "control", *CELL]
    return df[keep].assign(y=y.to_numpy(bool), score=score.to_numpy(float), echo=echo.to_numpy(float))


@dataclass
class Scored:
    """The per-example scores of one metric (per layer), from which its table rows come."""

    key: str
    title: str
    frame: pd.DataFrame
    layered: bool = True  # False: one score per example (the stated margin), no band mean


def run_scores(margins_df: pd.DataFrame, examples_df: pd.DataFrame, n_layers: int) -> list[Scored]:
    """Run mode: internal (−m_E), gap (z(stated) − z(m_E)), the gap within stated-supported rounds
    (stated Yes−No > 0: the answer-controlled cell), and stated alone; scored against the flag."""
    a = _anchors(margins_df).copy()
    stated = examples_df.set_index("example_id")["stated"]
    a["stated"] = a["example_id"].map(stated)
    a = zscored(zscored(a, "m_E", "z_int"), "stated", "z_stated")  # before dropping unlabelled rounds
    a = a[a["label"].notna()]
    if a.empty:
        return []
    y = a["label"].astype(bool)
    echo = a["echo_N"] - a["echo_S"]  # N words in context pull m_E down: oriented like −m_E
    # the gap pairs the internal margin with the stated one read after the answer: at a position before
    # the answer it would mix a control with a reading of the answer, so it is read only where both see it
    sees = ~a["control"].astype(bool)
    out = [Scored("internal", RUN_METRICS["internal"], _frame(a, y, -a["z_int"], echo)),
           Scored("gap", RUN_METRICS["gap"], _frame(a[sees], y[sees], (a["z_stated"] - a["z_int"])[sees], echo[sees]))]
    cell = (a["stated"] > 0) & (a["readout"] != PROBE) & sees  # the probe predicts the flag itself
    out.append(Scored("gap_stated_supported", RUN_METRICS["gap_stated_supported"],
                      _frame(a[cell], y[cell], (a["z_stated"] - a["z_int"])[cell], echo[cell])))
    e = examples_df[examples_df["label"].notna()]
    if len(e):
        e = e.assign(readout=STATED, position_class="decision", position="decision", layer=n_layers - 1,
                     control=False)
        out.append(Scored("stated", RUN_METRICS["stated"],
                          _frame(e, e["label"].astype(bool), -e["stated"], e["echo_N"] - e["echo_S"]), False))
    return out


def probe_scores(margins_df: pd.DataFrame, examples_df: pd.DataFrame) -> list[Scored]:
    """Probe sets: each claim kind against `stated` on its own margin (`PROBE_CONTRASTS`)."""
    a = _anchors(margins_df).copy()
    a["claim_kind"] = a["example_id"].map(examples_df.set_index("example_id")["claim_kind"])
    out = []
    for key, (margin, positive, negative, title) in PROBE_CONTRASTS.items():
        g = a[a["claim_kind"].isin([positive, negative])]
        if g.empty or g["claim_kind"].nunique() < 2:
            continue
        g = zscored(g, margin, "z")
        sign = 1.0 if margin == "m_E" else -1.0  # orient the echo like the margin
        out.append(Scored(key, title, _frame(g, g["claim_kind"] == positive, g["z"],
                                             sign * (g["echo_S"] - g["echo_N"]))))
    return out


def build_table(scored: Sequence[Scored], *, n_layers: int, band: Sequence[float], n_boot: int,
                seed: int) -> pd.DataFrame:
    """Rows per layer and over the band for every metric (the stated row has no layers)."""
    lo, hi = band_layers(n_layers, band)
    rows: list[dict] = []
    for sc in scored:
        if sc.frame.empty:
            continue
        rows += auroc_rows(sc.key, sc.title, sc.frame, n_boot=n_boot, seed=seed)
        if sc.layered:
            b = band_mean(sc.frame, lo, hi)
            if not b.empty:
                rows += auroc_rows(sc.key, f"{sc.title}, band L{lo}-{hi} (mean z)", b, n_boot=n_boot, seed=seed)
    return pd.DataFrame(rows)


def exploratory_note(lo: Sequence[float], hi: Sequence[float]) -> str:
    """The line beside the exploratory tables (science-5 §3.3): how many cells carry a 95 % interval, how many of
    those exclude 0.5, and how many would by chance alone."""
    cells = [(a, b) for a, b in zip(lo, hi, strict=True) if not (pd.isna(a) or pd.isna(b))]
    n = len(cells)
    outside = sum(a > 0.5 or b < 0.5 for a, b in cells)
    return (f"{n} exploratory cells carry a 95 % interval and {outside} of them exclude 0.5. With no signal in any "
            f"cell about 5 % of them ({0.05 * n:.0f}) would exclude 0.5 by chance: no interval is corrected for the "
            "others, and cells that share examples or neighbouring layers are not independent.")


def mark_primary(table: pd.DataFrame, primary: Primary) -> dict:
    """Set the role of the declared cell's band row to `primary`, and return that row (or why there is none)."""
    if table.empty:
        return {"declared": primary.to_json(), "found": False, "why": "no labelled example: no AUROC"}
    hit = ((table["metric_key"] == primary.metric) & (table["readout"] == primary.readout)
           & (table["position"] == primary.anchor) & (table["layer"] == -1))
    if not hit.any():
        return {"declared": primary.to_json(), "found": False,
                "why": f"no {primary.readout} row for {primary.metric} at {primary.anchor} over the band "
                       "(readout not read, or no labelled example in that cell)"}
    table.loc[hit, "role"] = PRIMARY
    row = table[hit].iloc[0].to_dict()
    return {"declared": primary.to_json(), "found": True, **{k: row[k] for k in (
        "metric", "readout", "position", "n_pos", "n_neg", "n_clusters", "n_within_pairs", "auroc_within",
        "within_lo", "within_hi", "auroc", "ci_lo", "ci_hi", "echo_rho")}}


def layer_choice(scored: Sequence[Scored], table: pd.DataFrame, *, headline: str, threshold: float,
                 n_splits: int = 5) -> pd.DataFrame:
    """Per metric × readout × anchor: the layer of emergence and the in-sample best layer (both
    exploratory: chosen on the data they describe), and the best layer chosen on held-out
    clusters (`lens.stats.nested_best_layer`, within strata) with the AUROC it reaches there."""
    rows: list[dict] = []
    lo_col = {"auroc": "ci_lo", "auroc_within": "within_lo"}[headline]
    for sc in scored:
        if not sc.layered:
            continue
        f = sc.frame[~sc.frame["control"].astype(bool)]
        for (ro, cls, pos), g in f.groupby(["readout", "position_class", "position"]):
            t = table[(table["metric_key"] == sc.key) & (table["readout"] == ro) & (table["position"] == pos)
                      & (table["layer"] >= 0)].sort_values("layer")
            if t.empty:
                continue
            best = t.loc[t[headline].idxmax()] if t[headline].notna().any() else None
            wide = g.pivot(index="example_id", columns="layer", values="score")  # [examples, layers]
            who = g.drop_duplicates("example_id").set_index("example_id").loc[wide.index]
            nested = nested_best_layer(wide.to_numpy(float), [int(c) for c in wide.columns], who["y"].to_numpy(bool),
                                       who["cluster"].astype(str).to_numpy(), strata=who["stratum"].astype(str),
                                       n_splits=n_splits)
            rows.append({"metric_key": sc.key, "metric": sc.title, "readout": ro, "position_class": cls,
                         "position": pos,
                         "emergence_layer": emergence_layer(t["layer"].tolist(), t[headline].fillna(0).tolist(),
                                                            t[lo_col].fillna(0).tolist(), threshold=threshold),
                         "best_layer_in_sample": None if best is None else int(best["layer"]),
                         "best_auroc_in_sample": None if best is None else float(best[headline]),
                         "nested_auroc": nested.auroc, "nested_layers": ",".join(map(str, nested.layers)),
                         "nested_folds": nested.n_folds})
    return pd.DataFrame(rows)


def baseline_row(name: str, what: str, score: Any, y: Any, clusters: Any, strata: Any, *, n_boot: int,
                 seed: int) -> dict:
    """A non-lens score against the same labels, pooled and within strata."""
    pooled = bootstrap_auroc(score, y, clusters, n_boot=n_boot, seed=seed)
    within = bootstrap_auroc(score, y, clusters, strata=strata, n_boot=n_boot, seed=seed)
    return {"baseline": name, "score": what, "n_pos": pooled.n_pos, "n_neg": pooled.n_neg,
            "auroc": pooled.auroc, "ci_lo": pooled.lo, "ci_hi": pooled.hi,
            "auroc_within": within.auroc, "within_lo": within.lo, "within_hi": within.hi}


def out_of_fold_rate(y: np.ndarray, strata: np.ndarray, clusters: np.ndarray, *,
                     n_splits: int = 5) -> np.ndarray:
    """Each example's stratum rate of positives, estimated on the other clusters (`GroupKFold`);
    the overall training rate where the training folds lack the stratum (the task-only baseline)."""
    from sklearn.model_selection import GroupKFold

    y = np.asarray(y).astype(bool)
    out = np.full(len(y), np.nan)
    n_groups = len(np.unique(clusters))
    if n_groups < 2:
        return out
    for train, test in GroupKFold(n_splits=min(n_splits, n_groups)).split(y, y, clusters):
        overall = float(y[train].mean())
        rates = pd.Series(y[train]).groupby(np.asarray(strata)[train]).mean()
        out[test] = [float(rates.get(s, overall)) for s in np.asarray(strata)[test]]
    return out

