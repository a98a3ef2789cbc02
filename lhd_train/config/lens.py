"""What `lhd lens read` computes, declared once: type, default, bounds, help (`ReadSettings`).

The reading pipeline (`lhd_train.reading.read`) takes this model and `lhd lens read`'s options are
its fields (`lhd_train.cli.lens_options.ReadCommand`). The settings of a fit and a tuned lens are the
lens library's own (`lens.settings`), which this layer may not import."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from lhd_train.config.base import StrictModel

SEED_MAX = 2**32 - 1


class ReadSettings(StrictModel):
    """What a read computes, declared once: `lhd_train.reading.read` takes this model, and `lhd lens read`'s
    options are its fields (`ReadCommand`), so a setting has one default, one help text and one bound."""

    max_length: int = Field(4096, ge=1, le=1 << 20, description="Longer prompts are skipped (run mode 'full' drops "
                                                               "middle turns first).")
    answer_tokens: int = Field(3, ge=1, description="Run mode: first tokens of the performer's answer read "
                                                    "(answer_1..k).")
    bootstrap: int = Field(2000, ge=0, le=1_000_000, description="Bootstrap resamples for the CIs.")
    probe: bool = Field(True, description="Linear-probe baseline (record-grouped CV).")
    probe_folds: int = Field(5, ge=2, le=1000, description="Cross-validation folds of the probe.")
    max_claims: int = Field(16, ge=1, description="Run mode: asserted claims read per answer (thinned evenly beyond "
                                                  "that).")
    probe_c: float = Field(1.0, gt=0, description="Inverse regularisation strength of the probe.")
    emergence_threshold: float = Field(0.70, ge=0.5, le=1, description="AUROC from which a layer counts as "
                                                                        "emerged (three in a row, CI above 0.5).")
    band_start: float = Field(0.35, ge=0, le=1, description="Workspace band start, a fraction of depth (band means "
                                                            "and the primary cell).")
    band_end: float = Field(0.85, ge=0, le=1, description="Workspace band end, a fraction of depth.")
    primary_readout: Literal["jacobian", "jacobian_random", "logit", "probe"] = Field(
        "jacobian", description="Primary cell, declared before reading: the readout.")
    primary_anchor: Literal["record_end", "question_end", "decision"] = Field(
        "decision", description="Primary cell: the anchor position (run mode: decision, the elicitation's last "
                                "token; record_end and question_end come before the answer).")
    primary_metric: Literal["internal", "gap", "gap_stated_supported"] = Field(
        "gap_stated_supported", description="Primary cell, run mode: the score.")
    primary_contrast: Literal["length_matched", "evidence_deleted", "absent_attribute", "different_number"] = Field(
        "length_matched", description="Primary cell, probe sets: the claim-kind contrast (length_matched: the "
                                      "same claim with and without its evidence line, both records one line "
                                      "short).")
    random_control: bool = Field(True, description="Also read the random-transport control of the lens "
                                                   "(readout jacobian_random).")
    seed: int = Field(0, ge=0, le=SEED_MAX, description="Seed of the bootstrap and the probe folds.")
    progress: bool = Field(True, description="Progress bar.")

    @property
    def band(self) -> tuple[float, float]:
        return (self.band_start, self.band_end)

    @model_validator(mode="after")
    def _band(self) -> ReadSettings:
        if self.band_start > self.band_end:
            raise ValueError(f"band_start: {self.band_start} is above band_end {self.band_end}")
        return self
