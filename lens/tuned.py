"""A tuned lens (Belrose et al. 2023): per layer an affine translator `h + A_l h + b_l`, trained so that
the model's own final norm and unembedding, reading the translated residual, give the model's
next-token distribution (KL to the last block's softmax, the tuned lens's objective).

It is the J-lens release's third baseline: by design the best next-token reader of the three, and,
the paper reports, the worst at recovering unverbalised intermediates, because it learns to skip
ahead to the output. Read here beside the others as the `tuned` readout (`lens.readout`).

The translators start at zero (the logit lens) and are trained jointly, one loss per layer summed,
by Adam on tokens drawn from block outputs captured once; a share of the prompts is held back and
scored before and after, so the fit reports what it gained on text it did not train on. On disk:
`<dir>/tuned.safetensors` (`A.<l>`, `b.<l>`, fp32) and `<dir>/tuned.json` (`TunedRecord`), whose
`corpus` recipe lets `lhd lens eval --corpus` leave the fit's texts out, as it does for a J-lens.

Training an 8B model's translators takes a while, so `<dir>/tune_checkpoint.pt` holds the translators,
Adam's moments, the schedule and the draw generator (every `checkpoint_minutes`): a killed run resumes
from it and ends with the same translators as a run that was never stopped.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from tqdm.auto import tqdm

from lens.checkpoint import checkpoint_due, incomplete, load_checkpoint, save_checkpoint
from lens.corpus import encode_prompt
from lens.errors import LensError, record_error
from lens.files import atomic_write, atomic_write_text, sha256_file, sha256_text, utc_now
from lens.model import LensModel, block_outputs, normalise_layer
from lens.settings import TuneOptions, TuneSettings, parse_layers

log = logging.getLogger(__name__)

WEIGHTS = "tuned.safetensors"
SIDECAR = "tuned.json"
CHECKPOINT = "tune_checkpoint.pt"
FORMAT = "lhd.tunedlens/1"


class TunedMeta(BaseModel):
    """What a tuned lens knows about itself: the model, the prompts and how it was trained."""

    model_config = ConfigDict(strict=True, extra="allow")

    format: str | None = None
    model_id: str | None = None
    revision: str | None = None
    n_layers: int | None = None
    d_model: int | None = None
    layers: list[int] = Field(default_factory=list)
    max_length: int | None = None
    skip_first: int | None = None
    chat: bool = False
    force_bos: bool = True
    corpus: dict[str, Any] = Field(default_factory=dict)  # `lens.corpus.load_corpus`'s recipe
    n_prompts: int = 0  # prompts trained on (the held-back ones not counted)
    n_tokens: int = 0  # positions trained on
    n_val_prompts: int = 0
    training: dict[str, Any] = Field(default_factory=dict)  # steps, batch_tokens, lr, seed, seconds
    kl_val_before: dict[str, float] = Field(default_factory=dict)  # per layer, the logit lens (zero translator)
    kl_val_after: dict[str, float] = Field(default_factory=dict)  # per layer, the trained translator
    file: str | None = None
    sha256: str | None = None

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_unset=True)


class TunedRecord(TunedMeta):
    """tuned.json: the fields `save_tuned_lens` always writes are required."""

    format: Literal["lhd.tunedlens/1"]
    layers: list[int]
    d_model: int
    file: str
    sha256: str
    saved_at: str


@dataclass
class TunedLens:
    """`A[l]` (`d×d`) and `b[l]` (`d`) per layer, fp32 on the CPU; the translator is `h + A h + b`."""

    A: dict[int, torch.Tensor]
    b: dict[int, torch.Tensor]
    meta: TunedMeta = field(default_factory=TunedMeta)

    @property
    def layers(self) -> list[int]:
        return sorted(self.A)

    @property
    def d_model(self) -> int:
        return int(next(iter(self.A.values())).shape[-1])

    def translate(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        A, b = self.A[layer].to(h.device, torch.float32), self.b[layer].to(h.device, torch.float32)
        x = h.to(torch.float32)
        return (x + x @ A.T + b).to(h.dtype)


def _states(model: LensModel, tokenizer: Any, texts: Sequence[str], layers: list[int],
            s: TuneSettings) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """Block outputs `[N, d]` at `layers` and at the last block, positions `[skip_first, T)` of every text."""
    last = model.n_layers - 1
    per: dict[int, list[torch.Tensor]] = {layer: [] for layer in [*layers, last]}
    for text in texts:
        ids = encode_prompt(tokenizer, text, max_length=s.max_length, chat=s.chat, force_bos=s.force_bos)
        if len(ids) <= s.skip_first:
            continue
        acts = block_outputs(model, ids[None].to(model.device), layers=[*layers, last])
        for layer in per:
            per[layer].append(acts[layer][0, s.skip_first:].detach().to(torch.float32).cpu())
    if not per[last]:
        raise LensError(f"no prompt is longer than skip_first={s.skip_first} tokens")
    stacked = {layer: torch.cat(hs) for layer, hs in per.items()}
    return {layer: stacked[layer] for layer in layers}, stacked[last]


def _log_probs(model: LensModel, h: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(model.unembed(h.to(model.device, model.dtype)).float(), dim=-1)


def _kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Mean over rows of `KL(p ‖ q)` in nats."""
    return (logp.exp() * (logp - logq)).sum(-1).mean()


