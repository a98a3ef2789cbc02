"""Lens fidelity on held-out text: how close each readout at layer `l` comes to the model's own
next-token distribution, and whether two lenses fitted on disjoint halves of the corpus agree
(docs/lens.md, "Fidelity"; issue 24 item 4).

Per held-out text (token ids `[T]`, positions `P = [skip_first, T)`), per layer `l` and readout `r`:

    KL_l^r = mean_{t in P} KL(p_final[t] || q_l^r[t])   (nats; p = the model's own softmax)
    top1_l^r = mean_{t in P} [argmax q_l^r[t] == argmax p_final[t]]

with `q^logit = softmax(W_U norm(h_l))` and `q^jacobian = softmax(W_U norm(J_l h_l))`. Means are
pooled over all positions of all texts; the difference jacobian − logit gets a 95 % percentile
interval from a bootstrap over texts (a text is the unit: its positions are not independent).
Two diagnostics say why a readout is far from the model: its mean entropy (an over-confident
readout has a high KL), and how often its top token is the *input* token at `t` rather than a
prediction of the next one.

Split halves (two lenses A, B fitted on disjoint prompts, e.g. `lhd lens fit --shard 0/2` and
`1/2`): per layer `‖J_A − J_B‖_F / ‖(J_A + J_B)/2‖_F`, the Pearson correlation of their entries
and of `J − I` (the part that makes them differ from the logit lens), and on the held-out
positions the share where their top-1 tokens agree, plus each half's own KL. When the halves
agree about as well as each half agrees with the model, the corpus is big enough for this use.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from lens.corpus import CorpusSpec, encode_prompt, load_corpus
from lens.errors import LensError
from lens.model import LensModel, block_outputs
from lens.readout import JacobianLens, LogitLens
from lens.store import Lens

BAND = (0.35, 0.85)  # middle layers, as a fraction of depth (the workspace band of lens.read)


@dataclass
class EvalConfig:
    max_length: int = 128
    skip_first: int = 16
    chat: bool = False
    force_bos: bool = True
    n_boot: int = 1000
    seed: int = 0
    progress: bool = False


def fit_texts(lens: Lens) -> list[str] | None:
    """The prompts a lens was fitted on, rebuilt from its sidecar recipe (None when the file changed or is gone).

    A merged lens covers its shards; a shard is credited with the whole prompt list before sharding
    (conservative: its sibling shard's prompts are not held out either)."""
    recipe = lens.meta.get("corpus")
    if not isinstance(recipe, dict) or not recipe.get("path"):
        return None
    fields = ("path", "format", "text_field", "split", "n_prompts", "min_chars", "chunk_chars", "skip_headers", "chat")
    try:
        texts, now = load_corpus(CorpusSpec(**{k: recipe[k] for k in fields if k in recipe}))
    except (LensError, OSError, TypeError):
        return None
    return texts if now.get("fingerprint") == recipe.get("fingerprint") else None


def select_held_out(texts: Sequence[str], lenses: Sequence[Lens], n: int | None) -> tuple[list[str], int]:
    """The first `n` texts that none of the lenses was fitted on, and how many were excluded as fit texts."""
    seen: set[str] = set()
    for lz in lenses:
        seen.update(fit_texts(lz) or ())
    keep = [t for t in texts if t not in seen]
    excluded = len(texts) - len(keep)
    if not keep:
        raise LensError(f"no held-out text: all {len(texts)} corpus texts were used to fit the lens; give texts it "
                        "did not see (another --corpus, or fit on fewer --n-prompts)")
    return (keep if n is None else keep[:n]), excluded


def _log_probs(model: LensModel, h: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(model.unembed(h).float(), dim=-1)


def _matrix_agreement(A: torch.Tensor, B: torch.Tensor) -> dict[str, float]:
    A, B = A.double(), B.double()
    eye = torch.eye(A.shape[-1], dtype=A.dtype) if A.shape[0] == A.shape[1] else torch.zeros_like(A)

    def corr(x: torch.Tensor, y: torch.Tensor) -> float:
        x, y = x.flatten() - x.mean(), y.flatten() - y.mean()
        den = float(x.norm() * y.norm())
        return float((x @ y) / den) if den > 0 else float("nan")

    mid = torch.linalg.matrix_norm((A + B) / 2)
    return {"rel_frob": float(torch.linalg.matrix_norm(A - B) / mid) if mid > 0 else float("nan"),
            "corr": corr(A, B), "corr_minus_identity": corr(A - eye, B - eye)}


class _Sums:
    """Per text, in order: sums of each metric keyed by (readout, layer), and position counts.

    Which (readout, layer) pairs exist does not depend on the text, so every list has one entry per text."""

    METRICS = ("kl", "top1", "entropy", "current")

    def __init__(self) -> None:
        self.sums: dict[str, dict[tuple[str, int], list[float]]] = {m: {} for m in self.METRICS}
        self.n: list[int] = []

    def add(self, key: tuple[str, int], **values: torch.Tensor) -> None:
        for metric, v in values.items():
            self.sums[metric].setdefault(key, []).append(float(v.double().sum()))

    def array(self, metric: str, key: tuple[str, int]) -> np.ndarray:
        return np.asarray(self.sums[metric].get(key, [math.nan] * len(self.n)), dtype=float)


def _mean(s: np.ndarray, n: np.ndarray) -> float | None:
    return float(s.sum() / n.sum()) if np.isfinite(s).all() and n.sum() > 0 else None


def _diff_ci(a: np.ndarray, b: np.ndarray, n: np.ndarray, weights: np.ndarray) -> tuple[float | None, float | None]:
    """95 % percentile interval of the pooled mean of `a − b` over texts resampled with replacement."""
    if not (np.isfinite(a).all() and np.isfinite(b).all()) or len(n) < 2:
        return None, None
    boot = (weights @ (a - b)) / np.maximum(weights @ n, 1e-12)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return float(lo), float(hi)


def evaluate(
    model: LensModel,
    tokenizer: Any,
    lens: Lens,
    texts: Sequence[str],
    config: EvalConfig | None = None,
    *,
    halves: tuple[Lens, Lens] | None = None,
) -> dict[str, Any]:
    """Per-layer KL to the model's final distribution and top-1 agreement, logit vs Jacobian lens (+ halves)."""
    cfg = config or EvalConfig()
    readouts: dict[str, Any] = {"logit": LogitLens(model), "jacobian": JacobianLens(model, lens)}
    if halves is not None:
        for name, half in zip(("half_a", "half_b"), halves, strict=True):
            if half.source_layers != lens.source_layers or half.target_layer != lens.target_layer:
                raise LensError(f"split-half lens {name} has layers {half.source_layers} -> {half.target_layer}; the "
                                f"lens has {lens.source_layers} -> {lens.target_layer} (fit both halves like the lens)")
            readouts[name] = JacobianLens(model, half)
    L = model.n_layers
    sums = _Sums()
    agree: dict[int, list[float]] = {}
    skipped: list[int] = []
    for i, text in enumerate(tqdm(texts, desc="lens eval", unit="text", disable=not cfg.progress)):
        ids = encode_prompt(tokenizer, text, max_length=cfg.max_length, chat=cfg.chat, force_bos=cfg.force_bos)
        if len(ids) <= cfg.skip_first:
            skipped.append(i)
            continue
        sums.n.append(len(ids) - cfg.skip_first)
        acts = block_outputs(model, ids[None].to(model.device))
        with torch.no_grad():
            logp = _log_probs(model, acts[L - 1][0, cfg.skip_first:])
            p, top = logp.exp(), logp.argmax(-1)
            current = ids[cfg.skip_first:].to(top.device)  # the input token at each position
            sums.add(("model", L - 1), entropy=-(p * logp).sum(-1), current=top == current)
            for layer in range(L):
                h = acts[layer][0, cfg.skip_first:]
                tops = {}
                for name, ro in readouts.items():
                    if name != "logit" and not ro.has_layer(layer):
                        continue
                    logq = _log_probs(model, ro.transport(layer, h) if name != "logit" else h)
                    tops[name] = logq.argmax(-1)
                    sums.add((name, layer), kl=(p * (logp - logq)).sum(-1), top1=tops[name] == top,
                             entropy=-(logq.exp() * logq).sum(-1), current=tops[name] == current)
                if "half_a" in tops and "half_b" in tops:
                    agree.setdefault(layer, []).append(float((tops["half_a"] == tops["half_b"]).double().sum()))
    if not sums.n:
        raise LensError(f"no held-out text is longer than skip_first={cfg.skip_first} tokens")
    n_texts = len(sums.n)
    rng = np.random.default_rng(cfg.seed)
    weights = rng.multinomial(n_texts, np.full(n_texts, 1.0 / n_texts), size=cfg.n_boot).astype(float)
    rows = []
    n = np.asarray(sums.n, dtype=float)
    for layer in range(L):
        kl_l, hit_l = sums.array("kl", ("logit", layer)), sums.array("top1", ("logit", layer))
        kl_j, hit_j = sums.array("kl", ("jacobian", layer)), sums.array("top1", ("jacobian", layer))
        row: dict[str, Any] = {"layer": layer, "kl_logit": _mean(kl_l, n), "top1_logit": _mean(hit_l, n),
                               "kl_jacobian": _mean(kl_j, n), "top1_jacobian": _mean(hit_j, n)}
        for name in ("logit", "jacobian"):  # diagnostics: how sharp the readout is; does it name the input token?
            row[f"entropy_{name}"] = _mean(sums.array("entropy", (name, layer)), n)
            row[f"current_token_{name}"] = _mean(sums.array("current", (name, layer)), n)
        if row["kl_jacobian"] is not None:
            row["kl_diff"] = row["kl_jacobian"] - row["kl_logit"]
            row["kl_diff_lo"], row["kl_diff_hi"] = _diff_ci(kl_j, kl_l, n, weights)
            row["top1_diff"] = row["top1_jacobian"] - row["top1_logit"]
            row["top1_diff_lo"], row["top1_diff_hi"] = _diff_ci(hit_j, hit_l, n, weights)
        if halves is not None and layer in agree:
            for name in ("half_a", "half_b"):
                row[f"kl_{name}"] = _mean(sums.array("kl", (name, layer)), n)
                row[f"top1_{name}"] = _mean(sums.array("top1", (name, layer)), n)
            row["halves_top1_agreement"] = _mean(np.asarray(agree[layer], dtype=float), n)
            if layer in halves[0].J:
                row.update({f"halves_{k}": v for k, v in _matrix_agreement(halves[0].J[layer],
                                                                           halves[1].J[layer]).items()})
        rows.append(row)
    model_row = {"entropy": _mean(sums.array("entropy", ("model", L - 1)), n),
                 "current_token": _mean(sums.array("current", ("model", L - 1)), n)}
    return {"layers": rows, "model": model_row, "n_texts": n_texts, "n_positions": int(sum(sums.n)),
            "skipped_texts": skipped,
            "summary": summarise(rows, L), "settings": {**cfg.__dict__, "kl": "KL(p_model || q_lens), nats",
                                                         "positions": "[skip_first, T)", "band": list(BAND)}}


def summarise(rows: Sequence[dict[str, Any]], n_layers: int) -> dict[str, Any]:
    """Over the middle band: on which fitted layers the Jacobian lens is closer to the model than the logit lens."""
    lo, hi = int(math.floor(BAND[0] * (n_layers - 1))), int(math.ceil(BAND[1] * (n_layers - 1)))
    band = [r for r in rows if lo <= r["layer"] <= hi and r.get("kl_diff_lo") is not None]

    def which(cond: Callable[[dict[str, Any]], bool]) -> list[int]:
        return [r["layer"] for r in band if cond(r)]

    out: dict[str, Any] = {
        "band_layers": [lo, hi],
        "layers_compared": [r["layer"] for r in band],
        "jacobian_lower_kl": which(lambda r: r["kl_diff_hi"] < 0),
        "jacobian_higher_kl": which(lambda r: r["kl_diff_lo"] > 0),
        "jacobian_higher_top1": which(lambda r: r["top1_diff_lo"] > 0),
        "jacobian_lower_top1": which(lambda r: r["top1_diff_hi"] < 0),
    }
    if band:
        out["mean_kl_logit"] = float(np.mean([r["kl_logit"] for r in band]))
        out["mean_kl_jacobian"] = float(np.mean([r["kl_jacobian"] for r in band]))
        out["mean_top1_logit"] = float(np.mean([r["top1_logit"] for r in band]))
        out["mean_top1_jacobian"] = float(np.mean([r["top1_jacobian"] for r in band]))
    return out
