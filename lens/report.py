"""Tables and the heatmap from a margins table (see `lens.read`).

Files written by `write_outputs`:
`margins.parquet` (long: example × readout × layer × position), `examples.parquet`,
`auroc.csv` (metric × readout × position class × layer, with CI), `auroc.md` (the same as
layer-by-column tables plus the emergence table), `heatmap.png`, `summary.json`.
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from lens.positions import POSITION_CLASSES
from lens.stats import bootstrap_auroc, emergence_layer
from lhd_train.io.csv_cells import write_csv
from lhd_train.io.files import atomic_write, atomic_write_text

READOUT_ORDER = ["jacobian", "logit", "probe", "stated"]


def _cells(df: pd.DataFrame, metric: str, y: pd.Series, score: pd.Series, n_boot: int, seed: int) -> list[dict]:
    out = []
    keys = ["readout", "position_class", "position", "layer"]
    frame = df.assign(_y=y.values, _s=score.values)
    for (ro, cls, pos, layer), g in frame.groupby(keys, sort=True):
        ci = bootstrap_auroc(g["_s"].to_numpy(float), g["_y"].to_numpy(bool), g["cluster"].astype(str).to_numpy(),
                             n_boot=n_boot, seed=seed)
        out.append({"metric": metric, "readout": ro, "position_class": cls, "position": pos, "layer": int(layer),
                    "n_pos": ci.n_pos, "n_neg": ci.n_neg, "n_clusters": ci.n_clusters,
                    "auroc": ci.auroc, "ci_lo": ci.lo, "ci_hi": ci.hi})
    return out


def probe_set_table(margins_df: pd.DataFrame, *, n_boot: int, seed: int) -> pd.DataFrame:
    """AUROC of m_E (SUPPORTED vs NOT_ENTITLED) and of m_R (REFUTED vs the rest) at class anchors."""
    a = margins_df[margins_df["is_anchor"]]
    rows = []
    se = a[a["label"].isin(["SUPPORTED", "NOT_ENTITLED"])]
    if len(se):
        rows += _cells(se, "m_E: SUPPORTED vs NOT_ENTITLED", se["label"] == "SUPPORTED", se["m_E"], n_boot, seed)
    if (a["label"] == "REFUTED").any() and a["m_R"].notna().any():
        rows += _cells(a, "m_R: REFUTED vs rest", a["label"] == "REFUTED", a["m_R"], n_boot, seed)
    return pd.DataFrame(rows)


def _z(values: pd.Series, ref_mask: pd.Series) -> pd.Series:
    ref = values[ref_mask]
    sd = ref.std(ddof=0)
    mu = ref.mean()
    if not np.isfinite(sd) or sd == 0:
        sd = values.std(ddof=0) or 1.0
    return (values - mu) / sd


def run_table(margins_df: pd.DataFrame, examples_df: pd.DataFrame, *, n_layers: int, band: Sequence[float],
              n_boot: int, seed: int) -> pd.DataFrame:
    """Against the auditor's flag: internal margin (−m_E), gap G = z(stated) − z(m_E), stated alone, band means."""
    a = margins_df[margins_df["is_anchor"] & margins_df["label"].notna()].copy()
    if a.empty:
        return pd.DataFrame()
    a["label"] = a["label"].astype(bool)
    stated = examples_df.set_index("example_id")["stated_m_E"]
    a["stated"] = a["example_id"].map(stated)
    parts = []
    for _, g in a.groupby(["readout", "position", "layer"]):
        g = g.copy()
        g["z_int"] = _z(g["m_E"], ~g["label"])
        g["z_stated"] = _z(g["stated"], ~g["label"])
        parts.append(g)
    a = pd.concat(parts)
    a["gap"] = a["z_stated"] - a["z_int"]
    rows = _cells(a, "internal: -m_E vs flagged", a["label"], -a["m_E"], n_boot, seed)
    rows += _cells(a, "gap: z(stated)-z(m_E) vs flagged", a["label"], a["gap"], n_boot, seed)
    # workspace-band means (layers in [band[0], band[1]] of depth)
    lo, hi = int(math.floor(band[0] * (n_layers - 1))), int(math.ceil(band[1] * (n_layers - 1)))
    b = a[(a["layer"] >= lo) & (a["layer"] <= hi)]
    if len(b):
        agg = b.groupby(["example_id", "cluster", "readout", "position_class", "position"], as_index=False).agg(
            label=("label", "first"), z_int=("z_int", "mean"), z_stated=("z_stated", "first"))
        agg["layer"] = -1
        rows += _cells(agg, f"internal band L{lo}-{hi}: -mean z(m_E)", agg["label"], -agg["z_int"], n_boot, seed)
        rows += _cells(agg, f"gap band L{lo}-{hi}: z(stated)-mean z(m_E)", agg["label"], agg["z_stated"] - agg["z_int"],
                       n_boot, seed)
    e = examples_df[examples_df["label"].notna()].copy()
    if len(e):
        e["label"] = e["label"].astype(bool)
        e = e.assign(readout="stated", position_class="decision", position="decision", layer=n_layers - 1)
        rows += _cells(e, "stated: -final m_E vs flagged", e["label"], -e["stated_m_E"], n_boot, seed)
    return pd.DataFrame(rows)


