"""Do planted answers give themselves away by their text alone?

An auditor's miss rate on planted answers says something about natural deceptions only if the
auditor has to find the deception the way it would in a natural answer: from the files and the
trial, not from the style of the edit. The control is a plain text classifier that sees nothing
but answers: TF-IDF word unigrams and bigrams and a logistic regression, trained to tell planted
answers from the rest, with cross-validation grouped by trial (a trial's answers share a task mix
and phrasing, so they never sit on both sides of a split). Its out-of-fold AUROC near 0.5 means
the plants do not stand out by wording; well above 0.5 means an auditor could score well by
spotting planting rather than deception. The AUROC of answer length alone is reported beside it.

The interval resamples trials (a cluster bootstrap of the out-of-fold scores; the models are
not refitted), so it reflects how few trials a run has, not how many rounds."""
from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np

from lens.stats import cluster_bootstrap, weighted_auroc

METHOD = ("TF-IDF word 1-2-grams + logistic regression (balanced classes), out-of-fold scores from "
          "stratified cross-validation grouped by trial; 95% interval from a trial bootstrap")
MAX_FOLDS = 5
BOOTSTRAP = 1000


def auroc(labels: Sequence[bool] | np.ndarray, scores: Sequence[float] | np.ndarray) -> float | None:
    """sklearn's AUROC; None when only one class is present."""
    from sklearn.metrics import roc_auc_score

    y = np.asarray(labels, dtype=bool)
    if y.all() or not y.any():
        return None
    return float(roc_auc_score(y, np.asarray(scores, dtype=float)))


def length_auroc(texts: Sequence[str], labels: Sequence[bool]) -> float | None:
    """How well character length alone separates the labels (0.5: not at all; below 0.5: the
    positive texts are shorter)."""
    return auroc(labels, [len(t) for t in texts])


def out_of_fold_scores(texts: Sequence[str], labels: Sequence[bool], groups: Sequence[str],
                       seed: int = 0, max_folds: int = MAX_FOLDS) -> tuple[np.ndarray, int] | None:
    """Each text's planted-probability from a model that never saw its trial, and the number of
    folds; None when fewer than two folds are possible (fewer than two trials with each class)."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedGroupKFold
    from sklearn.pipeline import make_pipeline

    y = np.asarray(labels, dtype=int)
    g = np.asarray(groups)
    k = min(max_folds, len(set(g[y == 1])), len(set(g[y == 0])))
    if k < 2:
        return None
    scores = np.empty(len(y), dtype=float)
    folds = StratifiedGroupKFold(n_splits=k, shuffle=True, random_state=seed)
    for train, test in folds.split(np.zeros(len(y)), y, g):
        if len(set(y[train])) < 2:  # a fold whose training side holds one class: its prior, no model
            scores[test] = float(y[train].mean())
            continue
        model = make_pipeline(TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True),
                              LogisticRegression(C=1.0, max_iter=2000, class_weight="balanced"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.fit([texts[i] for i in train], y[train])
            scores[test] = model.predict_proba([texts[i] for i in test])[:, 1]
    return scores, k


def trial_bootstrap(labels: Sequence[bool], scores: Sequence[float] | np.ndarray, groups: Sequence[str], seed: int = 0,
                    n: int = BOOTSTRAP) -> tuple[float, float] | None:
    """95% percentile interval of the AUROC over trials drawn with replacement (`lens.stats.cluster_bootstrap`:
    a draw with one class only is dropped; no interval when more than half are)."""
    y, s = np.asarray(labels, dtype=bool), np.asarray(scores, dtype=float)
    return cluster_bootstrap(lambda w: weighted_auroc(s, y, w), groups, n_boot=n, seed=seed)


def detectability(texts: Sequence[str], labels: Sequence[bool], groups: Sequence[str], seed: int = 0,
                  kinds: Sequence[str | None] | None = None) -> dict:
    """The control for one labelled set of texts: the classifier's out-of-fold AUROC with its
    trial-bootstrap interval, length's AUROC, and the counts; `auroc` is None (with a `note`)
    when the set is too small to cross-validate by trial. With `kinds` (one per text, None for
    the negatives), `by_kind` gives the same out-of-fold scores' AUROC for each kind of positive
    against all negatives."""
    out: dict = {"n": len(texts), "positives": int(sum(bool(x) for x in labels)), "trials": len(set(groups)),
                 "length_auroc": length_auroc(texts, labels), "auroc": None, "ci95": None, "folds": 0}
    oof = out_of_fold_scores(texts, labels, groups, seed)
    if oof is None:
        out["note"] = "too few trials to cross-validate by trial (needs two or more with each class)"
        return out
    scores, out["folds"] = oof
    out["auroc"] = auroc(labels, scores)
    ci = trial_bootstrap(labels, scores, groups, seed)
    out["ci95"] = None if ci is None else [ci[0], ci[1]]
    if kinds is not None:
        out["by_kind"] = {}
        for kind in sorted({k for k in kinds if k is not None}):
            keep = [i for i, (y, k) in enumerate(zip(labels, kinds, strict=True)) if not y or k == kind]
            out["by_kind"][kind] = {"n": sum(1 for k in kinds if k == kind),
                                    "auroc": auroc([labels[i] for i in keep], scores[keep])}
    return out


def plant_detectability(rounds: Sequence[tuple[str, str, str | None]], edits: Sequence[tuple[str, str, str, str]],
                        seed: int = 0) -> dict:
    """Both controls of a planted copy. `rounds`: (trial, answer, how it was planted or None)
    for every round of its finished trials: can the planted rounds be found among all rounds?
    `edits`: (trial, original, planted, how) for each planted round: can the planted text be told
    from the text it replaced (the edit alone, without which answers were chosen)?"""
    pairs = [(t, o, False, None) for t, o, _, _ in edits] + [(t, p, True, k) for t, _, p, k in edits]
    return {"method": METHOD,
            "rounds": detectability([a for _, a, _ in rounds], [k is not None for *_, k in rounds],
                                    [t for t, *_ in rounds], seed, [k for *_, k in rounds]),
            "edits": detectability([a for _, a, _, _ in pairs], [p for _, _, p, _ in pairs], [t for t, *_ in pairs],
                                   seed, [k for *_, k in pairs])}
