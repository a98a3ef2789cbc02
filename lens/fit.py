"""Fitting the Jacobian lens `J_l = E[∂h_final/∂h_l]` (docs/lens-background.md §1).

Per prompt (`lens.jacobian.prompt_jacobian`; token ids `[T]`, valid positions `V = [skip_first, T-1)`):

    J_l^(p) = mean_{t in V} sum_{t' in V, t' >= t} ∂h_final[t'] / ∂h_l[t]

or, with `estimator="self"` / `"future"`, its self-only term `t' = t` / the rest, from random
signs at the cost of the standard fit (each prompt's signs are seeded by `sign_seed` and its text).

The corpus estimate is the plain mean over prompts, accumulated as two fp32 running sums
(even / odd prompts), which gives the split-half agreement for free. The sums live in host
memory whatever the model's device (for an 8B model they are 3.9 GiB that the GPU needs for
activations); each prompt's estimate is copied over once, through a pinned buffer on CUDA, and added
in a worker thread while the GPU computes the next prompt (`lens.accumulate`).
Checkpoints hold both sums (exact resume), so they are written by wall time (every 30 minutes by
default) rather than every few prompts, and atomically; a resume refuses different settings.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from lens.accumulate import SUMS_DEVICE, Accumulator, _identity_distance, _State  # noqa: F401 (SUMS_DEVICE: re-exported)
from lens.checkpoint import checkpoint_due, incomplete, load_checkpoint, save_checkpoint
from lens.corpus import encode_prompt
from lens.errors import LensError
from lens.files import atomic_write_text, sha256_text, write_csv
from lens.jacobian import prompt_jacobian, random_signs
from lens.model import LensModel, normalise_layer
from lens.plan import DEFAULT_DIM_BATCH
from lens.record import LensMeta
from lens.settings import FitOptions, FitSettings, parse_layers
from lens.store import Lens

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"
REPORT = "fit_report.json"
CONVERGENCE = "convergence.csv"


def resolve_layers(
    n_layers: int, source_layers: Sequence[int] | None, target_layer: int = -1, *, allow_target: bool = False
) -> tuple[list[int], int]:
    """Normalise the target (negative = from the end) and the sources (default: every block below it)."""
    target = normalise_layer(int(target_layer), n_layers, "target layer")
    if source_layers is None:
        sources = list(range(target))
    else:
        sources = sorted({normalise_layer(int(layer), n_layers, "source layer") for layer in source_layers})
    if not sources:
        raise LensError(f"no source layer below target layer {target}")
    bad = [layer for layer in sources if layer > target or (layer == target and not allow_target)]
    if bad:
        raise LensError(f"source layers {bad} are not below the target layer {target}")
    return sources, target


@dataclass
class FitResult:
    lens: Lens
    report: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)


def _now() -> float:
    """Wall clock of the checkpoint cadence (a function, so a test can move time on)."""
    return time.monotonic()


def _save_checkpoint(path: Path, state: _State, settings: dict) -> None:
    save_checkpoint(path, state.to_dict(), settings)


def _load_checkpoint(path: Path, settings: dict) -> _State:
    obj = load_checkpoint(path, settings, job="fit")
    try:
        return _State.from_dict(obj)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise incomplete(path, exc, job="fit") from None


def fit_lens(
    model: LensModel,
    tokenizer: Any,
    prompts: Sequence[str],
    settings: FitSettings | None = None,
    *,
    out_dir: str | Path | None = None,
    options: FitOptions | None = None,
    meta: dict[str, Any] | None = None,
    directions: torch.Tensor | None = None,
    allow_target_source: bool = False,
) -> FitResult:
    """Mean of `J^(p)` over prompts; checkpoints/resume in `out_dir` if given. Does not write the lens itself."""
    settings = settings or FitSettings()
    dim_batch = settings.dim_batch or DEFAULT_DIM_BATCH
    options = options or FitOptions()
    sources, target = resolve_layers(
        model.n_layers, parse_layers(settings.source_layers), settings.target_layer, allow_target=allow_target_source
    )
    meta = dict(meta or {})
    d = model.d_model
    k = d if directions is None else int(directions.shape[0])
    compared = {
        "model_id": meta.get("model_id", getattr(model, "name", None)),
        "n_layers": model.n_layers,
        "d_model": d,
        "source_layers": sources,
        "target_layer": target,
        "skip_first": settings.skip_first,
        "max_length": settings.max_length,
        "chat": settings.chat,
        "force_bos": settings.force_bos,
        # only when not the default, so a checkpoint written before estimators existed still resumes
        **({"estimator": settings.estimator, "sign_seed": settings.sign_seed} if settings.estimator != "all" else {}),
        "prompts_sha256": sha256_text("".join(f"{p}\0" for p in prompts)),  # the digest old checkpoints hold
        "n_prompts_total": len(prompts),
        "directions_sha256": None if directions is None else hashlib.sha256(
            directions.detach().float().cpu().numpy().tobytes()).hexdigest(),
        # what is behind model_id now: weights, tokenizer, chat template, config (`weights_fingerprint`)
        "model_files": (meta.get("model_files") or {}).get("parts"),
    }
    ckpt = Path(out_dir) / CHECKPOINT if out_dir is not None else None
    if ckpt is not None and ckpt.exists() and options.resume:
        state = _load_checkpoint(ckpt, compared)
        log.info("resuming from %s: %d prompts done, next index %d", ckpt, state.n, state.next_idx)
    else:
        state = _State(len(sources), k, d)

    new_done = 0
    started = time.perf_counter()
    last_ckpt, since_ckpt = _now(), 0
    bar = tqdm(total=len(prompts), initial=state.next_idx, desc="fit J-lens", unit="prompt",
               disable=not options.progress, dynamic_ncols=True)
    overlap = options.overlap_sums if options.overlap_sums is not None else torch.device(model.device).type == "cuda"
    acc = Accumulator(state, options.stop_at_delta, options.min_prompts, overlap)
    try:
        while state.next_idx < len(prompts) and not state.stopped_early:
            idx = state.next_idx
            ids = encode_prompt(tokenizer, prompts[idx], max_length=settings.max_length, chat=settings.chat,
                                force_bos=settings.force_bos)
            t0 = time.perf_counter()
            try:
                Jp = prompt_jacobian(model, ids, source_layers=sources, target_layer=target,
                                     skip_first=settings.skip_first, dim_batch=dim_batch,
                                     directions=directions, method=settings.method, estimator=settings.estimator,
                                     signs=None if settings.estimator == "all"
                                     else random_signs(len(ids), settings.sign_seed, prompts[idx]))
            except LensError as exc:
                if "too short" not in str(exc):
                    raise
                log.warning("prompt %d skipped: %s", idx, exc)
                state.skipped.append(idx)
                state.next_idx += 1
                bar.update(1)
                continue
            if not acc.add(Jp, idx, len(ids), time.perf_counter() - t0):
                break  # the prompts before this one made the early stop due: it is not added
            state.next_idx += 1
            new_done += 1
            since_ckpt += 1
            bar.update(1)
            if state.history:
                bar.set_postfix(delta=f"{state.history[-1]['delta_mean']:.2e}")
            if ckpt is not None and checkpoint_due(options.checkpoint_every, options.checkpoint_minutes, since_ckpt,
                                                   _now() - last_ckpt):
                acc.wait()
                _save_checkpoint(ckpt, state, compared)
                last_ckpt, since_ckpt = _now(), 0
            if options.stop_after is not None and new_done >= options.stop_after:
                break
    finally:
        bar.close()
        acc.close()
    if state.stopped_early:
        log.info("early stop after %d prompts (mean Δ of last 10 < %g)", state.n, options.stop_at_delta)
    if ckpt is not None:
        _save_checkpoint(ckpt, state, compared)
    if state.n == 0:
        raise LensError(f"no usable prompt: all {len(state.skipped)} were too short for "
                        f"skip_first={settings.skip_first}")

    total = (state.sum_a + state.sum_b) / state.n
    J = {layer: total[i].cpu() for i, layer in enumerate(sources)}
    elapsed = time.perf_counter() - started
    report = _report(state, sources, elapsed, new_done)
    shared = ("model_id", "n_layers", "d_model", "source_layers", "target_layer", "skip_first", "max_length",
              "chat", "force_bos")
    lens_meta = {
        **meta,
        **{key: compared[key] for key in shared},  # the same settings resume is checked against
        "n_prompts": state.n,
        "estimator": settings.estimator,
        **({"sign_seed": settings.sign_seed} if settings.estimator != "all" else {}),
        "fit": {"dim_batch": dim_batch, "method": settings.method, "complete": state.next_idx >= len(prompts)
                or state.stopped_early, "stopped_early": state.stopped_early},
        "directions": None if directions is None else meta.get("directions", "custom"),
    }
    return FitResult(lens=Lens(J=J, meta=LensMeta.model_validate(lens_meta)), report=report, history=state.history)


def _report(state: _State, sources: list[int], elapsed: float, new_done: int) -> dict[str, Any]:
    total = state.sum_a + state.sum_b
    mean = total / max(state.n, 1)
    deltas = [h["delta_mean"] for h in state.history if not math.isnan(h["delta_mean"])]
    crossings = {}
    for thr in (1e-2, 5e-3, 1e-3):
        hit = next((h["n"] for h in state.history if not math.isnan(h["delta_mean"]) and h["delta_mean"] < thr), None)
        crossings[f"{thr:g}"] = hit
    split = {}
    if state.n_a > 0 and state.n_b > 0:
        A, Bm = state.sum_a / state.n_a, state.sum_b / state.n_b
        num = torch.linalg.matrix_norm(A - Bm)
        den = torch.linalg.matrix_norm((A + Bm) / 2).clamp_min(1e-30)
        split = {str(layer): float(v) for layer, v in zip(sources, (num / den).cpu(), strict=True)}
    secs = [h["seconds"] for h in state.history]
    return {
        "n_prompts": state.n,
        "n_skipped": len(state.skipped),
        "skipped_indices": state.skipped,
        "n_half": [state.n_a, state.n_b],
        "stopped_early": state.stopped_early,
        "seconds_this_run": elapsed,
        "prompts_this_run": new_done,
        "seconds_per_prompt": (sum(secs) / len(secs)) if secs else None,
        "delta_mean_last": deltas[-1] if deltas else None,
        "delta_mean_last10": (sum(deltas[-10:]) / len(deltas[-10:])) if deltas else None,
        "delta_first_below": crossings,
        "identity_distance": {str(layer): _identity_distance(mean[i]) for i, layer in enumerate(sources)},
        "split_half_rel_diff": split,
        "source_layers": sources,
    }


def write_fit_outputs(result: FitResult, out_dir: str | Path) -> None:
    """`fit_report.json` and `convergence.csv` next to the lens."""
    out = Path(out_dir)
    import pandas as pd

    atomic_write_text(out / REPORT, json.dumps(result.report, indent=2) + "\n")
    cols = ["prompt_index", "n", "n_tokens", "delta_mean", "delta_max", "jnorm_max", "identity_distance_deepest",
            "seconds"]
    write_csv(pd.DataFrame(result.history, columns=cols), out / CONVERGENCE)
