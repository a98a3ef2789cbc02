"""Next-token KL on held-out text: how close each readout at layer `l` comes to the model's own
next-token distribution, beside the baselines that make that number readable, and whether two
lenses fitted on disjoint halves of the corpus agree (issues 24, 28).

Per layer and readout: `KL(p_final ‖ q_l)` and top-1 agreement pooled over positions
`[skip_first, T)`, the J − logit difference with a bootstrap over texts (the text is the unit),
entropy and current-token diagnostics; even texts calibrate (`lens.calibration`), odd ones are
scored. Split halves compare two lenses. docs/lens.md, "Next-token KL on held-out text"."""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from lens.calibration import even_subsample, fit_temperature, kl_rows, tempered_kl, uniform_kl
from lens.corpus import CorpusSpec, encode_messages, encode_prompt, load_corpus
from lens.errors import LensError
from lens.model import LensModel, block_outputs
from lens.readout import BASELINE, PRIMARY, JacobianLens, Readout
from lens.settings import QualitySettings
from lens.stats import band_layers, ratio_ci
from lens.store import Lens
from lens.tuned import TunedLens

BAND = (0.35, 0.85)  # middle layers, as a fraction of depth (the workspace band of the run reader)


class EvalConfig(QualitySettings):
    max_length: int = 128
    skip_first: int = 16
    chat: bool = False
    force_bos: bool = True
    progress: bool = False
    messages: bool = False  # texts are chat transcripts (the corpus format `messages`), rendered with the template
    layers: list[int] | None = None  # layers read (None: every block); the last block is always read


def fit_texts(lens: Lens | TunedLens) -> list[str] | None:
    """The prompts a lens was fitted on, rebuilt from its sidecar recipe (None when the file changed or is gone).

    A merged lens covers its shards; a shard is credited with the whole prompt list before sharding
    (conservative: its sibling shard's prompts are not held out either)."""
    recipe = lens.meta.corpus
    if not recipe.get("path"):
        return None
    fields = ("path", "format", "text_field", "split", "n_prompts", "min_chars", "chunk_chars", "skip_headers", "chat")
    try:
        texts, now = load_corpus(CorpusSpec(**{k: recipe[k] for k in fields if k in recipe}))
    except (LensError, OSError, TypeError, ValueError):  # ValueError: a recipe the settings refuse
        return None
    return texts if now.get("fingerprint") == recipe.get("fingerprint") else None


def select_held_out(texts: Sequence[str], lenses: Sequence[Lens | TunedLens], n: int | None) -> tuple[list[str], int]:
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
        return float(torch.corrcoef(torch.stack([x.flatten(), y.flatten()]))[0, 1])

    mid = torch.linalg.matrix_norm((A + B) / 2)
    return {"rel_frob": float(torch.linalg.matrix_norm(A - B) / mid) if mid > 0 else float("nan"),
            "corr": corr(A, B), "corr_minus_identity": corr(A - eye, B - eye)}


class _Sums:
    """Per text, in order: sums of each metric keyed by (readout, layer), and position counts.

    Which (readout, layer) pairs exist does not depend on the text, so every list has one entry per text."""

    METRICS = ("kl", "top1", "top5", "top10", "entropy", "current", "uniform", "marginal", "kl_temp")

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


def _diff_ci(a: np.ndarray, b: np.ndarray, n: np.ndarray, n_boot: int, seed: int) -> tuple[float | None, float | None]:
    """95 % percentile interval of the pooled mean of `a − b` over texts resampled with replacement."""
    ci = ratio_ci(a - b, n, n_boot=n_boot, seed=seed) if np.isfinite(a - b).all() else None
    return ci or (None, None)


def _encode(tokenizer: Any, text: str, cfg: EvalConfig) -> torch.Tensor:
    if cfg.messages:
        return encode_messages(tokenizer, text, max_length=cfg.max_length, force_bos=cfg.force_bos)
    return encode_prompt(tokenizer, text, max_length=cfg.max_length, chat=cfg.chat, force_bos=cfg.force_bos)


def _half_readouts(model: LensModel, halves: tuple[Lens, Lens] | None) -> dict[str, Readout]:
    """The split halves as J-lenses keyed `half_a`, `half_b` (read beside the readouts, compared with each other)."""
    if halves is None:
        return {}
    a, b = halves
    if a.source_layers != b.source_layers or a.target_layer != b.target_layer:
        raise LensError(f"the split-half lenses have layers {a.source_layers} -> {a.target_layer} and "
                        f"{b.source_layers} -> {b.target_layer}; fit both halves with the same layers")
    return {"half_a": JacobianLens(model, a), "half_b": JacobianLens(model, b)}


