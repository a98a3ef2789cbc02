"""Readouts: logits at (layer, position) from a residual `h_l`, one class per readout, one registry.

`transform(layer, h)` maps the residual to where the final norm and unembedding read it
(tuned-lens's `transform_hidden`), `logits` reads there (only the columns asked for), and
`direction(layer, u)` is the transform's adjoint. `READOUTS` holds the classes in report order
(`logit`, `jacobian`, `jacobian_random`, `jacobian_self`, `jacobian_future`, `tuned`); everything
downstream iterates `build_readouts` and never spells a name (`tests/test_layout.py`). A readout
with a fitted artifact of its own declares it (`artifact`) and loads it (`Readout.load`), so any
readout is one class and one entry (docs/lens.md, "Readouts"). The linear probe
(`lens.readout_probe`) is no transform of the residual; its rows carry the name `PROBE`."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from lens.controls import random_transport
from lens.errors import LensError
from lens.model import LensModel
from lens.store import Lens, load_lens
from lens.tuned import TunedLens, load_tuned_lens


@dataclass(frozen=True)
class Lenses:
    """What the readouts are built from: the fitted artifacts by the name of the readout that declares them
    (`Readout.load`; none: the logit lens only), and whether (and with which seed) to read the J-lens's
    random-transport control."""

    fitted: Mapping[str, Any] = field(default_factory=dict)
    control: bool = True
    control_seed: int = 0

    @property
    def lens(self) -> Lens | None:
        """The J-lens, which the control and the lenses read beside it are built on."""
        return self.fitted.get(PRIMARY)


class Readout(ABC):
    """One way to read logits from a residual; subclasses set `name` and register in `READOUTS`."""

    name: ClassVar[str]
    #: what `load` reads, in words, for a readout with a fitted artifact of its own (None: it reads the model,
    #: or another readout's artifact)
    artifact: ClassVar[str | None] = None

    def __init__(self, model: LensModel):
        self.model = model

    @property
    def fitted(self) -> Any:
        """The fitted lens this readout applies (a J-lens or a tuned lens, whose checksum names the read);
        None when it reads the model alone."""
        return None

    @classmethod
    def load(cls, path: str | Path, *, model: LensModel | None = None, target_layer: int | None = None) -> Any:
        """This readout's fitted artifact from `path` (checked against `model`); only readouts that declare an
        `artifact` have one."""
        raise LensError(f"the {cls.name} readout reads no artifact of its own (--readout takes: "
                        f"{', '.join(fitted_readouts())})")

    @classmethod
    @abstractmethod
    def build(cls, model: LensModel, lenses: Lenses) -> Readout | None:
        """This readout for `model`, or None when `lenses` lack what it reads."""

    @abstractmethod
    def has_layer(self, layer: int) -> bool:
        """Whether `layer` can be read (a lens fitted on a band of layers lacks the rest)."""

    @abstractmethod
    def transform(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """`h_l` mapped to where the final norm and unembedding read it."""

    def logits(self, layer: int, h: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`[..., V]` logits (or the columns of `token_ids`) of `h` read at `layer`."""
        with torch.no_grad():
            return self.model.unembed(self.transform(layer, h), token_ids)

    def direction(self, layer: int, u: torch.Tensor) -> torch.Tensor:
        """`Aᵀ u` for the (linear part of the) transform `A` at `layer`, by autograd: `u · A h = (Aᵀ u) · h`."""
        at = torch.zeros(self.model.d_model, dtype=u.dtype, device=u.device)
        pullback = torch.func.vjp(lambda h: self.transform(layer, h), at)[1]
        return pullback(u)[0]


