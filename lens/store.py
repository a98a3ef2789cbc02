"""A fitted Jacobian lens in memory and on disk.

On disk (`save_lens`): `<dir>/lens.safetensors` with one `d×d` matrix per source layer
(key `layer.<l>`, fp16 by default) and `<dir>/lens.json`, a sidecar with the model id and
revision, layers, target, skip_first, max length, corpus recipe, prompt count, dtype and the
SHA-256 of the safetensors file (checked on load), typed as `lens.record.LensRecord`.

`load_lens` also reads the published jlens layout (`torch.save` of a dict with `"J": {layer:
tensor}, "n_prompts", "source_layers", "d_model"`, e.g. the Neuronpedia lenses), after checking
`d_model` and the layer count against the model it will be applied to.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lens.errors import LensError
from lens.files import atomic_write, atomic_write_text, sha256_file, utc_now
from lens.record import FORMAT, LensMeta, LensRecord, read_lens_record

WEIGHTS = "lens.safetensors"
SIDECAR = "lens.json"
SAVE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class Lens:
    """`J[l]` for each source layer `l` (fp32, CPU) plus metadata (see module doc); `meta` given
    as a dict is checked into a `LensMeta`."""

    J: dict[int, torch.Tensor]
    meta: LensMeta = field(default_factory=LensMeta)

    def __post_init__(self) -> None:
        if not isinstance(self.meta, LensMeta):
            self.meta = LensMeta.model_validate(self.meta)

    @property
    def source_layers(self) -> list[int]:
        return sorted(self.J)

    @property
    def d_model(self) -> int:
        return int(next(iter(self.J.values())).shape[-1])

    @property
    def n_prompts(self) -> int:
        return self.meta.n_prompts

    @property
    def target_layer(self) -> int | None:
        return self.meta.target_layer

    def matrix(self, layer: int) -> torch.Tensor | None:
        return self.J.get(layer)


def save_lens(lens: Lens, out_dir: str | Path, *, dtype: str = "float16") -> Path:
    from safetensors.torch import save_file

    if dtype not in SAVE_DTYPES:
        raise LensError(f"unknown save dtype {dtype!r} (allowed: {', '.join(SAVE_DTYPES)})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {f"layer.{layer}": J.to(SAVE_DTYPES[dtype]).contiguous().cpu() for layer, J in sorted(lens.J.items())}
    atomic_write(out / WEIGHTS, lambda tmp: save_file(tensors, tmp, metadata={"format": FORMAT}))
    record = LensRecord.model_validate({
        **lens.meta.to_json(),
        "format": FORMAT,
        "source_layers": lens.source_layers,
        "d_model": lens.d_model,
        "shape": list(next(iter(lens.J.values())).shape),
        "dtype": dtype,
        "file": WEIGHTS,
        "sha256": sha256_file(out / WEIGHTS),
        "saved_at": utc_now(),
    })
    lens.meta = record
    atomic_write_text(out / SIDECAR, json.dumps(record.to_json(), indent=2, sort_keys=True) + "\n")
    return out


def _check_against_model(J: dict[int, torch.Tensor], d_model: int, where: str, model: Any) -> None:
    if model is None:
        return
    if d_model != model.d_model:
        raise LensError(
            f"{where}: lens d_model {d_model} != model d_model {model.d_model} (a lens for a different model?)"
        )
    bad = [layer for layer in J if not 0 <= layer < model.n_layers]
    if bad or len(J) > model.n_layers:
        raise LensError(
            f"{where}: lens has {len(J)} layers (max index {max(J)}) but the model has {model.n_layers} blocks "
            "(a lens for a different model?)"
        )


def load_lens(path: str | Path, *, model: Any = None, target_layer: int | None = None, verify: bool = True) -> Lens:
    """Load a lens directory (safetensors + sidecar) or a published jlens `.pt` file."""
    p = Path(path)
    if p.is_dir() or p.name == SIDECAR or p.suffix == ".safetensors":
        return _load_dir(p if p.is_dir() else p.parent, model=model, verify=verify)
    if p.suffix in (".pt", ".pth", ".bin"):
        return _load_jlens_pt(p, model=model, target_layer=target_layer)
    raise LensError(f"{p}: not a lens directory ({SIDECAR} + {WEIGHTS}) or a jlens .pt file")


def _load_dir(d: Path, *, model: Any, verify: bool) -> Lens:
    from safetensors.torch import load_file

    side, weights = d / SIDECAR, d / WEIGHTS
    if not side.is_file() or not weights.is_file():
        raise LensError(f"{d}: missing {SIDECAR} or {WEIGHTS}")
    meta = read_lens_record(side)
    if verify:
        digest = sha256_file(weights)
        if digest != meta.sha256:
            raise LensError(f"{weights}: sha256 {digest[:12]}… does not match the sidecar ({meta.sha256[:12]}…)")
    try:
        raw = load_file(str(weights))
        J = {int(k.split(".", 1)[1]): v.float() for k, v in raw.items()}
    except Exception as exc:  # noqa: BLE001 - SafetensorError and friends: a torn or foreign file
        raise LensError(f"{weights}: cannot read the lens matrices ({type(exc).__name__}: {exc})") from None
    if sorted(J) != sorted(meta.source_layers):
        raise LensError(f"{d}: layers in {WEIGHTS} {sorted(J)} differ from the sidecar {meta.source_layers}")
    _check_against_model(J, meta.d_model, str(d), model)
    if model is not None and meta.n_layers not in (None, model.n_layers):
        raise LensError(f"{d}: fitted on a model with {meta.n_layers} blocks, this one has {model.n_layers}")
    return Lens(J=J, meta=meta)


def _load_jlens_pt(p: Path, *, model: Any, target_layer: int | None) -> Lens:
    try:
        obj = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise LensError(f"{p}: cannot read as a jlens .pt file ({exc})") from exc
    if not isinstance(obj, dict) or not isinstance(obj.get("J"), dict) or not obj["J"]:
        raise LensError(f"{p}: expected a dict with 'J': {{layer: tensor}} (the jlens save layout)")
    J = {int(k): v.float() for k, v in obj["J"].items()}
    d_model = int(obj.get("d_model") or next(iter(J.values())).shape[-1])
    for layer, m in J.items():
        if tuple(m.shape) != (d_model, d_model):
            raise LensError(f"{p}: layer {layer} has shape {tuple(m.shape)}, expected ({d_model}, {d_model})")
    declared = obj.get("source_layers")
    if declared is not None and sorted(int(x) for x in declared) != sorted(J):
        raise LensError(f"{p}: 'source_layers' {list(declared)} does not match the keys of 'J' {sorted(J)}")
    _check_against_model(J, d_model, str(p), model)
    n_layers = model.n_layers if model is not None else max(J) + 2
    target = target_layer if target_layer is not None else n_layers - 1  # the reference default
    if target < 0:
        target += n_layers
    if max(J) >= target:
        raise LensError(f"{p}: lens has layer {max(J)} but target layer is {target}; pass the right --target-layer")
    meta = LensMeta(format="jlens.pt", file=str(p), sha256=sha256_file(p), n_prompts=int(obj.get("n_prompts", 0)),
                    source_layers=sorted(J), d_model=d_model, n_layers=n_layers, target_layer=target,
                    model_id=getattr(model, "name", None))
    return Lens(J=J, meta=meta)


MERGE_KEYS = ("model_id", "revision", "n_layers", "target_layer", "skip_first", "max_length", "directions",
              "estimator", "sign_seed")


def _check_disjoint(lenses: Sequence[Lens]) -> None:
    """Refuse a lens given twice, or two fits over overlapping prompts of one corpus: their
    prompts would be counted twice in the weighted mean (issue 22)."""
    seen: dict[str, int] = {}
    spans: list[tuple[str, int, int, int]] = []
    for i, x in enumerate(lenses):
        digest = x.meta.sha256
        if digest and digest in seen:
            raise LensError(f"lens {i} is lens {seen[digest]} again (sha256 {str(digest)[:12]}…): merging it twice "
                            f"would count its {x.n_prompts} prompts twice")
        if digest:
            seen[digest] = i
        corpus = x.meta.corpus
        if isinstance(corpus.get("slice"), list) and len(corpus["slice"]) == 2:
            key = json.dumps({k: v for k, v in corpus.items() if k not in ("slice", "shards")}, sort_keys=True)
            spans.append((key, int(corpus["slice"][0]), int(corpus["slice"][1]), i))
    for k, (key, a, b, i) in enumerate(spans):
        for key2, a2, b2, j in spans[k + 1:]:
            if key == key2 and a < b2 and a2 < b:
                raise LensError(f"lens {j} (prompts {a2}..{b2 - 1}) overlaps lens {i} (prompts {a}..{b - 1}) of the "
                                "same corpus: merged, their shared prompts would count twice; merge disjoint shards")


def _summed(terms: list[torch.Tensor]) -> torch.Tensor:
    """terms[0] + terms[1] + ..., in that order (as `sum`, without its int start)."""
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


def merge_lenses(lenses: Sequence[Lens]) -> Lens:
    """n_prompts-weighted mean of lenses fitted on disjoint prompt slices (same layers and settings)."""
    if not lenses:
        raise LensError("nothing to merge")
    first = lenses[0]
    for i, other in enumerate(lenses[1:], 1):
        if other.source_layers != first.source_layers or other.d_model != first.d_model:
            raise LensError(
                f"lens {i} has layers {other.source_layers} / d_model {other.d_model}, "
                f"lens 0 has {first.source_layers} / {first.d_model}"
            )
        for key in MERGE_KEYS:
            a, b = (getattr(x.meta, key) for x in (other, first))
            if a != b:
                raise LensError(f"lens {i} differs from lens 0 in {key!r}: {a!r} vs {b!r}")
    _check_disjoint(lenses)
    weights = [x.n_prompts for x in lenses]
    if any(w <= 0 for w in weights):
        raise LensError(f"every lens needs n_prompts > 0 to be merged, got {weights}")
    total = sum(weights)
    J = {layer: _summed([x.J[layer].float() * (w / total) for x, w in zip(lenses, weights, strict=True)])
         for layer in first.source_layers}
    meta = {k: v for k, v in first.meta.to_json().items() if k not in ("sha256", "file", "saved_at", "shard", "fit")}
    meta["n_prompts"] = total
    meta["merged_from"] = [
        {"n_prompts": x.n_prompts, "sha256": x.meta.sha256, "shard": x.meta.shard or None} for x in lenses
    ]
    if "corpus" in first.meta.model_fields_set:
        meta["corpus"] = dict(first.meta.corpus, shards=[x.meta.corpus.get("slice") for x in lenses])
    return Lens(J=J, meta=LensMeta.model_validate(meta))