def evaluate(
    model: LensModel,
    tokenizer: Any,
    readouts: Mapping[str, Readout],
    texts: Sequence[str],
    config: EvalConfig | None = None,
    *,
    halves: tuple[Lens, Lens] | None = None,
) -> dict[str, Any]:
    """Per-layer KL to the model's final distribution, top-1/5/10 agreement, the uniform and marginal baselines
    and the temperature-fitted KL of every readout (`lens.readout.build_readouts`), + the split halves."""
    cfg = config or EvalConfig()
    halves_read = _half_readouts(model, halves)
    read = {**readouts, **halves_read}
    L = model.n_layers
    layers = sorted(set(range(L) if cfg.layers is None else cfg.layers) | {L - 1})
    sums, sums_eval = _Sums(), _Sums()
    agree: dict[int, list[float]] = {}
    skipped: list[int] = []
    # calibration half (even positions of the list) first: its positions fit the temperatures and the marginal
    order = list(range(0, len(texts), 2)) + list(range(1, len(texts), 2))
    n_cal_texts = (len(texts) + 1) // 2 if len(texts) >= 2 else len(texts)
    cal_h: dict[int, list[torch.Tensor]] = {}
    marginal_sum: torch.Tensor | None = None
    marginal_n = 0
    temperatures: dict[tuple[str, int], float] = {}
    log_marginal: torch.Tensor | None = None
    for done, i in enumerate(tqdm(order, desc="lens eval", unit="text", disable=not cfg.progress)):
        calibrating = len(texts) >= 2 and done < n_cal_texts
        if len(texts) >= 2 and done == n_cal_texts and marginal_sum is not None:
            temperatures = _fit_temperatures(model, read, cal_h, cfg)
            log_marginal = torch.log((marginal_sum / max(marginal_n, 1)).clamp_min(1e-30))
        ids = _encode(tokenizer, texts[i], cfg)
        if len(ids) <= cfg.skip_first:
            skipped.append(i)
            continue
        sums.n.append(len(ids) - cfg.skip_first)
        evaluating = log_marginal is not None
        if evaluating:
            sums_eval.n.append(len(ids) - cfg.skip_first)
        acts = block_outputs(model, ids[None].to(model.device), layers=layers)
        with torch.no_grad():
            logp = _log_probs(model, acts[L - 1][0, cfg.skip_first:])
            p, top = logp.exp(), logp.argmax(-1)
            current = ids[cfg.skip_first:].to(top.device)  # the input token at each position
            sums.add(("model", L - 1), entropy=-(p * logp).sum(-1), current=top == current, uniform=uniform_kl(logp))
            if calibrating:
                marginal_sum = p.sum(0) if marginal_sum is None else marginal_sum + p.sum(0)
                marginal_n += p.shape[0]
                for layer in layers:
                    cal_h.setdefault(layer, []).append(acts[layer][0, cfg.skip_first:].detach().cpu())
            if log_marginal is not None:
                sums_eval.add(("model", L - 1), uniform=uniform_kl(logp), marginal=kl_rows(logp, log_marginal))
            for layer in layers:
                h = acts[layer][0, cfg.skip_first:]
                tops = {}
                for name, ro in read.items():
                    if not ro.has_layer(layer):
                        continue
                    z = ro.logits(layer, h).float()
                    logq = torch.log_softmax(z, -1)
                    tops[name] = logq.argmax(-1)
                    rank = (logq > logq.gather(-1, top[:, None])).sum(-1) + 1  # of the model's top token
                    kl = kl_rows(logp, logq)
                    sums.add((name, layer), kl=kl, top1=tops[name] == top, top5=rank <= 5, top10=rank <= 10,
                             entropy=-(logq.exp() * logq).sum(-1), current=tops[name] == current)
                    if evaluating and (name, layer) in temperatures:
                        sums_eval.add((name, layer), kl=kl, kl_temp=tempered_kl(logp, z, temperatures[(name, layer)]))
                if halves_read and all(name in tops for name in halves_read):
                    a, b = (tops[name] for name in halves_read)
                    agree.setdefault(layer, []).append(float((a == b).double().sum()))
    if not sums.n:
        raise LensError(f"no held-out text is longer than skip_first={cfg.skip_first} tokens")
    rows = _rows(sums, sums_eval, agree, readouts, temperatures, halves, layers, cfg)
    n_eval = np.asarray(sums_eval.n, dtype=float)
    model_row = {"entropy": _mean(sums.array("entropy", ("model", L - 1)), np.asarray(sums.n, dtype=float)),
                 "current_token": _mean(sums.array("current", ("model", L - 1)), np.asarray(sums.n, dtype=float)),
                 "kl_uniform": _mean(sums.array("uniform", ("model", L - 1)), np.asarray(sums.n, dtype=float)),
                 "kl_uniform_eval": _mean(sums_eval.array("uniform", ("model", L - 1)), n_eval),
                 "kl_marginal_eval": _mean(sums_eval.array("marginal", ("model", L - 1)), n_eval),
                 "vocab": int(model.unembed(torch.zeros(1, model.d_model, device=model.device)).shape[-1])}
    return {"layers": rows, "model": model_row, "n_texts": len(sums.n), "n_positions": int(sum(sums.n)),
            "n_calibration_texts": len(sums.n) - len(sums_eval.n), "n_eval_texts": len(sums_eval.n),
            "n_eval_positions": int(sum(sums_eval.n)), "readouts": list(readouts), "skipped_texts": skipped,
            "summary": summarise(rows, L), "settings": {**cfg.model_dump(), "kl": "KL(p_model || q_lens), nats",
                                                         "positions": "[skip_first, T)", "band": list(BAND),
                                                         "calibration_half": "texts 0, 2, 4, ... of the held-out "
                                                                             "list; evaluation half: 1, 3, 5, ..."}}