def emergence(table: pd.DataFrame, *, threshold: float = 0.70) -> pd.DataFrame:
    rows: list[dict[str, Any]] = []
    if table.empty:
        return pd.DataFrame(rows)
    per_layer = table[table["layer"] >= 0]
    for (metric, ro, cls), g in per_layer.groupby(["metric", "readout", "position_class"]):
        if metric.startswith("stated") or metric.startswith("m_R"):
            continue
        g = g.sort_values("layer")
        best = g.loc[g["auroc"].idxmax()] if g["auroc"].notna().any() else None
        rows.append({"metric": metric, "readout": ro, "position_class": cls,
                     "emergence_layer": emergence_layer(g["layer"].tolist(), g["auroc"].fillna(0).tolist(),
                                                        g["ci_lo"].fillna(0).tolist(), threshold=threshold),
                     "best_layer": None if best is None else int(best["layer"]),
                     "best_auroc": None if best is None else float(best["auroc"])})
    return pd.DataFrame(rows)


def _fmt(r: pd.Series) -> str:
    if pd.isna(r["auroc"]):
        return "–"
    if pd.isna(r["ci_lo"]):
        return f"{r['auroc']:.2f}"
    return f"{r['auroc']:.2f} [{r['ci_lo']:.2f}, {r['ci_hi']:.2f}]"


def markdown(table: pd.DataFrame, emerg: pd.DataFrame, *, title: str, notes: Sequence[str] = ()) -> str:
    lines = [f"# {title}", ""]
    lines += [f"- {n}" for n in notes]
    if notes:
        lines.append("")
    if table.empty:
        return "\n".join(lines + ["(no labelled example: no AUROC)", ""])
    for metric, g in table.groupby("metric", sort=False):
        g = g.assign(cell=g.apply(_fmt, axis=1))
        order = [r for r in READOUT_ORDER if r in set(g["readout"])] + sorted(set(g["readout"]) - set(READOUT_ORDER))
        cols = [(ro, cls) for ro in order for cls in POSITION_CLASSES
                if ((g["readout"] == ro) & (g["position_class"] == cls)).any()]
        layers = sorted(g["layer"].unique())
        lines += [f"## AUROC, {metric} (95% CI, cluster bootstrap)", "",
                  "| layer | " + " | ".join(f"{ro} · {cls}" for ro, cls in cols) + " |",
                  "|---|" + "---|" * len(cols)]
        for layer in layers:
            cells = []
            for ro, cls in cols:
                hit = g[(g["layer"] == layer) & (g["readout"] == ro) & (g["position_class"] == cls)]
                cells.append(hit["cell"].iloc[0] if len(hit) else "")
            lines.append(f"| {'band' if layer < 0 else layer} | " + " | ".join(cells) + " |")
        n = g.iloc[0]
        lines += ["", f"n_pos = {int(n['n_pos'])}, n_neg = {int(n['n_neg'])}, clusters = {int(n['n_clusters'])}", ""]
    if not emerg.empty:
        lines += ["## Layer of emergence (first layer with AUROC ≥ threshold and CI low > 0.5 "
                  "for 3 consecutive layers)", "",
                  "| metric | readout | position class | emergence layer | best layer | best AUROC |",
                  "|---|---|---|---|---|---|"]
        for _, r in emerg.iterrows():
            em = "–" if r["emergence_layer"] is None or pd.isna(r["emergence_layer"]) else int(r["emergence_layer"])
            best = "–" if r["best_auroc"] is None or pd.isna(r["best_auroc"]) else f"{r['best_auroc']:.2f}"
            bl = "–" if r["best_layer"] is None or pd.isna(r["best_layer"]) else int(r["best_layer"])
            lines.append(f"| {r['metric']} | {r['readout']} | {r['position_class']} | {em} | {bl} | {best} |")
        lines.append("")
    return "\n".join(lines)


