"""Run configuration (`lhd run CONFIG`): the typed models of a run config, loaded through `config.base`."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, Field, Strict, field_validator, model_validator

from lhd_train.config.base import StrictModel, read_config, relative_to_file, validate
from lhd_train.config.vocab import CATEGORIES, LEVELS, ROLES
from lhd_train.errors import InputError
from lhd_train.io.files import read_yaml_mapping
from lhd_train.rundir.layout import RunDir
from lhd_train.rundir.names import name_problem, trial_id
from rollouts.backend import SpecError
from rollouts.backends import ModelSpec
from rollouts.types import SamplingParams

#: A seed: a whole number in 0 .. 2**32-1, the range every sampler (NumPy, vLLM, torch) takes; a
#: boolean is no seed (`seed: true` would silently be 1).
MAX_SEED = 2**32 - 1
Seed = Annotated[int, Strict(), Field(ge=0, le=MAX_SEED)]
MAX_PATH = 4096  # Linux's PATH_MAX: a longer value names no file, so it is refused before any lookup


def _path_length(v: str) -> str:
    if len(v) > MAX_PATH:
        raise ValueError(f"{len(v):,} characters, longer than any path or name (at most {MAX_PATH})")
    return v


# A value that names a folder or a file: a pasted text in such a field is one line, not an OSError.
PathText = Annotated[str, AfterValidator(_path_length)]


#: Output cap of every role: room for a full answer (the longest structured answer, a feedback
#: with 4,000-character reasoning and message, is ~2,000 tokens of English). The paper used large
#: caps (16k for GPT-4o) with continuation; a structured answer cut at its cap is retried with
#: twice the budget (bench/structured_calls.py), the performer's continued (`max_segments`).
DEFAULT_MAX_TOKENS = 4096


def _model_keys(v: dict[str, ModelSpec]) -> dict[str, ModelSpec]:
    for key in v:  # keys name log files and folders (logs/<key>.log): no hidden or nested ones
        problem = name_problem(key)
        if problem:
            raise ValueError(f"key {problem}")
    return v


#: `models:` of every config (run, auditor): model key -> spec, keys plain names (`rundir.names`)
ModelMap = Annotated[dict[str, ModelSpec], AfterValidator(_model_keys)]


class Sampling(StrictModel):
    """Decoding of one role. A field left unset (null) takes the model's own default from its
    generation_config.json (as vLLM applies it; else temperature 1, top_p 1, no top_k, no
    repetition penalty): the paper used each provider's defaults. Rows record what was used."""

    temperature: float | None = Field(None, ge=0, description="default: the model's")
    top_p: float | None = Field(None, gt=0, le=1, description="default: the model's")
    top_k: int | None = Field(None, ge=0, description="0: no top-k; default: the model's")
    repetition_penalty: float | None = Field(None, gt=0, description="default: the model's")
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=1)

    def params(self, seed: int | None, n: int = 1) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens,
                              seed=seed, n=n, top_k=self.top_k, repetition_penalty=self.repetition_penalty)


class RoleConfig(StrictModel):
    model: str = Field(description="a key of `models`")
    sampling: Sampling = Field(default_factory=Sampling)
    adapter: str | None = Field(None, description="LoRA adapter (path or a name the model serves)")
    max_attempts: int = Field(3, ge=1, description="attempts for structured answers before recording a failure")


class PerformerSampling(Sampling):
    """The performer writes whole reports (6-12k characters: docs/reference.md, "Call and token budget")."""

    max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=1)


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
    output_dir: PathText = "runs"
    task_pack: PathText = "startup_consulting"
    seeds: list[Seed] | None = Field(None, description="event seeds, one trial each (0 .. 2**32-1)")
    num_trials: int | None = Field(None, ge=1, le=1_000_000,
                                   description="draw this many seeds from `seed` when `seeds` is unset")
    seed: Seed = Field(0, description="master seed for drawing trial seeds (0 .. 2**32-1)")
    p_event: float = Field(0.5, ge=0, le=1)
    control: Control = Field(default_factory=Control)
    max_rounds_per_task: int = Field(3, ge=1)
    completion_threshold: float = Field(0.2, ge=-1, le=1)
    memory_window: int = Field(7, ge=1)
    initial_state: InitialState = Field(default_factory=InitialState)
    max_tasks: int | None = Field(None, ge=1, description="stop after this many tasks (smoke tests)")
    concurrency: int = Field(8, ge=1, description="trials run at once")
    models: ModelMap
    performer: PerformerConfig
    supervisor: RoleConfig
    summariser: RoleConfig | None = Field(None, description="default: the supervisor's model and sampling")
    auditor: RoleConfig | None = None
    prompts_dir: PathText | None = Field(None, description="override prompt files (default: built-in)")

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

    def check_pack(self, n_tasks: int, pack: str, source: str | Path | None = None) -> None:
        """Refuse `max_tasks` beyond the pack's tasks (called where the pack is loaded, before any
        model): asking for 50 of 20 tasks is a typo, not a request for all 20."""
        if self.max_tasks is not None and self.max_tasks > n_tasks:
            raise InputError(source, "max_tasks", f"{self.max_tasks} is more than the {n_tasks} tasks of pack "
                             f"'{pack}'", f"1 ... {n_tasks}")

    def check_windows(self, roles: tuple[str, ...], source: str | Path | None = None) -> None:
        """Refuse a role whose `max_tokens` leaves no room for a prompt in its model's context
        window, where the window is known without loading the model (`max_model_len`, or a local
        folder's config.json): otherwise every request fails after minutes of loading."""
        for role in roles:
            rc = self.role(role)
            check_window(role, rc, self.models[rc.model], source)

    def role(self, name: str) -> RoleConfig:
        if name not in ROLES:
            raise InputError(None, "role", f"unknown role '{name}'", ", ".join(ROLES))
        rc: RoleConfig | None = getattr(self, name)
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

    def trial_id(self, seed: int) -> str:
        """The trial id of `seed` in this run (the control study's event is part of it)."""
        return trial_id(seed, self.control.category, self.control.pressure)

    def trials(self) -> list[tuple[str, int]]:
        """(trial id, seed) of every trial this config runs, in order."""
        return [(self.trial_id(s), s) for s in self.trial_seeds()]

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.run_name


def check_window(role: str, rc: RoleConfig, spec: ModelSpec, source: str | Path | None = None) -> None:
    """Refuse `max_tokens` at or past the model's context window where it is known (see
    `RunConfig.check_windows`)."""
    from rollouts.model_config import model_window

    window = model_window(spec)
    if window is not None and rc.sampling.max_tokens >= window[0]:
        raise InputError(source, f"{role}.sampling.max_tokens",
                         f"{rc.sampling.max_tokens} tokens leave no room for a prompt in the {window[0]}-token "
                         f"window of model '{rc.model}' ({window[1]})", f"1 ... {window[0] - 1}")


def preflight(specs: Mapping[str, ModelSpec], source: str | Path | None) -> list[str]:
    """The backends' check before any server starts (`rollouts.backends.preflight`: GPUs visible and
    not shared, then each backend's own, e.g. vLLM's verdict on its argv), a refusal naming
    `source` and the entry's field. Returns notes to show (checks skipped)."""
    from rollouts.backends import preflight as check

    try:
        return check(specs)
    except SpecError as e:
        raise InputError(source, f"models.{e.key}.{e.field}", e.problem) from None


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
