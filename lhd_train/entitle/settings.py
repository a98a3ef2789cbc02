"""The options of `lhd entitle run`, declared once (type, default, bounds, help), and what
MODEL_OR_CONFIG resolves to: the model spec, the adapter, the pack and the prompts."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from lhd_train.config.base import StrictModel
from lhd_train.errors import InputError
from rollouts.backends import ModelSpec
from rollouts.hf.spec import HFSpec

DEFAULT_PACK = "lhd_startup_consulting"  # short files: a context of ~1k tokens per condition
#: settings that decide what the answers are: a rerun into the same --out must keep them
RESULT_FIELDS = ("model_or_config", "overrides", "adapter", "pack", "facts", "per_task", "samples", "seed",
                 "temperature", "top_p", "max_tokens", "control")


class EntitleRunCommand(StrictModel):
    """`lhd entitle run MODEL_OR_CONFIG [OVERRIDES...] --out DIR`."""

    model_or_config: str = Field(description="a model folder or hub id (served in-process by the hf backend), or a run "
                                             "config YAML (its performer's model, backend and adapter)",
                                 json_schema_extra={"argument": True})
    overrides: list[str] = Field([], description="key.sub=value overrides of the run config",
                                 json_schema_extra={"argument": True})
    out: Path = Field(description="the entitle directory (created; a rerun resumes it)")
    pack: str | None = Field(None, description=f"task pack (default: the config's task_pack, else {DEFAULT_PACK})")
    mode: Literal["generate", "lite"] = Field("generate", description="generate: answers labelled by code; lite: the "
                                            "evidence file only, a prefilled answer and forced-choice "
                                            "log-probabilities (lhd_train/entitle/lite.py; default: all packs)")
    facts: int | None = Field(None, ge=1, le=100_000, description="facts to ask about per pack, spread over its tasks "
                                                                  "(default: 20; in lite mode every usable fact)")
    per_task: int | None = Field(None, ge=1, description="at most this many facts per task")
    samples: int = Field(0, ge=0, le=1000, description="sampled answers per condition, besides the greedy one")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="draws the facts, the altered and demanded values and "
                                                         "the sampling seeds")
    temperature: float = Field(0.7, gt=0, le=5, description="temperature of the sampled answers (greedy: 0)")
    top_p: float = Field(1.0, gt=0, le=1, description="top_p of the sampled answers")
    max_tokens: int = Field(96, ge=8, le=1 << 16, description="answer length cap in tokens (the question asks for "
                                                              "one or two sentences)")
    control: bool = Field(True, description="also ask each fact's control question (another task's fact)")
    adapter: str | None = Field(None, description="LoRA adapter folder (with a model; a config names its own "
                                                  "performer.adapter)")
    concurrency: int = Field(32, ge=1, le=4096, description="requests in flight at once")
    max_attempts: int = Field(3, ge=1, le=20, description="tries per request before it is recorded as an error")
    progress: bool = Field(True, description="show the progress bar")

    @model_validator(mode="after")
    def _default_facts(self) -> EntitleRunCommand:
        if self.facts is None and self.mode == "generate":
            self.facts = 20
        return self


@dataclass
class Target:
    """What MODEL_OR_CONFIG resolves to."""

    spec: ModelSpec
    adapter: str | None
    pack: str
    prompts_dir: str | None
    config: dict[str, Any] | None  # the resolved run config (a config target), for the exported run


def is_config(target: str) -> bool:
    return Path(target).suffix.lower() in (".yaml", ".yml")


def resolve_target(s: EntitleRunCommand) -> Target:
    """The performer's model of a run config (with its adapter and pack), or a plain model for the
    hf backend. An override without a config, or an adapter given twice, is refused."""
    if is_config(s.model_or_config):
        from lhd_train.config.run import load_config

        if not Path(s.model_or_config).is_file():
            raise InputError("command line", "MODEL_OR_CONFIG", f"{s.model_or_config}: no such config file")
        cfg = load_config(s.model_or_config, s.overrides)
        spec = cfg.models[cfg.performer.model].model_copy(deep=True)
        adapter = cfg.performer.adapter
        if s.adapter is not None and adapter is not None and s.adapter != adapter:
            raise InputError("command line", "--adapter", f"the config's performer already has adapter {adapter}",
                             "one adapter: drop --adapter or override performer.adapter")
        adapter = s.adapter or adapter
        pack = s.pack or cfg.task_pack
        return Target(spec, adapter, pack, cfg.prompts_dir, cfg.model_dump(mode="json"))
    if s.overrides:
        raise InputError("command line", "OVERRIDES", f"{s.overrides[0]!r}: overrides need a run config",
                         "a run config YAML as MODEL_OR_CONFIG")
    return Target(HFSpec(model=s.model_or_config), s.adapter, s.pack or DEFAULT_PACK, None, None)


def with_adapter(spec: ModelSpec, adapter: str | None) -> ModelSpec:
    """The spec with `adapter` loaded at start-up (as `lhd run` adds a role's adapter)."""
    return spec.with_adapter(adapter) if adapter else spec.model_copy(deep=True)