def heatmap(table: pd.DataFrame, metric: str, path: Path, *, title: str) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = table[(table["metric"] == metric) & (table["layer"] >= 0)]
    if t.empty:
        return None
    readouts = [r for r in READOUT_ORDER if r in set(t["readout"])] + sorted(set(t["readout"]) - set(READOUT_ORDER))
    readouts = [r for r in readouts if r != "stated"]
    layers = sorted(t["layer"].unique())
    fig, axes = plt.subplots(1, len(readouts), figsize=(2.6 * len(readouts) + 1.2, 0.28 * len(layers) + 2.2),
                             squeeze=False, sharey=True, layout="constrained")
    im = None
    for ax, ro in zip(axes[0], readouts, strict=True):
        M = np.full((len(layers), len(POSITION_CLASSES)), np.nan)
        for _, r in t[t["readout"] == ro].iterrows():
            M[layers.index(r["layer"]), POSITION_CLASSES.index(r["position_class"])] = r["auroc"]
        im = ax.imshow(M, vmin=0.0, vmax=1.0, cmap="RdBu_r", aspect="auto", origin="lower")
        ax.set_title(ro)
        ax.set_xticks(range(len(POSITION_CLASSES)), POSITION_CLASSES, rotation=30)
        ax.set_yticks(range(len(layers)), [str(layer) for layer in layers])
        if len(layers) <= 48:
            for i in range(len(layers)):
                for j in range(len(POSITION_CLASSES)):
                    if np.isfinite(M[i, j]):
                        ax.text(j, i, f"{M[i, j]:.2f}", ha="center", va="center", fontsize=6)
    axes[0][0].set_ylabel("layer")
    fig.suptitle(f"{title}\nAUROC, {metric}", fontsize=9)
    assert im is not None  # one image per readout, and `plt.subplots` refuses zero columns
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=130, bbox_inches="tight"))
    plt.close(fig)
    return path


def _json_default(o: Any):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return None if not np.isfinite(o) else float(o)
    if isinstance(o, (np.ndarray,)):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    return str(o)


def write_outputs(out_dir: Path, margins_df: pd.DataFrame, examples_df: pd.DataFrame, table: pd.DataFrame,
                  emerg: pd.DataFrame, summary: dict, *, title: str, primary_metric: str | None,
                  notes: Sequence[str] = ()) -> dict[str, str]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    m = margins_df.copy()
    m["label"] = m["label"].astype(str)
    atomic_write(out / "margins.parquet", lambda tmp: m.to_parquet(tmp, index=False))
    e = examples_df.copy()
    e["label"] = e["label"].astype(str)
    atomic_write(out / "examples.parquet", lambda tmp: e.to_parquet(tmp, index=False))
    files.update(margins=str(out / "margins.parquet"), examples=str(out / "examples.parquet"))
    write_csv(table, out / "auroc.csv")  # text cells never start a formula (lhd_train/io/csv_cells.py)
    write_csv(emerg, out / "emergence.csv")
    atomic_write_text(out / "auroc.md", markdown(table, emerg, title=title, notes=notes))
    files.update(auroc_csv=str(out / "auroc.csv"), auroc_md=str(out / "auroc.md"), emergence=str(out / "emergence.csv"))
    if primary_metric:
        png = heatmap(table, primary_metric, out / "heatmap.png", title=title)
        if png:
            files["heatmap"] = str(png)
    summary = {**summary, "files": files}
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2, default=_json_default) + "\n")
    files["summary"] = str(out / "summary.json")
    return files
