"""Run configuration (`lhd run CONFIG`): the typed models of a run config, loaded through `config.base`."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, field_validator, model_validator

from lhd_train.config.base import StrictModel, read_config, relative_to_file, validate
from lhd_train.config.vocab import CATEGORIES, LEVELS, ROLES
from lhd_train.errors import InputError
from lhd_train.rundir.files import read_yaml_mapping
from lhd_train.rundir.layout import RunDir
from lhd_train.rundir.names import name_problem
from rollouts.spec import ModelSpec
from rollouts.types import SamplingParams


class Sampling(StrictModel):
    temperature: float = Field(0.7, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(512, ge=1)

    def params(self, seed: int | None, n: int = 1) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.max_tokens, seed, n)


class RoleConfig(StrictModel):
    model: str = Field(description="a key of `models`")
    sampling: Sampling = Field(default_factory=Sampling)
    adapter: str | None = Field(None, description="LoRA adapter (path or a name the model serves)")
    max_attempts: int = Field(3, ge=1, description="attempts for structured answers before recording a failure")


class PerformerSampling(Sampling):
    """The performer writes whole reports (6-12k characters: docs/reference.md, "Call and token budget")."""

    max_tokens: int = Field(4096, ge=1)


class PerformerConfig(RoleConfig):
    sampling: PerformerSampling = Field(default_factory=PerformerSampling)
    max_segments: int = Field(
        5, ge=1, description="an answer cut at max_tokens is continued up to this many segments in all (1 = never)"
    )
    context_tokens: int | None = Field(
        None, ge=64, description="prompt budget; default: the model's context minus max_tokens"
    )
    think_tags: list[str] = Field(default_factory=lambda: ["think"], description="tags whose text is kept apart")


class Control(StrictModel):
    category: str | None = None
    pressure: str | None = None

    @field_validator("category")
    @classmethod
    def _cat(cls, v: str | None) -> str | None:
        if v is not None and v not in (*CATEGORIES, "NONE"):
            raise ValueError(f"'{v}' is not a category (allowed: {', '.join(CATEGORIES)}, NONE)")
        return v

    @field_validator("pressure")
    @classmethod
    def _lvl(cls, v: str | None) -> str | None:
        if v is not None and v not in (*LEVELS, "NONE"):
            raise ValueError(f"'{v}' is not a pressure level (allowed: {', '.join(LEVELS)}, NONE)")
        return v


class InitialState(StrictModel):
    trust: float = Field(0.0, ge=-1, le=1)
    satisfaction: float = Field(0.0, ge=-1, le=1)
    comfort: float = Field(0.0, ge=-1, le=1)


class RunConfig(StrictModel):
    """Everything that defines a run. Saved resolved (without secrets) into the run directory."""

    run_name: str = Field(description="the run's folder under output_dir (a plain name: lhd_train.rundir.names)")
    output_dir: str = "runs"
    task_pack: str = "startup_consulting"
    seeds: list[int] | None = Field(None, description="event seeds, one trial each")
    num_trials: int | None = Field(None, ge=1, description="draw this many seeds from `seed` when `seeds` is unset")
    seed: int = Field(0, description="master seed for drawing trial seeds")
    p_event: float = Field(0.5, ge=0, le=1)
    control: Control = Field(default_factory=Control)
    max_rounds_per_task: int = Field(3, ge=1)
    completion_threshold: float = Field(0.2, ge=-1, le=1)
    memory_window: int = Field(7, ge=1)
    initial_state: InitialState = Field(default_factory=InitialState)
    max_tasks: int | None = Field(None, ge=1, description="stop after this many tasks (smoke tests)")
    concurrency: int = Field(8, ge=1, description="trials run at once")
    models: dict[str, ModelSpec]
    performer: PerformerConfig
    supervisor: RoleConfig
    summariser: RoleConfig | None = Field(None, description="default: the supervisor's model and sampling")
    auditor: RoleConfig | None = None
    prompts_dir: str | None = Field(None, description="override prompt files (default: built-in)")

    @field_validator("run_name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        problem = name_problem(v)  # `..` or `a/b` would put the run outside output_dir
        if problem:
            raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        if self.seeds is not None and not self.seeds:
            raise ValueError("seeds: the list is empty; give at least one seed or use num_trials")
        if self.seeds is None and self.num_trials is None:
            raise ValueError("give `seeds` (a list) or `num_trials`")
        if self.seeds is not None and len(set(self.seeds)) != len(self.seeds):
            raise ValueError("seeds: repeated seed")
        for role in ("performer", "supervisor", "summariser", "auditor"):
            rc = getattr(self, role)
            if rc is not None and rc.model not in self.models:
                raise ValueError(
                    f"{role}.model: '{rc.model}' is not defined in models (allowed: {', '.join(self.models)})"
                )
        return self

    def role(self, name: str) -> RoleConfig:
        if name not in ROLES:
            raise InputError(None, "role", f"unknown role '{name}'", ", ".join(ROLES))
        rc = getattr(self, name)
        if rc is None and name == "summariser":
            return self.supervisor
        if rc is None:
            raise InputError(None, name, f"role '{name}' is not configured")
        return rc

    def trial_seeds(self) -> list[int]:
        if self.seeds is not None:
            return list(self.seeds)
        import random

        rng = random.Random(self.seed)
        return [rng.getrandbits(32) for _ in range(self.num_trials or 0)]

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.run_name


def parse_config(data: dict[str, Any], source: str | Path) -> RunConfig:
    return validate(RunConfig, data, source)


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    path = Path(path)
    cfg = parse_config(read_config(path, overrides, "config file"), path)
    # Relative model paths are relative to the config file, so configs travel with their models.
    for spec in cfg.models.values():
        spec.model = relative_to_file(spec.model, path)
    return cfg


def load_saved_config(run_dir: str | Path) -> RunConfig:
    """The resolved config a run directory was made with (`config.resolved.yaml`)."""
    saved = RunDir(run_dir).config
    if not saved.is_file():
        raise InputError(saved, None, "not found: is this a run directory?")
    return parse_config(read_yaml_mapping(saved, "run config"), saved)


def dump_resolved(cfg: RunConfig) -> str:
    """YAML of the resolved config. Keys are referenced by env-variable name only, never by value."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