class LogitLens(Readout):
    name = "logit"

    @classmethod
    def build(cls, model: LensModel, lenses: Lenses) -> Readout:
        return cls(model)

    def has_layer(self, layer: int) -> bool:
        return True

    def transform(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        return h


class JacobianLens(Readout):
    name = "jacobian"
    artifact: ClassVar[str | None] = "a lens folder (lhd lens fit) or a published jlens .pt"

    def __init__(self, model: LensModel, lens: Lens):
        super().__init__(model)
        if lens.d_model != model.d_model:
            raise LensError(f"lens d_model {lens.d_model} != model d_model {model.d_model}")
        target = lens.target_layer
        self.target = model.n_layers - 1 if target is None else target
        self.lens = lens
        self._J: dict[int, torch.Tensor] = {}  # fp32 on the model's device, moved there on first use

    @property
    def fitted(self) -> Lens:
        return self.lens

    @classmethod
    def load(cls, path: str | Path, *, model: LensModel | None = None, target_layer: int | None = None) -> Lens:
        return load_lens(path, model=model, target_layer=target_layer)

    @classmethod
    def source(cls, lenses: Lenses) -> Lens | None:
        """The lens this readout applies, from the given ones (None: not read)."""
        return lenses.fitted.get(cls.name)

    @classmethod
    def build(cls, model: LensModel, lenses: Lenses) -> Readout | None:
        lens = cls.source(lenses)
        return None if lens is None else cls(model, lens)

    def has_layer(self, layer: int) -> bool:
        """Layers with a matrix, plus the target and above (identity); a lens fitted on a band lacks the rest."""
        return layer >= self.target or layer in self.lens.J

    def transform(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """`J_l h` in fp32, cast back to `h`'s dtype; identity at/above the target layer."""
        if layer >= self.target:
            return h
        if layer not in self._J:
            if layer not in self.lens.J:
                raise LensError(f"the lens has no matrix for layer {layer} (it has {self.lens.source_layers})")
            self._J[layer] = self.lens.J[layer].to(self.model.device, torch.float32)
        return (h.to(torch.float32) @ self._J[layer].T).to(h.dtype)


class RandomTransportLens(JacobianLens):
    """The lens's null control: what a J-lens readout shows when `J_l` carries no information about the model."""

    name = "jacobian_random"
    artifact = None  # built from the J-lens

    @classmethod
    def source(cls, lenses: Lenses) -> Lens | None:
        if lenses.lens is None or not lenses.control:
            return None
        return random_transport(lenses.lens, lenses.control_seed)


def _beside(other: Lens | None, lenses: Lenses, what: str) -> Lens | None:
    """`other`, checked to cover the lens's layers and share its target (so both are read on the same layers)."""
    lens = lenses.lens
    if other is None or lens is None:
        return other
    missing = [layer for layer in lens.source_layers if layer not in other.J]
    if missing or other.target_layer != lens.target_layer:
        raise LensError(f"the {what} lens lacks layers {missing} or has target {other.target_layer} (the lens: "
                        f"{lens.source_layers} -> {lens.target_layer}); fit it with the lens's layers")
    return other


class SelfLens(JacobianLens):
    """A lens fitted with `--estimator self` (the per-position term `t' = t`)."""

    name = "jacobian_self"

    artifact = "a lens folder fitted with --estimator self"

    @classmethod
    def source(cls, lenses: Lenses) -> Lens | None:
        return _beside(lenses.fitted.get(cls.name), lenses, "self-only")


class FutureLens(JacobianLens):
    """A lens fitted with `--estimator future` (every later target but the position itself)."""

    name = "jacobian_future"

    artifact = "a lens folder fitted with --estimator future"

    @classmethod
    def source(cls, lenses: Lenses) -> Lens | None:
        return _beside(lenses.fitted.get(cls.name), lenses, "future-only")


class TunedLensReadout(Readout):
    """The tuned lens: what a translator trained to reproduce the model's next-token distribution reads."""

    name = "tuned"
    artifact = "a tuned-lens folder (lhd lens tune)"

    def __init__(self, model: LensModel, tuned: TunedLens):
        super().__init__(model)
        if tuned.d_model != model.d_model:
            raise LensError(f"tuned lens d_model {tuned.d_model} != model d_model {model.d_model}")
        self.tuned = tuned

    @property
    def fitted(self) -> TunedLens:
        return self.tuned

    @classmethod
    def load(cls, path: str | Path, *, model: LensModel | None = None, target_layer: int | None = None) -> TunedLens:
        return load_tuned_lens(path, model=model)

    @classmethod
    def build(cls, model: LensModel, lenses: Lenses) -> Readout | None:
        tuned, lens = lenses.fitted.get(cls.name), lenses.lens
        if tuned is None:
            return None
        layers = [] if lens is None else lens.source_layers
        missing = [layer for layer in layers if layer not in tuned.A]
        if missing:
            raise LensError(f"the tuned lens lacks layers {missing} of the lens ({layers}); train it with "
                            "`lhd lens tune --layers` set to the lens's layers")
        return cls(model, tuned)

    def has_layer(self, layer: int) -> bool:
        return layer >= self.model.n_layers - 1 or layer in self.tuned.A

    def transform(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """`h + A_l h + b_l`; the last block is read as it is (the model's own logits)."""
        return h if layer >= self.model.n_layers - 1 else self.tuned.translate(layer, h)


#: every readout by name, in the order tables and plots show them
READOUTS: dict[str, type[Readout]] = {cls.name: cls for cls in (LogitLens, JacobianLens, RandomTransportLens,
                                                                SelfLens, FutureLens, TunedLensReadout)}
#: the readout every other one is compared with (`J = I`), and the one whose results are the headline
BASELINE, PRIMARY = LogitLens.name, JacobianLens.name


def fitted_readouts() -> list[str]:
    """The readouts with a fitted artifact of their own: the names `--readout NAME=PATH` takes."""
    return [name for name, cls in READOUTS.items() if cls.artifact is not None]


def load_fitted(paths: Mapping[str, str | Path], *, model: LensModel | None = None,
                target_layer: int | None = None) -> dict[str, Any]:
    """Each readout's artifact from its path (`--readout NAME=PATH`), through the readout's own `load`."""
    unknown = sorted(set(paths) - set(fitted_readouts()))
    if unknown:
        raise LensError(f"--readout {unknown[0]}=...: no readout of that name loads an artifact (allowed: "
                        f"{', '.join(fitted_readouts())})")
    return {name: READOUTS[name].load(path, model=model, target_layer=target_layer) for name, path in paths.items()}


def build_readouts(model: LensModel, lenses: Lenses) -> dict[str, Readout]:
    """Every registered readout that `lenses` allow, by name, in registry order."""
    out = {}
    for name, cls in READOUTS.items():
        ro = cls.build(model, lenses)
        if ro is not None:
            out[name] = ro
    return out