def _fit_temperatures(model: LensModel, readouts: Mapping[str, Readout], cal_h: dict[int, list[torch.Tensor]],
                      cfg: EvalConfig) -> dict[tuple[str, int], float]:
    """Per (readout, layer), the temperature fitted on an even subsample of the calibration positions."""
    L = model.n_layers
    final = torch.cat(cal_h[L - 1])
    keep = torch.as_tensor(even_subsample(final.shape[0], cfg.temperature_positions))
    with torch.no_grad():
        logp = _log_probs(model, final[keep].to(model.device))
        out = {}
        for layer in sorted(cal_h):
            h = torch.cat(cal_h[layer])[keep].to(model.device)
            for name, ro in readouts.items():
                if ro.has_layer(layer):
                    out[(name, layer)] = fit_temperature(logp, ro.logits(layer, h).float())
    return out


def _rows(sums: _Sums, sums_eval: _Sums, agree: dict[int, list[float]], readouts: Mapping[str, Readout],
          temperatures: dict[tuple[str, int], float], halves: tuple[Lens, Lens] | None, layers: Sequence[int],
          cfg: EvalConfig) -> list[dict[str, Any]]:
    n = np.asarray(sums.n, dtype=float)
    n_eval = np.asarray(sums_eval.n, dtype=float)
    rows = []
    for layer in layers:
        row: dict[str, Any] = {"layer": layer}
        for name in readouts:
            for metric in ("kl", "top1", "top5", "top10", "entropy", "current"):
                key = "current_token" if metric == "current" else metric
                row[f"{key}_{name}"] = _mean(sums.array(metric, (name, layer)), n)
            row[f"kl_eval_{name}"] = _mean(sums_eval.array("kl", (name, layer)), n_eval) if len(n_eval) else None
            row[f"kl_temp_{name}"] = _mean(sums_eval.array("kl_temp", (name, layer)), n_eval) if len(n_eval) else None
            row[f"temperature_{name}"] = temperatures.get((name, layer))
        if row.get(f"kl_{PRIMARY}") is not None and row.get(f"kl_{BASELINE}") is not None:
            for metric in ("kl", "top1"):  # the headline: the J-lens against the logit lens, paired by text
                a, b = sums.array(metric, (PRIMARY, layer)), sums.array(metric, (BASELINE, layer))
                row[f"{metric}_diff"] = row[f"{metric}_{PRIMARY}"] - row[f"{metric}_{BASELINE}"]
                row[f"{metric}_diff_lo"], row[f"{metric}_diff_hi"] = _diff_ci(a, b, n, cfg.n_boot, cfg.seed)
        if halves is not None and layer in agree:
            for name in ("half_a", "half_b"):
                row[f"kl_{name}"] = _mean(sums.array("kl", (name, layer)), n)
                row[f"top1_{name}"] = _mean(sums.array("top1", (name, layer)), n)
            row["halves_top1_agreement"] = _mean(np.asarray(agree[layer], dtype=float), n)
            if layer in halves[0].J:
                row.update({f"halves_{k}": v for k, v in _matrix_agreement(halves[0].J[layer],
                                                                           halves[1].J[layer]).items()})
        rows.append(row)
    return rows


def summarise(rows: Sequence[dict[str, Any]], n_layers: int) -> dict[str, Any]:
    """Over the middle band: on which fitted layers the primary readout (the J-lens) is closer to the model than
    the baseline (the logit lens)."""
    lo, hi = band_layers(n_layers, BAND)
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
        for metric in ("kl", "top1"):
            for name in (BASELINE, PRIMARY):
                out[f"mean_{metric}_{name}"] = float(np.mean([r[f"{metric}_{name}"] for r in band]))
    return out
