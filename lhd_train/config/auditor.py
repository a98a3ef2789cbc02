"""Which model audits, with which options, under which auditor id.

The model comes from the run's own `config.resolved.yaml` (its `auditor` role and `models`) or
from an auditor config file holding just those two keys (docs/auditing.md, "Auditor config").
`AuditOptions` holds the audit's options, declared once for the command line, YAML and Slurm
(`AuditCommand` adds what one `lhd audit` reads); `DEFAULT_OPTIONS` are its defaults."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field, field_validator, model_validator

from lhd_train.config.base import StrictModel, apply_overrides, relative_to_file, validate
from lhd_train.config.run import ModelMap, RoleConfig
from lhd_train.config.vocab import Mode
from lhd_train.errors import InputError
from lhd_train.io.files import read_yaml_mapping
from lhd_train.rundir.layout import RunDir
from lhd_train.rundir.names import name_problem
from rollouts.backends import ModelSpec


class AuditorConfig(StrictModel):
    """An auditor config file: `models:` (like a run config's) and `auditor:` (a role)."""

    models: ModelMap = Field(description="model key -> model spec, as in a run config (keys are plain names)")
    auditor: RoleConfig = Field(description="model key, sampling, adapter, max_attempts")
    prompts_dir: str | None = Field(None,
                                    description="folder with auditor_system.md / auditor_instruction.md overrides")

    @model_validator(mode="after")
    def _model_known(self) -> AuditorConfig:
        if self.auditor.model not in self.models:
            raise ValueError(f"auditor.model: '{self.auditor.model}' is not defined in models "
                             f"(allowed: {', '.join(self.models) or 'none defined'})")
        return self

    @property
    def spec(self) -> ModelSpec:
        return self.models[self.auditor.model]


MAX_WINDOW = 10_000  # rounds either side: more than any trial has (20 tasks x max_rounds_per_task)


class RenderOptions(StrictModel):
    """What the auditor may see. Defaults match the reference (everything shown)."""

    model_config = ConfigDict(frozen=True)

    hide_supervisor: bool = False  # private evaluation reasoning, states, feedback reasoning
    hide_event_labels: bool = False  # event name, category, pressure (the name encodes the category)


class AuditOptions(StrictModel):
    """How to audit: mode, window, what is hidden, the auditor id, how many rounds at once."""

    model_config = ConfigDict(frozen=True)

    mode: Mode = Field("full", description="full, window, causal or task")
    window: int = Field(6, ge=0, le=MAX_WINDOW, description="R for --mode window: 2R+1 rounds around the target "
                        f"(at most {MAX_WINDOW}: a wider window is --mode full)")
    hide_supervisor: bool = Field(False, description="hide the supervisor's private reasoning and states")
    hide_event_labels: bool = Field(False, description="hide event names, categories and pressure levels")
    auditor_id: str | None = Field(None, description="default: <model key>-<mode>[...]")
    concurrency: int = Field(64, ge=1, description="rounds in flight at once")
    include_unfinished: bool = Field(False, description="also audit trials without a .done marker")

    @field_validator("auditor_id")
    @classmethod
    def _plain_id(cls, v: str | None) -> str | None:
        if v is not None and (problem := name_problem(v)):
            raise InputError(None, "auditor-id", problem)  # the id names a folder under audit/
        return v

    @property
    def render(self) -> RenderOptions:
        return RenderOptions(hide_supervisor=self.hide_supervisor, hide_event_labels=self.hide_event_labels)

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
        d = self.model_dump()
        d.pop("concurrency")  # how fast, not what: may change between resumptions
        d.pop("include_unfinished")
        d["window"] = self.window_or_none
        return d


DEFAULT_OPTIONS = AuditOptions()


class _AuditCommandBase(AuditOptions):
    """A command that takes the audit options among its own."""

    @property
    def options(self) -> AuditOptions:
        """The audit options alone, as `audit_run` takes them."""
        return AuditOptions.model_validate(self.model_dump(include=set(AuditOptions.model_fields)))


class AuditCommand(_AuditCommandBase):
    """`lhd audit RUN [key=value ...]`: the audit options plus what one audit reads. The command
    line (`lhd_train.cli.options`) and the Slurm audit stage (`ops.slurm_vars.AuditVars`, which takes the
    `AuditOptions` fields as its variables) share these declarations."""

    run: Path = Field(description="run directory (runs/<run>)", json_schema_extra={"argument": True})
    overrides: list[str] = Field([], description="key.sub=value overrides of the auditor config",
                                 json_schema_extra={"argument": True})
    auditor: Path | None = Field(None, description="auditor config YAML (models: + auditor:); default: the run's "
                                                   "config")
    progress: bool = Field(True, description="show the progress bar")


class AuditEvalCommand(_AuditCommandBase):
    """`lhd audit-eval`: the audit options (as `lhd audit` declares them) plus which labelled
    answers are judged and where the results go."""

    overrides: list[str] = Field([], description="key.sub=value overrides of the auditor config",
                                 json_schema_extra={"argument": True})
    labelled_set: str | None = Field(None, description="curated: the labelled set shipped with lhd; or a JSON file in "
                                                       "its format (e.g. a subset of it)",
                                     json_schema_extra={"flag": "--set"})
    planted: Path | None = Field(None, description="a planted copy made by `lhd audit-plant`")
    out: Path | None = Field(None, description="results folder (default for --planted: PLANTED/eval/<auditor-id>)")
    auditor: Path | None = Field(None, description="auditor config YAML (models: + auditor:)")
    samples: int = Field(1, ge=1, description="audit k times (auditor ids <id>-k1..k) for self-consistency")
    attach: Path | None = Field(None, description="also file the results in this run's eval/ folder, where `lhd "
                                                  "report RUN` shows them (default with --planted: the run the copy "
                                                  "was planted from)")
    no_attach: bool = Field(False, description="file the results nowhere but --out")
    progress: bool = Field(True, description="show the progress bar")


def load_auditor_config(run_dir: Path, auditor_config: Path | None = None,
                        overrides: list[str] | None = None) -> tuple[AuditorConfig, str]:
    """The auditor settings and the file they came from. Overrides (`auditor.sampling.max_tokens=256`,
    `models.big.device=cuda`) apply to the `models`/`auditor` mapping before validation."""
    if auditor_config is not None:
        source = Path(auditor_config)
        data = read_yaml_mapping(source)
        unknown = sorted(set(data) - set(AuditorConfig.model_fields))
        if unknown:
            raise InputError(source, unknown[0], "unknown key", ", ".join(AuditorConfig.model_fields))
    else:
        source = RunDir(run_dir).config
        if not source.is_file():
            raise InputError(source, None, "not found: is this a run directory? (or pass --auditor CONFIG)")
        full = read_yaml_mapping(source)
        data = {k: full[k] for k in ("models", "auditor", "prompts_dir") if full.get(k) is not None}
    data = apply_overrides(data, overrides or [])
    if not data.get("auditor"):
        raise InputError(source, "auditor", "no auditor role is configured; add one (auditor: {model: KEY}), "
                         "pass an override auditor.model=KEY, or pass --auditor CONFIG")
    cfg = validate(AuditorConfig, data, source)
    # Relative model paths in an auditor file are relative to that file, so configs travel with models.
    if auditor_config is not None:
        for spec in cfg.models.values():
            spec.model = relative_to_file(spec.model, source)
    return cfg, str(source)
