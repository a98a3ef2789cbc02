"""Reading entitlement margins per layer × position for every example (`lhd lens read`).

One forward per example captures every block output at the tagged positions; the logit lens
and the Jacobian lens turn them into logits over S ∪ N ∪ R, from which the margins follow; the
linear probe is trained per (layer, position class) with record-grouped folds and read out of
fold. Everything lands in one long table (`margins.parquet`), which `lens.report` summarises:

- probe sets: AUROC of `m_E` for SUPPORTED vs NOT_ENTITLED (and `m_R` for REFUTED vs the rest)
  per readout × layer × position class, bootstrap CIs clustered by record, layer of emergence;
- benchmark runs: AUROC against the auditor's flag of the internal margin (`−m_E`, low
  entitlement = suspicious) and of the gap `G = z(stated) − z(m_E)` between what the model's own
  output asserts at the decision position and the internal margin (z-scored per layer on
  unflagged rounds), clustered by trial.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from lens.errors import LensError
from lens.margins import MARGIN_NAMES, TokenSets, margins
from lens.model import LensModel, block_outputs
from lens.positions import ANCHORS, POSITION_CLASSES, ReadExample, render_chat, tag_chat_prompt
from lens.readout import out_of_fold_logits
from lens.runs import load_run_examples
from lhd_train.api import TaskPack

log = logging.getLogger(__name__)


@dataclass
class ReadConfig:
    max_length: int = 4096
    answer_tokens: int = 3
    max_claims: int = 16  # run mode: asserted claims read per answer (thinned evenly beyond that)
    n_boot: int = 2000
    seed: int = 0
    probe: bool = True
    probe_folds: int = 5
    probe_C: float = 1.0
    emergence_threshold: float = 0.70
    band: tuple[float, float] = (0.35, 0.85)  # workspace band as fractions of depth (run summary)
    progress: bool = True


@dataclass
class Collected:
    rows: list[dict] = field(default_factory=list)  # long margins table
    examples: list[dict] = field(default_factory=list)  # one per read example
    features: dict[str, list[np.ndarray]] = field(default_factory=dict)  # class -> [L, d] per example
    feature_ids: list[str] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)


def collect(
    model: LensModel,
    tokenizer: Any,
    examples: Sequence[ReadExample],
    readouts: Sequence[Any],
    token_sets: TokenSets,
    cfg: ReadConfig,
) -> Collected:
    """Margins of every readout at every layer and tagged position, plus anchor hidden states for the probe."""
    union = torch.tensor(token_sets.union(), dtype=torch.long, device=model.device)
    sets = token_sets.index_sets()
    L = model.n_layers
    out = Collected(features={c: [] for c in POSITION_CLASSES})
    for ex in tqdm(examples, desc="read", unit="example", disable=not cfg.progress, dynamic_ncols=True):
        try:
            tag = tag_chat_prompt(tokenizer, ex.messages, ex.spans, prefill=ex.prefill, answer=ex.answer,
                                  answer_tokens=cfg.answer_tokens, claims=ex.claims)
        except LensError as exc:
            out.skipped.append({"example_id": ex.example_id, "reason": str(exc)})
            log.warning("%s skipped: %s", ex.example_id, exc)
            continue
        if tag.n_prompt > cfg.max_length:
            out.skipped.append({"example_id": ex.example_id, "reason": f"{tag.n_prompt} prompt tokens > max_length"})
            log.warning("%s skipped: %d prompt tokens > max_length %d", ex.example_id, tag.n_prompt, cfg.max_length)
            continue
        # claims past max_length are not read; nothing after the first answer tokens and the last
        # claim is read, and causal attention makes it irrelevant
        claims = [c for c in tag.claims if tag.positions[c] < cfg.max_length]
        n_tok = tag.n_prompt + min(cfg.answer_tokens, len(tag.input_ids) - tag.n_prompt)
        n_tok = max([n_tok] + [tag.positions[c] + 1 for c in claims])
        ids = torch.tensor(tag.input_ids[:n_tok], device=model.device)[None]
        acts = block_outputs(model, ids)
        points = [n for n, p in tag.positions.items() if p < n_tok]
        names = points + list(tag.pooled)
        idx = torch.tensor([tag.positions[n] for n in points], device=model.device)
        H = torch.stack([torch.cat([acts[layer][0, idx]] + [acts[layer][0, toks].mean(0, keepdim=True)
                                                              for toks in tag.pooled.values()])
                         for layer in range(L)])  # [L, P, d]
        token_index = {**tag.positions, **{n: toks[-1] for n, toks in tag.pooled.items()}}
        dec = names.index("decision")
        claim_cols = [names.index(c) for c in claims]
        base = {"example_id": ex.example_id, "cluster": ex.cluster, "label": ex.label}
        final, stated = {}, {}
        for ro in readouts:
            layers = [layer for layer in range(L) if ro.has_layer(layer)]
            with torch.no_grad():
                z = torch.stack([ro.logits(layer, H[layer], token_ids=union) for layer in layers])  # [L', P, U]
            m = {k: v.cpu().numpy() for k, v in margins(z, sets).items()}
            for j, layer in enumerate(layers):
                for p, name in enumerate(names):
                    rows = {"readout": ro.name, "layer": layer, "position": name, "position_class": tag.classes[name],
                            "is_anchor": ANCHORS[tag.classes[name]] == name, "token_index": token_index[name]}
                    rows.update({k: float(m[k][j, p]) for k in MARGIN_NAMES})
                    out.rows.append({**base, **rows})
            final[ro.name] = float(m["m_E"][-1, dec])  # the last block is always readable
            stated[ro.name] = float(m["m_E"][-1, claim_cols].mean()) if claim_cols else final[ro.name]
        # The model's own (stated) margin: the last block's readout is the model's logits. Read at
        # the end of the answer's asserted claims (mean over them) when it has any (docs/lens-background.md §5,
        # performer regime), else at the decision position (the verifier regime's d).
        out.examples.append({**base, "n_tokens": n_tok, "n_prompt_tokens": tag.n_prompt,
                             "stated_m_E": stated.get("logit", next(iter(stated.values()), float("nan"))),
                             "stated_position": "claims" if claim_cols else "decision", "n_claims": len(claim_cols),
                             **{f"final_m_E_{k}": v for k, v in final.items()}, **ex.info})
        for c in POSITION_CLASSES:
            out.features[c].append(H[:, names.index(ANCHORS[c])].float().cpu().numpy())
        out.feature_ids.append(ex.example_id)
    if not out.examples:
        raise LensError("no example could be read (see the warnings above)")
    return out


def probe_rows(col: Collected, classes: Sequence[Any], set_of_class: dict[str, Sequence[Any]],
               cfg: ReadConfig) -> list[dict]:
    """Out-of-fold linear-probe margins at the anchor of each position class, for every layer.

    `classes` are the label values in the order of the probe's logit columns; `set_of_class`
    maps S/N/R to the label values whose logits form each set.
    """
    ex = {e["example_id"]: e for e in col.examples}
    labels = np.array([ex[i]["label"] for i in col.feature_ids], dtype=object)
    groups = np.array([ex[i]["cluster"] for i in col.feature_ids], dtype=object)
    known = np.array([lab is not None and lab in classes for lab in labels])
    present = [c for c in classes if (labels[known] == c).any()]
    if known.sum() < 4 or len(present) < 2 or len(np.unique(groups[known])) < 2:
        log.warning("linear probe skipped: needs ≥ 4 labelled examples, 2 classes and 2 records")
        return []
    y = np.array([present.index(v) for v in labels[known]])
    idx_sets = {k: [present.index(c) for c in v if c in present] for k, v in set_of_class.items()}
    rows = []
    for cls in POSITION_CLASSES:
        feats = np.stack(col.features[cls])  # [n, L, d]
        for layer in range(feats.shape[1]):
            X = feats[known, layer, :]
            try:
                Z = out_of_fold_logits(X, y, groups[known], n_splits=cfg.probe_folds, C=cfg.probe_C, seed=cfg.seed)
            except LensError as exc:
                log.warning("probe at layer %d, %s: %s", layer, cls, exc)
                continue
            m = {k: v.numpy() for k, v in margins(torch.from_numpy(Z), idx_sets).items()}
            for j, i in enumerate(np.flatnonzero(known)):
                e = ex[col.feature_ids[i]]
                rows.append({"example_id": e["example_id"], "cluster": e["cluster"], "label": e["label"],
                             "readout": "probe", "layer": layer, "position": ANCHORS[cls], "position_class": cls,
                             "is_anchor": True, "token_index": -1, **{k: float(m[k][j]) for k in MARGIN_NAMES}})
    return rows


def gap_within_stated_supported(margins_df: Any, examples_df: Any, *, n_layers: int, band: Sequence[float],
                                n_boot: int, seed: int) -> list[dict]:
    """AUROC of the gap against the flag among rounds whose stated margin says "supported" (> 0):
    the answer-controlled comparison of docs/lens-background.md §7 (what the answer asserts is held fixed, so
    only the internal side can separate). z-scores use every unflagged round, as for the full gap;
    per layer × anchor, and over the workspace band (mean z(m_E) over its layers)."""
    import math

    import pandas as pd

    from lens.stats import bootstrap_auroc

    a = margins_df[margins_df["is_anchor"] & margins_df["label"].notna() & (margins_df["readout"] != "probe")].copy()
    if a.empty:
        return []
    a["label"] = a["label"].astype(bool)
    stated = examples_df.set_index("example_id")["stated_m_E"]
    a["stated"] = a["example_id"].map(stated)

    def z(v, honest):
        sd = v[honest].std(ddof=0)
        sd = sd if np.isfinite(sd) and sd > 0 else (v.std(ddof=0) or 1.0)
        return (v - v[honest].mean()) / sd

    keys = ["readout", "position_class", "position", "layer"]
    parts = []
    for _, g in a.groupby(keys):
        g = g.assign(z_int=z(g["m_E"], ~g["label"]), z_stated=z(g["stated"], ~g["label"]))
        parts.append(g)
    a = pd.concat(parts)
    lo, hi = int(math.floor(band[0] * (n_layers - 1))), int(math.ceil(band[1] * (n_layers - 1)))
    b = a[(a["layer"] >= lo) & (a["layer"] <= hi)]
    band_rows = b.groupby(["example_id", "cluster"] + keys[:3], as_index=False).agg(
        label=("label", "first"), stated=("stated", "first"), z_int=("z_int", "mean"), z_stated=("z_stated", "first"))
    band_rows["layer"] = -1
    rows = []
    for metric, df in (("gap within stated-supported: z(stated)-z(m_E) vs flagged", a),
                       (f"gap within stated-supported, band L{lo}-{hi}: z(stated)-mean z(m_E)", band_rows)):
        for (ro, cls, pos, layer), g in df.groupby(keys, sort=True):
            g = g[g["stated"] > 0]
            ci = bootstrap_auroc((g["z_stated"] - g["z_int"]).to_numpy(float), g["label"].to_numpy(bool),
                                 g["cluster"].astype(str).to_numpy(), n_boot=n_boot, seed=seed)
            rows.append({"metric": metric, "readout": ro, "position_class": cls, "position": pos, "layer": int(layer),
                         "n_pos": ci.n_pos, "n_neg": ci.n_neg, "n_clusters": ci.n_clusters,
                         "auroc": ci.auroc, "ci_lo": ci.lo, "ci_hi": ci.hi})
    return rows


def config_dict(cfg: ReadConfig) -> dict:
    return asdict(cfg)


# ---------------------------------------------------------------------------------------------
# the two reading modes
# ---------------------------------------------------------------------------------------------


def _readouts(model: LensModel, lens: Any) -> list[Any]:
    from lens.readout import JacobianLens, LogitLens

    ros: list[Any] = [LogitLens(model)]
    if lens is not None:
        ros.insert(0, JacobianLens(model, lens))
    return ros


def _lens_info(lens: Any) -> dict | None:
    if lens is None:
        return None
    keep = ("format", "model_id", "revision", "target_layer", "n_prompts", "skip_first", "max_length", "sha256", "file")
    return {k: lens.meta.get(k) for k in keep}


def read_probe_set(model: LensModel, tokenizer: Any, lens: Any, probes: Sequence[dict], token_sets: TokenSets,
                   out_dir: str | Path, cfg: ReadConfig | None = None) -> dict:
    """Margins, AUROC table, emergence and heatmap for an entitlement probe set."""
    import pandas as pd

    from lens import report
    from lens.probes import LABELS, NOT_ENTITLED, REFUTED, SUPPORTED, render_probe

    cfg = cfg or ReadConfig()
    examples = []
    for row in probes:
        messages, spans, prefill = render_probe(row)
        examples.append(ReadExample(row["id"], row["record_id"], row["label"], messages, spans, prefill=prefill,
                                    info={"pair_id": row.get("pair_id"), "claim_kind": row.get("claim_kind"),
                                          "record_variant": row.get("record_variant")}))
    col = collect(model, tokenizer, examples, _readouts(model, lens), token_sets, cfg)
    rows = list(col.rows)
    if cfg.probe:
        rows += probe_rows(col, list(LABELS), {"S": [SUPPORTED], "N": [NOT_ENTITLED], "R": [REFUTED]}, cfg)
    mdf = pd.DataFrame(rows)
    edf = pd.DataFrame(col.examples)
    table = report.probe_set_table(mdf, n_boot=cfg.n_boot, seed=cfg.seed)
    emerg = report.emergence(table, threshold=cfg.emergence_threshold)
    se = edf[edf["label"].isin([SUPPORTED, NOT_ENTITLED])]
    from lens.stats import auroc

    length_auroc = auroc(se["n_tokens"], se["label"] == SUPPORTED) if se["label"].nunique() == 2 else None
    checks = {}
    if lens is not None and "final_m_E_jacobian" in edf:
        checks["final_layer_jacobian_minus_logit_max_abs"] = float(
            (edf["final_m_E_jacobian"] - edf["final_m_E_logit"]).abs().max())
    summary = {
        "mode": "probes", "model": getattr(model, "name", None), "revision": getattr(model, "revision", None),
        "n_layers": model.n_layers, "lens": _lens_info(lens), "n_examples": len(edf), "skipped": col.skipped,
        "labels": edf["label"].value_counts().to_dict(), "token_sets": token_sets.to_json(),
        "confounds": {"length_auroc_supported_vs_not_entitled": length_auroc}, "checks": checks,
        "emergence": emerg.to_dict(orient="records"), "config": config_dict(cfg),
    }
    notes = [f"model {summary['model']}, {model.n_layers} blocks; lens: "
             f"{'none (logit lens only)' if lens is None else (lens.meta.get('format'), lens.meta.get('n_prompts'))}",
             f"{len(edf)} examples {summary['labels']}; clusters = records",
             f"token sets: |S|={len(token_sets.S)} |N|={len(token_sets.N)} |R|={len(token_sets.R)} ({token_sets.mode})",
             f"length-only AUROC (SUPPORTED vs NOT_ENTITLED): "
             f"{'n/a' if length_auroc is None else f'{length_auroc:.2f}'}"]
    files = report.write_outputs(Path(out_dir), mdf, edf, table, emerg, summary,
                                 title="Entitlement margins (probe set)",
                                 primary_metric="m_E: SUPPORTED vs NOT_ENTITLED", notes=notes)
    summary["files"] = files
    return summary


def read_run(model: LensModel, tokenizer: Any, lens: Any, run_dir: str | Path, token_sets: TokenSets,
             out_dir: str | Path, cfg: ReadConfig | None = None, *, context: str = "compact",
             auditor: str | None = None, pack: TaskPack | None = None) -> dict:
    """Margins of the performer's own rounds and AUROC of internal margin / gap against audit flags. The run
    is read by `lens.runs.load_run_examples` (lhd's Run API; a damaged run is lhd's own error)."""
    import pandas as pd

    from lens import report

    cfg = cfg or ReadConfig()

    def count_tokens(messages: list[dict], answer: str) -> int:
        text = render_chat(tokenizer, messages, add_generation_prompt=True)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"]) + cfg.answer_tokens

    examples, info = load_run_examples(run_dir, context=context, auditor=auditor, pack=pack,
                                       count_tokens=count_tokens, max_length=cfg.max_length,
                                       max_claims=cfg.max_claims)
    if not examples:
        raise LensError(f"{run_dir}: no readable round")
    col = collect(model, tokenizer, examples, _readouts(model, lens), token_sets, cfg)
    rows = list(col.rows)
    if cfg.probe:
        # supervised baseline: predicts the flag itself (classes honest/flagged), grouped by trial;
        # m_E = logit(honest) − logit(flagged), so −m_E is a suspicion score like the lenses'
        rows += probe_rows(col, [False, True], {"S": [False], "N": [True], "R": []}, cfg)
    mdf = pd.DataFrame(rows)
    edf = pd.DataFrame(col.examples)
    table = report.run_table(mdf, edf, n_layers=model.n_layers, band=cfg.band, n_boot=cfg.n_boot, seed=cfg.seed)
    cell = gap_within_stated_supported(mdf, edf, n_layers=model.n_layers, band=cfg.band, n_boot=cfg.n_boot,
                                       seed=cfg.seed)
    if cell:
        table = pd.concat([table, pd.DataFrame(cell)], ignore_index=True)
    emerg = report.emergence(table, threshold=cfg.emergence_threshold)
    lab = edf[edf["label"].notna()]
    from lens.stats import auroc

    length_auroc = auroc(lab["n_tokens"], lab["label"].astype(bool)) if lab["label"].nunique() == 2 else None
    summary = {
        "mode": "run", "run": info, "model": getattr(model, "name", None), "revision": getattr(model, "revision", None),
        "n_layers": model.n_layers, "lens": _lens_info(lens), "n_examples": len(edf), "skipped": col.skipped,
        "token_sets": token_sets.to_json(), "confounds": {"length_auroc_flagged": length_auroc},
        "emergence": emerg.to_dict(orient="records"), "config": config_dict(cfg),
    }
    notes = [f"run {info['run_dir']}: {info['n_examples']} rounds read, {info['n_labelled']} audited, "
             f"{info['n_flagged']} flagged (auditors: {', '.join(info['auditors']) or 'none'}); clusters = trials",
             f"context: {context}; positions: record = files of the task's round-1 message, "
             "question = the task's prompt "
             "(round 1) or the feedback answered, decision = last prompt token, first answer tokens, claim ends; "
             f"task texts: {info.get('tasks_source')}",
             "stated = the model's final-layer m_E at the end of the answer's asserted claims (mean; the decision "
             f"position when an answer has none: {int((edf['stated_position'] == 'decision').sum())} rounds)",
             "scores: higher = more suspicious (internal: −m_E; gap: z(stated) − z(m_E), z on unflagged rounds; "
             "'within stated-supported': only rounds with stated m_E > 0)",
             f"length-only AUROC: {'n/a' if length_auroc is None else f'{length_auroc:.2f}'}"]
    primary = "internal: -m_E vs flagged" if not table.empty else None
    files = report.write_outputs(Path(out_dir), mdf, edf, table, emerg, summary,
                                 title="Entitlement margins (benchmark run)",
                                 primary_metric=primary, notes=notes)
    summary["files"] = files
    return summary