def _val_kl(model: LensModel, lens: TunedLens, H: dict[int, torch.Tensor], last: torch.Tensor,
            chunk: int = 256) -> dict[str, float]:
    """Per layer, the mean KL of the translated readout to the model on the held-back positions."""
    total = {layer: 0.0 for layer in lens.layers}
    with torch.no_grad():
        for a in range(0, len(last), chunk):
            logp = _log_probs(model, last[a:a + chunk])
            for layer in lens.layers:
                logq = _log_probs(model, lens.translate(layer, H[layer][a:a + chunk].to(model.device)))
                total[layer] += float(_kl(logp, logq)) * len(logp)
    return {str(layer): total[layer] / len(last) for layer in lens.layers}


def _resume_settings(model: LensModel, prompts: Sequence[str], layers: list[int], s: TuneSettings,
                     meta: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: everything that changes the translators."""
    return {"model_id": meta.get("model_id"), "revision": meta.get("revision"), "model_files": (
        meta.get("model_files") or {}).get("parts"), "n_layers": model.n_layers, "d_model": model.d_model,
        "layers": layers, "max_length": s.max_length, "skip_first": s.skip_first, "chat": s.chat,
        "force_bos": s.force_bos, "steps": s.steps, "batch_tokens": s.batch_tokens, "lr": s.lr,
        "val_prompts": s.val_prompts, "seed": s.seed, "n_prompts": len(prompts),
        "prompts_sha256": sha256_text("".join(f"{p}\0" for p in prompts))}


def fit_tuned_lens(model: LensModel, tokenizer: Any, prompts: Sequence[str], settings: TuneSettings | None = None,
                   *, meta: dict[str, Any] | None = None, out_dir: str | Path | None = None,
                   options: TuneOptions | None = None) -> TunedLens:
    """Train a translator per layer on `prompts` (the last `val_prompts` held back and scored); with `out_dir`,
    checkpoint there and resume from a checkpoint of the same settings. `meta.training.complete` is False
    when `options.stop_after` stopped it first."""
    s, o, meta = settings or TuneSettings(), options or TuneOptions(), dict(meta or {})
    last = model.n_layers - 1
    chosen = parse_layers(s.layers)
    layers = sorted({normalise_layer(x, model.n_layers) for x in chosen} if chosen is not None else set(range(last)))
    if not layers or last in layers:
        raise LensError(f"tuned-lens layers {layers}: give blocks below the last one ({last}), which reads "
                        "the model's own logits")
    n_val = min(s.val_prompts, len(prompts) - 1)
    if n_val < 0 or not prompts:
        raise LensError("no prompt to train a tuned lens on")
    train, val = prompts[:len(prompts) - n_val], prompts[len(prompts) - n_val:]
    compared = _resume_settings(model, prompts, layers, s, meta)
    ckpt = Path(out_dir) / CHECKPOINT if out_dir is not None else None
    saved = load_checkpoint(ckpt, compared, job="tuned-lens training") if (
        ckpt is not None and o.resume and ckpt.exists()) else None
    H, H_last = _states(model, tokenizer, train, layers, s)
    H_val, last_val = _states(model, tokenizer, val, layers, s) if val else ({}, torch.empty(0))
    d, dev = model.d_model, model.device  # the translators train where the model is; the states wait on the host
    A = {layer: torch.zeros(d, d, device=dev, requires_grad=True) for layer in layers}
    b = {layer: torch.zeros(d, device=dev, requires_grad=True) for layer in layers}
    lens = TunedLens(A, b)
    before = _val_kl(model, lens, H_val, last_val) if val else {}
    params = [*A.values(), *b.values()]
    opt = torch.optim.Adam(params, lr=s.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / max(s.steps, 1))
    gen = torch.Generator().manual_seed(s.seed)
    history: list[dict[str, float]] = []
    first, seconds_before = 0, 0.0
    if saved is not None:
        try:
            with torch.no_grad():
                for layer in layers:
                    A[layer].copy_(saved["A"][str(layer)])
                    b[layer].copy_(saved["b"][str(layer)])
            opt.load_state_dict(saved["optimizer"])
            sched.load_state_dict(saved["schedule"])
            gen.set_state(saved["generator"])
            history, first, seconds_before = json.loads(saved["history"]), int(saved["step"]), float(saved["seconds"])
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise incomplete(ckpt, exc, job="tuned-lens training") from None  # type: ignore[arg-type]
        log.info("resuming the tuned lens from %s at step %d of %d", ckpt, first, s.steps)

    started = time.perf_counter()

    def checkpoint(next_step: int) -> None:
        save_checkpoint(ckpt, {  # type: ignore[arg-type]
            "step": next_step, "seconds": seconds_before + time.perf_counter() - started,
            "A": {str(k): v.detach().to("cpu", copy=True) for k, v in A.items()},
            "b": {str(k): v.detach().to("cpu", copy=True) for k, v in b.items()},
            "optimizer": opt.state_dict(), "schedule": sched.state_dict(), "generator": gen.get_state(),
            "history": json.dumps(history)}, compared)

    last_ckpt, since_ckpt, step = time.monotonic(), 0, first
    bar = tqdm(total=s.steps, initial=first, desc="fit tuned lens", unit="step", disable=not s.progress,
               dynamic_ncols=True)
    try:
        while step < s.steps:
            if o.stop_after is not None and step - first >= o.stop_after:
                break
            idx = torch.randint(len(H_last), (min(s.batch_tokens, len(H_last)),), generator=gen)
            with torch.no_grad():
                logp = _log_probs(model, H_last[idx])
            losses = {layer: _kl(logp, _log_probs(model, lens.translate(layer, H[layer][idx].to(dev))))
                      for layer in layers}
            loss = torch.stack(list(losses.values())).sum()
            grads = torch.autograd.grad(loss, params)  # the model's own weights get no gradient
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            opt.step()
            sched.step()
            if step % 10 == 0 or step == s.steps - 1:
                history.append({"step": step, **{str(k): float(v.detach()) for k, v in losses.items()}})
                bar.set_postfix(kl=f"{float(loss.detach()) / len(layers):.3f}")
            step, since_ckpt = step + 1, since_ckpt + 1
            bar.update(1)
            due = checkpoint_due(o.checkpoint_every, o.checkpoint_minutes, since_ckpt, time.monotonic() - last_ckpt)
            if ckpt is not None and due and step < s.steps:
                checkpoint(step)
                last_ckpt, since_ckpt = time.monotonic(), 0
    finally:
        bar.close()
    complete = step >= s.steps
    if ckpt is not None and not complete:
        checkpoint(step)
    for p in params:
        p.requires_grad_(False)
        p.grad = None
    after = _val_kl(model, lens, H_val, last_val) if val else {}
    lens = TunedLens({k: v.detach().cpu() for k, v in A.items()}, {k: v.detach().cpu() for k, v in b.items()})
    lens.meta = TunedMeta.model_validate({
        **meta,
        "model_id": meta.get("model_id", getattr(model, "name", None)),
        "n_layers": model.n_layers, "d_model": d, "layers": layers, "max_length": s.max_length,
        "skip_first": s.skip_first, "chat": s.chat, "force_bos": s.force_bos, "n_prompts": len(train),
        "n_tokens": len(H_last), "n_val_prompts": len(val),
        "training": {"steps": s.steps, "steps_done": step, "complete": complete, "resumed_at": first if saved
                     else None, "batch_tokens": s.batch_tokens, "lr": s.lr, "optimizer": "adam",
                     "schedule": "linear decay to 0", "init": "zero (the logit lens)", "seed": s.seed,
                     "seconds": round(seconds_before + time.perf_counter() - started, 1), "history": history},
        "kl_val_before": before, "kl_val_after": after,
    })
    return lens


def finish_checkpoint(out_dir: str | Path) -> None:
    """Remove the checkpoint once the finished lens is saved (it holds nothing the lens does not)."""
    (Path(out_dir) / CHECKPOINT).unlink(missing_ok=True)


def save_tuned_lens(lens: TunedLens, out_dir: str | Path) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {**{f"A.{k}": v.detach().float().contiguous().cpu() for k, v in lens.A.items()},
               **{f"b.{k}": v.detach().float().contiguous().cpu() for k, v in lens.b.items()}}
    atomic_write(out / WEIGHTS, lambda tmp: save_file(tensors, tmp, metadata={"format": FORMAT}))
    record = TunedRecord.model_validate({**lens.meta.to_json(), "format": FORMAT, "layers": lens.layers,
                                         "d_model": lens.d_model, "file": WEIGHTS,
                                         "sha256": sha256_file(out / WEIGHTS), "saved_at": utc_now()})
    lens.meta = record
    atomic_write_text(out / SIDECAR, json.dumps(record.to_json(), indent=2, sort_keys=True) + "\n")
    return out


def load_tuned_lens(path: str | Path, *, model: LensModel | None = None) -> TunedLens:
    """A tuned-lens folder, its checksum and its shape checked (against `model` when given)."""
    from safetensors.torch import load_file

    d = Path(path)
    d = d.parent if d.name in (SIDECAR, WEIGHTS) else d
    side, weights = d / SIDECAR, d / WEIGHTS
    if not side.is_file() or not weights.is_file():
        raise LensError(f"{d}: not a tuned lens (missing {SIDECAR} or {WEIGHTS}; `lhd lens tune` writes them)")
    try:
        data = json.loads(side.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise LensError(f"{side}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else None
        raise LensError(f"{side}: format {found!r}, expected {FORMAT!r}")
    try:
        meta = TunedRecord.model_validate(data)
    except ValidationError as exc:
        raise record_error(exc, side, TunedRecord) from None
    digest = sha256_file(weights)
    if digest != meta.sha256:
        raise LensError(f"{weights}: sha256 {digest[:12]}… does not match the sidecar ({meta.sha256[:12]}…)")
    raw = load_file(str(weights))
    A = {layer: raw[f"A.{layer}"] for layer in meta.layers if f"A.{layer}" in raw}
    b = {layer: raw[f"b.{layer}"] for layer in meta.layers if f"b.{layer}" in raw}
    if len(A) != len(meta.layers) or len(b) != len(meta.layers):
        raise LensError(f"{weights}: translators for layers {sorted(A)} differ from the sidecar's {meta.layers}")
    if model is not None and (meta.d_model != model.d_model or meta.n_layers not in (None, model.n_layers)):
        raise LensError(f"{d}: trained on a model with d_model {meta.d_model} and {meta.n_layers} blocks; this one "
                        f"has {model.d_model} and {model.n_layers}")
    return TunedLens(A, b, meta)
