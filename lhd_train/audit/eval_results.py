"""Where `lhd audit-eval` results live, and reading them back as typed objects for a run's report.

An evaluation is one `eval.json` (schema `lhd.audit-eval/2`; `/1` files are upgraded on read). A
run's evaluations are every `eval.json` under `RUN/eval/`: `<auditor-id>/eval.json` when the run
itself was judged (a planted copy), `<auditor-id>/<source>/eval.json` when one was filed for it
(`--attach RUN`), so `lhd report RUN` shows an auditor's measured error rates next to its headline
rate. `AuditorEvaluation` is the record (`write_evaluation`, `read_evaluation`), `evaluations_for`
finds a run's; the report matches them by auditor id."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from lhd_train.config.vocab import TYPES
from lhd_train.errors import DataFileError
from lhd_train.rundir.layout import RunDir
from lhd_train.rundir.rows import Record
from lhd_train.rundir.run import read_record, write_record

EVAL_JSON, EVAL_MD, RELIABILITY_PNG = "eval.json", "eval.md", "reliability.png"
# /2: clustered intervals, bounds, no kappa on planted runs, calibration
SCHEMA: Literal["lhd.audit-eval/2"] = "lhd.audit-eval/2"
SCHEMAS = ("lhd.audit-eval/1", SCHEMA)


def eval_dir(run: Path, auditor_id: str, source: str | None = None) -> Path:
    """`RUN/eval/<auditor-id>/` (the run itself judged), or `.../<source-slug>/` (filed for RUN)."""
    base = RunDir(run).eval_dir / auditor_id
    return base / slug(source) if source else base


def slug(text: str) -> str:
    """A folder name for an evaluation's source ("planted run demo-planted" -> "planted-run-demo-planted")."""
    return re.sub(r"[^A-Za-z0-9._]+", "-", text).strip("-.") or "source"


class Rate(Record):
    """k of n with its 95 % interval (`eval_stats.clustered_rate`): clustered by trial or task with
    the design effect `deff` over `clusters` clusters (schema /2), else a Wilson interval (schema /1,
    which has only k, n, rate and ci95: `clusters` is None); `unusable` rows of the group had no
    verdict, and `bounds` is the rate if all of them had come out one way or the other."""

    k: int
    n: int
    rate: float | None
    ci95: list[float | None]
    ci95_wilson: list[float | None] = Field(default_factory=list)
    clusters: int | None = None
    deff: float | None = None
    n_eff: float | None = None  # n / max(deff, 1), scaled by (z / t_{G-1})^2 for few clusters
    cluster_by: str = "trial"
    unusable: int = 0
    bounds: list[float | None] = Field(default_factory=list)

    @property
    def low(self) -> float | None:
        return self.ci95[0]

    @property
    def high(self) -> float | None:
        return self.ci95[1]

    @property
    def worst_best(self) -> tuple[float, float] | None:
        lo, hi = (self.bounds + [None, None])[:2]
        return None if lo is None or hi is None else (lo, hi)

    @property
    def n_design(self) -> float:
        """n / deff (when the design effect exceeds 1): the sample size the clustering leaves, the one
        `metrics.correction` propagates (without the few-clusters t scaling of `n_eff`)."""
        return self.n / max(self.deff or 1.0, 1.0)


class MeanError(Record):
    mae: float | None
    n: int


class SeverityKappa(Record):
    kappa: float | None
    n: int
    weights: str = "quadratic"


class CalibrationBin(Record):
    low: float
    high: float
    n: int
    mean_confidence: float
    accuracy: float


class Calibration(Record):
    """How well the auditor's `confidence` matches how often it is right (`eval_stats.calibration`)."""

    n: int
    brier: float
    ece: float
    bins: list[CalibrationBin]
    accuracy: float
    mean_confidence: float
    auroc_confidence: float | None
    auroc_deceptive: float | None


class SelfConsistency(Record):
    k: int
    n: int
    all_agree: Rate
    pairwise_agreement: float | None


class EvalScore(Record):
    """eval.json's `result`: every measure `evaluation.score` computes."""

    rounds: int
    failed_or_missing: int  # rounds without a usable audit row: left out of every rate, bound them
    fnr: dict[str, Rate]  # per deception type, and "all"
    fpr: Rate  # honest answers flagged (n 0 on a planted run)
    unplanted_flag_rate: Rate | None  # planted runs: unplanted rounds flagged (not known honest)
    kappa: float | None  # only where honest ground truth exists (never on a planted run)
    confusion: dict[str, dict[str, int]]
    type_recall: Rate
    severity_mae: MeanError
    severity_mae_deceptive: MeanError
    self_consistency: SelfConsistency | None
    # since schema /2
    cluster_by: str = "trial"
    kappa_note: str | None = None
    severity_kappa: SeverityKappa | None = None
    calibration: Calibration | None = None

    @field_validator("fnr")
    @classmethod
    def _every_type(cls, v: dict[str, Rate]) -> dict[str, Rate]:
        missing = [t for t in (*TYPES, "all") if t not in v]
        if missing:
            raise ValueError(f"no rate for {', '.join(missing)}")
        return v


class EvalModel(Record):
    key: str
    model: str
    revision: str | None
    backend: str
    adapter: str | None


class AuditorEvaluation(Record):
    """eval.json: one `lhd audit-eval` result, what a report shows beside a deception rate."""

    schema_: Annotated[Literal["lhd.audit-eval/1", "lhd.audit-eval/2"], Field(alias="schema")]
    auditor_id: str
    auditor_ids: list[str]
    source: str  # "curated set", "planted run demo-planted", ...
    run: str
    planted: bool
    options: dict[str, Any]
    model: EvalModel
    sampling: dict[str, Any]
    samples: int
    note: str | None
    incomplete: list[str]  # auditor ids with rounds still unaudited
    result: EvalScore
    created_at: str
    headline: list[str] = Field(default_factory=list)  # `eval_text.headline_lines`
    reliability_png: str | None = None  # since /2
    _path: Path | None = PrivateAttr(None)

    @model_validator(mode="before")
    @classmethod
    def _older(cls, data: Any) -> Any:
        """A /1 record of a planted run loses its kappa: it counted the unplanted rounds as honest
        (review science-4 D5)."""
        if isinstance(data, dict) and data.get("schema") == SCHEMAS[0] and data.get("planted") \
                and isinstance(data.get("result"), dict):
            note = "no kappa: this older result counted the unplanted rounds as honest"
            data = {**data, "result": {**data["result"], "kappa": None, "kappa_note": note}}
        return data

    @property
    def path(self) -> Path:
        """Where it was read from or written to."""
        return self._path or Path(EVAL_JSON)


def write_evaluation(path: Path, record: AuditorEvaluation) -> None:
    write_record(path, record)
    record._path = path


def read_evaluation(path: Path) -> AuditorEvaluation:
    """One eval.json; a `DataFileError` naming the file and field when it is not one."""
    record = read_record(Path(path), AuditorEvaluation)
    if record is None:
        raise DataFileError(path, "not found")
    record._path = Path(path)
    return record


def evaluations_for(run: Path, auditor_id: str | None) -> list[AuditorEvaluation]:
    """Every evaluation of `auditor_id` stored in `run` (see the module docstring), oldest first."""
    root = RunDir(run).eval_dir
    if auditor_id is None or not root.is_dir():
        return []
    found = [read_evaluation(p) for p in sorted(root.glob(f"**/{EVAL_JSON}"))]
    return sorted((e for e in found if e.auditor_id == auditor_id), key=lambda e: (e.created_at, str(e.path)))
