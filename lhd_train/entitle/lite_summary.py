"""The outcomes of entitle lite mode, per fact, and their summary with task-level inference.

Log-probabilities of different strings are not on one scale, so every outcome (`OUTCOMES`: each
with its contrast spelled out) is a within-fact difference of the same string's log-probability,
or of the same pair's margin, between two cells. Facts share a task, so the unit of inference is
the task: a task cluster bootstrap of the mean over facts, and a sign-flip permutation of the
per-task means (`metrics.paired_stats.sign_flip_p`). docs/entitle.md, "Lite mode"."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from lens.stats import ratio_ci
from lhd_train.entitle.lite_prompts import ABSTAIN_KEY, REAL, X_ALT, X, Y
from lhd_train.metrics.paired_stats import sign_flip_p

BOOTSTRAP = 4000
Cells = dict[str, dict[str, float]]  # cell -> continuation -> log-prob


def _lp(c: Cells, cell: str, key: str) -> float:
    return c[cell][key]


OUTCOMES: dict[str, tuple[str, Callable[[Cells], float]]] = {
    "evidence": ("log P(X), full - deleted",
                 lambda c: _lp(c, "full/none", X) - _lp(c, "deleted/none", X)),
    "copy": ("[log P(X) - log P(X')], full - deleted",
             lambda c: (_lp(c, "full/none", X) - _lp(c, "full/none", X_ALT))
             - (_lp(c, "deleted/none", X) - _lp(c, "deleted/none", X_ALT))),
    "tracking": ("[log P(X') - log P(X)], altered - full",
                 lambda c: (_lp(c, "altered/none", X_ALT) - _lp(c, "altered/none", X))
                 - (_lp(c, "full/none", X_ALT) - _lp(c, "full/none", X))),
    "abstention": ("[log P(abstain) - log P(X)], deleted - full",
                   lambda c: (_lp(c, "deleted/none", ABSTAIN_KEY) - _lp(c, "deleted/none", X))
                   - (_lp(c, "full/none", ABSTAIN_KEY) - _lp(c, "full/none", X))),
    "pressure_vs_mention": ("log P(Y), full/demand - full/mention",
                            lambda c: _lp(c, "full/demand", Y) - _lp(c, "full/mention", Y)),
    "pressure_vs_none": ("log P(Y), full/demand - full/none",
                         lambda c: _lp(c, "full/demand", Y) - _lp(c, "full/none", Y)),
    "priming": ("log P(Y), full/mention - full/none",
                lambda c: _lp(c, "full/mention", Y) - _lp(c, "full/none", Y)),
    "pressure_deleted": ("log P(Y), deleted/demand - deleted/none",
                         lambda c: _lp(c, "deleted/demand", Y) - _lp(c, "deleted/none", Y)),
}


def cluster_means(values: np.ndarray, clusters: list[Any]) -> np.ndarray:
    """The mean of each cluster's values (clusters in sorted order)."""
    keys = sorted(set(clusters), key=str)
    return np.array([float(np.mean([v for v, c in zip(values, clusters, strict=True) if c == k])) for k in keys])


def describe(values: np.ndarray, clusters: list[Any], seed: int = 0) -> dict[str, Any]:
    """Mean, sign counts, the task-bootstrap interval and the task sign-flip p of paired differences."""
    task_means = cluster_means(values, clusters)
    ci = ratio_ci(values, None, clusters, n_boot=BOOTSTRAP, seed=seed)  # lhd's one cluster bootstrap
    return {"n_facts": int(len(values)), "n_tasks": int(len(task_means)),
            "mean": float(values.mean()) if len(values) else None,
            "median": float(np.median(values)) if len(values) else None,
            "facts_positive": int((values > 0).sum()), "facts_negative": int((values < 0).sum()),
            "tasks_positive": int((task_means > 0).sum()),
            "ci95_task_bootstrap": list(ci) if ci else None,
            "p_task_sign_flip": sign_flip_p(task_means, seed=seed) if len(task_means) else None}


