"""The options of `lhd data bon|dpo|grpo`, declared once: `DataOptions` (what a batch job may set
too) and `BuildSettings` (those plus what one build reads and writes: the run, the output folder,
the auditor config), which the command line validates (`lhd_train.cli.options`); the Slurm data stage
(`ops.slurm_vars.DataVars`) takes these fields as variables and renders them as the same flags
(`config.flags.to_argv`), so a default or a bound is written here only."""
from __future__ import annotations

from pathlib import Path

from pydantic import Field

from lhd_train.config.base import StrictModel
from lhd_train.config.vocab import Direction


class DataOptions(StrictModel):
    """How candidates are sampled, graded and selected."""

    n: int = Field(4, ge=1, description="candidates sampled per context")
    direction: Direction = Field("honest", description="which answers are chosen")
    eval_fraction: float = Field(0.2, ge=0, lt=1, description="share of trials held out")
    max_contexts: int | None = Field(None, ge=1, description="at most this many contexts (default: every one)")
    min_margin: float = Field(1.0, description="DPO: least severity gap between chosen and rejected")
    on_task_min: float = Field(-0.5, ge=-1, le=1, description="the on-task floor: the chosen answer's supervisor "
                                                              "satisfaction (in [-1, 1]) must reach it when rated")
    concurrency: int = Field(32, ge=1, le=4096, description="requests at once")
    run_auditor: str | None = Field(None, description="which of the run's auditors (a folder under audit/) labels "
                                                      "the original answers; default: the run's headline auditor, "
                                                      "as in the report")


class BuildSettings(DataOptions):
    """`lhd data bon|dpo|grpo RUN`: the data options plus what one build reads and writes."""

    run_dir: Path = Field(description="an audited run directory", json_schema_extra={"argument": True})
    out: Path = Field(description="output folder (dataset/, candidates.jsonl, grades.jsonl)")
    overrides: list[str] = Field([], description="auditor config overrides key=value",
                                 json_schema_extra={"argument": True})
    auditor_config: Path | None = Field(None, description="auditor config (default: the run's)",
                                        json_schema_extra={"flag": "--auditor"})
    original_from_run: bool = Field(False, description="grade each original answer by the run's own audit label "
                                    "and supervisor rating instead of grading it again (one auditor and one "
                                    "supervisor call less per context; the audit label then comes from the run's "
                                    "auditor view, not the grader's causal one)")
    judge_window: int | None = Field(None, ge=1, description="GRPO: the reward judge's window in tokens; a row whose "
                                     "audit prompt plus --completion-tokens and the auditor's reply is longer is "
                                     "dropped and counted (default: the run auditor's max_model_len)")
    judge_tokenizer: str | None = Field(None, description="GRPO: the tokenizer that counts for --judge-window "
                                        "(default: the run auditor's model; an estimate when it does not load)")
    completion_tokens: int = Field(512, ge=0, description="GRPO: room kept in the judge's window for the policy's "
                                   "completion (the recipe's trainer.max_completion_length)")
    progress: bool = Field(True, json_schema_extra={"cli": False})

    def cache_record(self) -> dict[str, object]:
        """What the folder's caches (candidates, grades) depend on (`data_folder.claim_folder`); the
        selection settings (direction, margins, kind) may change: dataset/ is rebuilt whole."""
        return {"run": str(Path(self.run_dir).resolve()), "n": self.n,
                "auditor_config": str(Path(self.auditor_config).resolve()) if self.auditor_config else None,
                "overrides": list(self.overrides)}
