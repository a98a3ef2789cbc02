"""Lens quality on prompt sets: every readout's pass@k (`lens.passk`) and the causal check
(`lens.causal`), for `lhd lens eval --prompt-set` (docs/lens.md, "Lens quality").

The readouts are what `lens.readout.build_readouts` makes of the given lenses: the logit lens, the
J-lens, its random-transport control, and self-only / future-only J-lenses when given. All are
scored over the lens's source layers, beside the `prompt_echo` baseline (`lens.passk`).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lens.causal import CausalConfig, causal_rows, summarise_causal
from lens.errors import LensError
from lens.margins import resolve_token_sets
from lens.model import LensModel
from lens.passk import PROMPT_ECHO, rank_items, rank_rows_json, summarise_set
from lens.promptsets import PromptSet
from lens.readout import Readout
from lens.settings import QualitySettings
from lens.store import Lens

log = logging.getLogger(__name__)


class QualityConfig(QualitySettings):
    force_bos: bool = True
    causal_layers: list[int] | None = None  # None: no causal check


@dataclass
class QualityResult:
    passk: dict[str, Any]
    ranks: list[dict[str, Any]]
    causal: dict[str, Any] | None = None
    causal_rows: list[dict[str, Any]] = field(default_factory=list)
    readouts: list[str] = field(default_factory=list)


def middle_layer(lens: Lens) -> int:
    layers = lens.source_layers
    return layers[(len(layers) - 1) // 2]


def evaluate_prompt_sets(model: LensModel, tokenizer: Any, readouts: Mapping[str, Readout], layers: Sequence[int],
                         sets: Sequence[PromptSet], cfg: QualityConfig | None = None) -> QualityResult:
    """Pass@k of every readout on every set over `layers` (the lens's source layers), and the causal check."""
    cfg = cfg or QualityConfig()
    result = QualityResult(passk={}, ranks=[], readouts=list(readouts))
    token_sets = None
    if cfg.causal_layers is not None:
        try:
            token_sets = resolve_token_sets(tokenizer, model_type=getattr(model, "model_type", None))
        except LensError as exc:
            log.warning("no entitlement direction in the causal check: %s", exc)
        result.causal = {}
    for pset in sets:
        if pset.name in result.passk:
            raise LensError(f"two prompt sets are named {pset.name!r} (passk.json keys by the file name)")
        log.info("prompt set %s: %d items", pset.name, len(pset.items))
        rows = rank_items(model, tokenizer, pset, readouts, layers, force_bos=cfg.force_bos)
        result.passk[pset.name] = summarise_set(rows, [*readouts, PROMPT_ECHO], layers, n_boot=cfg.n_boot,
                                                 seed=cfg.seed)
        result.ranks += rank_rows_json(rows)
        if cfg.causal_layers is not None and result.causal is not None:
            crow = causal_rows(model, tokenizer, readouts, pset, token_sets,
                               CausalConfig(layers=cfg.causal_layers, n_random=cfg.causal_random, seed=cfg.seed,
                                            force_bos=cfg.force_bos))
            result.causal[pset.name] = summarise_causal(crow, n_boot=cfg.n_boot, seed=cfg.seed)
            result.causal_rows += crow
    return result
