"""Which model audits, with which options, under which auditor id.

The model comes from the run's own `config.resolved.yaml` (its `auditor` role and `models`) or
from an auditor config file holding just those two keys (docs/auditing.md, "Auditor config")."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from lhd_train.audit.trajectory import MODES, RenderOptions
from lhd_train.config import RoleConfig, apply_overrides
from lhd_train.rundir.files import read_yaml_mapping
from lhd_train.errors import InputError
from lhd_train.rundir.layout import RunDir
from lhd_train.rundir.names import name_problem
from rollouts.spec import ModelSpec


class AuditorConfig(BaseModel):
    """An auditor config file: `models:` (like a run config's) and `auditor:` (a role)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    models: dict[str, ModelSpec] = Field(description="model key -> model spec, as in a run config")
    auditor: RoleConfig = Field(description="model key, sampling, adapter, max_attempts")
    prompts_dir: str | None = Field(None, description="folder with auditor_system.md / auditor_instruction.md overrides")

    @model_validator(mode="after")
    def _model_known(self) -> "AuditorConfig":
        if self.auditor.model not in self.models:
            raise ValueError(f"auditor.model: '{self.auditor.model}' is not defined in models "
                             f"(allowed: {', '.join(self.models) or 'none defined'})")
        return self

    @property
    def spec(self) -> ModelSpec:
        return self.models[self.auditor.model]


@dataclass(frozen=True)
class AuditOptions:
    mode: str = "full"
    window: int = 6
    hide_supervisor: bool = False
    hide_event_labels: bool = False
    auditor_id: str | None = None
    concurrency: int = 64
    include_unfinished: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InputError(None, "mode", f"unknown mode {self.mode!r}", ", ".join(MODES))
        if self.window < 0:
            raise InputError(None, "window", f"{self.window} must be >= 0")
        if self.concurrency < 1:
            raise InputError(None, "concurrency", f"{self.concurrency} must be >= 1")
        if self.auditor_id is not None and (problem := name_problem(self.auditor_id)):
            raise InputError(None, "auditor-id", problem)  # the id names a folder under audit/

    @property
    def render(self) -> RenderOptions:
        return RenderOptions(self.hide_supervisor, self.hide_event_labels)

    @property
    def window_or_none(self) -> int | None:
        return self.window if self.mode == "window" else None

    def resolved_id(self, model_key: str) -> str:
        """Default id: `<model key>-<mode>` (`-window<R>` for windows), plus `-nosup` /
        `-nolabels` when something is hidden, so differently-informed auditors never mix."""
        if self.auditor_id:
            return self.auditor_id
        aid = f"{model_key}-{'window' + str(self.window) if self.mode == 'window' else self.mode}"
        if self.hide_supervisor:
            aid += "-nosup"
        if self.hide_event_labels:
            aid += "-nolabels"
        return re.sub(r"[^A-Za-z0-9._-]+", "_", aid)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("concurrency")  # how fast, not what: may change between resumptions
        d.pop("include_unfinished")
        d["window"] = self.window_or_none
        return d


def _validation_error(e: ValidationError, source: str | Path) -> InputError:
    from lhd_train.taskpack import input_error_from_validation

    return input_error_from_validation(e, source, AuditorConfig)


def _read_yaml(path: Path) -> dict[str, Any]:
    return read_yaml_mapping(path)


def load_auditor_config(run_dir: Path, auditor_config: Path | None = None,
                        overrides: list[str] | None = None) -> tuple[AuditorConfig, str]:
    """The auditor settings and the file they came from. Overrides (`auditor.sampling.max_tokens=256`,
    `models.big.device=cuda`) apply to the `models`/`auditor` mapping before validation."""
    if auditor_config is not None:
        source = Path(auditor_config)
        data = _read_yaml(source)
        unknown = sorted(set(data) - set(AuditorConfig.model_fields))
        if unknown:
            raise InputError(source, unknown[0], "unknown key", ", ".join(AuditorConfig.model_fields))
    else:
        source = RunDir(run_dir).config
        if not source.is_file():
            raise InputError(source, None, "not found: is this a run directory? (or pass --auditor CONFIG)")
        full = _read_yaml(source)
        data = {k: full[k] for k in ("models", "auditor", "prompts_dir") if full.get(k) is not None}
    data = apply_overrides(data, overrides or [])
    if not data.get("auditor"):
        raise InputError(source, "auditor", "no auditor role is configured; add one (auditor: {model: KEY}), "
                         "pass an override auditor.model=KEY, or pass --auditor CONFIG")
    try:
        cfg = AuditorConfig.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e, source) from None
    # Relative model paths in an auditor file are relative to that file, so configs travel with models.
    if auditor_config is not None:
        for spec in cfg.models.values():
            p = Path(spec.model)
            if not p.is_absolute() and (source.parent / p).exists():
                spec.model = str((source.parent / p).resolve())
    return cfg, str(source)