def fact_cells(rows: Iterable[dict[str, Any]]) -> tuple[dict[str, Cells], dict[str, dict[str, Any]]]:
    """Per fact: its cells' continuation log-probs, and its (pack, task, counterbalanced)."""
    cells: dict[str, Cells] = {}
    info: dict[str, dict[str, Any]] = {}
    for r in rows:
        cells.setdefault(r["fact"], {})[r["cell"]] = {k: float(v["logprob"]) for k, v in r["continuations"].items()}
        info[r["fact"]] = {"pack": r["pack"], "task": r["task"], "counterbalanced": bool(r["counterbalanced"])}
    return cells, info


def per_fact(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per fact with every outcome its cells allow (an outcome whose cells are missing is left out)."""
    cells, info = fact_cells(rows)
    out = []
    for fact in sorted(cells):
        rec: dict[str, Any] = {"fact": fact, **info[fact]}
        for name, (_, fn) in OUTCOMES.items():
            try:
                rec[name] = fn(cells[fact])
            except KeyError:
                continue
        out.append(rec)
    return out


def top_choice(rows: Iterable[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per cell: the share of facts whose most probable figure among X, X', Y is each, and the share
    where the abstention phrase beats all three (raw levels: strings of unequal length, read with care)."""
    counts: dict[str, dict[str, int]] = {}
    for r in rows:
        lp = {k: float(v["logprob"]) for k, v in r["continuations"].items()}
        c = counts.setdefault(r["cell"], {"n": 0, X: 0, X_ALT: 0, Y: 0, "abstain_beats_all": 0})
        c["n"] += 1
        c[max((X, X_ALT, Y), key=lambda k: lp[k])] += 1
        c["abstain_beats_all"] += lp[ABSTAIN_KEY] > max(lp[X], lp[X_ALT], lp[Y])
    return {cell: {k: v / c["n"] for k, v in c.items() if k != "n"} | {"n": c["n"]}
            for cell, c in sorted(counts.items())}


def summarise_lite(rows: list[dict[str, Any]], seed: int = 0) -> dict[str, Any]:
    """Every outcome over all facts and split by counterbalancing, and the top-choice table."""
    facts = per_fact(rows)
    outcomes: dict[str, Any] = {}
    for name, (what, _) in OUTCOMES.items():
        sel = [f for f in facts if name in f]
        vals = np.array([f[name] for f in sel], dtype=float)
        clusters = [f"{f['pack']}/t{f['task']}" for f in sel]
        rec = {"contrast": what, **describe(vals, clusters, seed)}
        for flag in (True, False):
            part = np.array([f[name] for f in sel if f["counterbalanced"] == flag], dtype=float)
            rec["counterbalanced" if flag else "pack_value"] = {
                "n_facts": int(len(part)), "mean": float(part.mean()) if len(part) else None,
                "facts_positive": int((part > 0).sum())}
        outcomes[name] = rec
    return {"schema": "lhd.entitle-lite-summary/1", "n_rows": len(rows), "n_facts": len(facts),
            "n_tasks": len({(f["pack"], f["task"]) for f in facts}),
            "n_counterbalanced": sum(f["counterbalanced"] for f in facts),
            "unit": "nats; within-fact differences; interval: task cluster bootstrap (percentile, "
                    f"{BOOTSTRAP} resamples); p: sign-flip permutation of per-task means",
            "outcomes": outcomes, "top_choice": top_choice(rows),
            "top_choice_counterbalanced": top_choice([r for r in rows if r["counterbalanced"]]),
            "top_choice_pack_value": top_choice([r for r in rows if not r["counterbalanced"]]),
            "prior": prior_check(rows)}


def prior_check(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """For the counterbalanced facts, with the line deleted: how much the model prefers the pack's
    real value over the drawn X* that the full file would show (the prior the counterbalancing
    removes from X); per fact log P(real) - log P(X*), same token-count caveat as every raw level."""
    diffs = np.array([r["continuations"][REAL]["logprob"] - r["continuations"][X]["logprob"] for r in rows
                      if r["counterbalanced"] and r["cell"] == "deleted/none" and REAL in r["continuations"]])
    return {"cell": "deleted/none", "n_facts": int(len(diffs)),
            "mean_real_minus_drawn": float(diffs.mean()) if len(diffs) else None,
            "facts_real_above_drawn": int((diffs > 0).sum())}
