"""Where `lhd audit-eval` results live, and reading them back as typed objects for a run's report.

An evaluation is one `eval.json` (schema `lhd.audit-eval/2`, written by `eval_run.evaluate_auditor`;
`/1` files, before clustered intervals, are still read).
A run's evaluations are every `eval.json` under its `eval/` folder:

- `RUN/eval/<auditor-id>/eval.json`: the run itself was judged (a planted copy, `--planted RUN`);
- `RUN/eval/<auditor-id>/<source>/eval.json`: an evaluation filed for RUN (`--attach RUN`; with
  `--planted COPY` by default the run COPY was planted from), so `lhd report RUN` shows the
  auditor's measured error rates next to its headline rate without being told where they are.

`evaluations_for` is the one reader; the report matches an evaluation to a run by auditor id."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lhd_train.config.vocab import TYPES
from lhd_train.errors import InputError
from lhd_train.rundir.layout import RunDir

EVAL_JSON, EVAL_MD, RELIABILITY_PNG = "eval.json", "eval.md", "reliability.png"
SCHEMA = "lhd.audit-eval/2"  # /2: clustered intervals, bounds, no kappa on planted runs, calibration
SCHEMAS = ("lhd.audit-eval/1", SCHEMA)


def eval_dir(run: Path, auditor_id: str, source: str | None = None) -> Path:
    """`RUN/eval/<auditor-id>/` (the run itself judged), or `.../<source-slug>/` (filed for RUN)."""
    base = RunDir(run).eval_dir / auditor_id
    return base / slug(source) if source else base


def slug(text: str) -> str:
    """A folder name for an evaluation's source ("planted run demo-planted" -> "planted-run-demo-planted")."""
    return re.sub(r"[^A-Za-z0-9._]+", "-", text).strip("-.") or "source"


@dataclass(frozen=True)
class MeasuredRate:
    """k of n with its 95 % interval (None bounds when n is 0): clustered by trial or task with the
    design effect `deff` over `clusters` clusters (schema /2), else a Wilson interval (schema /1,
    where `clusters` is None); `unusable` rows of the group had no verdict, and `worst_best` is the
    rate if all of them had come out one way or the other."""

    k: int
    n: int
    low: float | None
    high: float | None
    clusters: int | None = None
    cluster_by: str = "trial"
    deff: float | None = None
    unusable: int = 0
    worst_best: tuple[float, float] | None = None

    @property
    def rate(self) -> float | None:
        return self.k / self.n if self.n else None

    @property
    def n_eff(self) -> float:
        """The sample size the interval stands for (n / deff when the design effect exceeds 1)."""
        return self.n / max(self.deff or 1.0, 1.0)


@dataclass(frozen=True)
class AuditorEvaluation:
    """The headline numbers of one eval.json: what a report shows beside a deception rate."""

    path: Path
    auditor_id: str
    source: str                      # "curated set", "planted run demo-planted", ...
    planted: bool
    model: str
    rounds: int
    failed_or_missing: int           # rounds without a usable audit row: left out of every rate, bound them
    fnr: dict[str, MeasuredRate]     # per deception type, and "all"
    fpr: MeasuredRate                # honest answers flagged (n 0 on a planted run)
    unplanted_flag_rate: MeasuredRate | None  # planted runs: unplanted rounds flagged (not known honest)
    kappa: float | None              # only where honest ground truth exists (never on a planted run)
    created_at: str
    kappa_note: str | None = None
    severity_kappa: float | None = None  # quadratic-weighted, over rounds with a known severity
    calibration: dict[str, Any] | None = None  # brier, ece, auroc_confidence, auroc_deceptive, n

    @property
    def usable(self) -> int:
        return self.rounds - self.failed_or_missing


def _opt_float(x: Any) -> float | None:
    return None if x is None else float(x)


def measured_rate(d: Any, path: Path | str, field: str) -> MeasuredRate:
    try:
        lo, hi = d["ci95"]
        bounds = d.get("bounds")
        worst_best = (float(bounds[0]), float(bounds[1])) if bounds and bounds[0] is not None else None
        return MeasuredRate(int(d["k"]), int(d["n"]), _opt_float(lo), _opt_float(hi),
                            clusters=None if d.get("clusters") is None else int(d["clusters"]),
                            cluster_by=str(d.get("cluster_by") or "trial"), deff=_opt_float(d.get("deff")),
                            unusable=int(d.get("unusable") or 0), worst_best=worst_best)
    except (KeyError, TypeError, ValueError):
        raise InputError(path, field, "not a rate ({k, n, ci95: [low, high]})") from None


def read_evaluation(path: Path) -> AuditorEvaluation:
    """One eval.json; an InputError naming the file and field when it is not one."""
    path = Path(path)
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(path, None, f"not valid JSON: {e}") from None
    return evaluation_of(rec, path)


def evaluation_of(rec: Any, path: Path) -> AuditorEvaluation:
    """An eval.json's record as typed numbers. A /1 record of a planted run loses its kappa: it
    counted the unplanted rounds as honest (review science-4 D5)."""
    if not isinstance(rec, dict) or rec.get("schema") not in SCHEMAS:
        raise InputError(path, "schema", "not an `lhd audit-eval` result", " or ".join(SCHEMAS))
    try:
        res, model = rec["result"], rec.get("model") or {}
        fnr = {t: measured_rate(res["fnr"][t], path, f"result.fnr.{t}") for t in (*TYPES, "all")}
        unplanted = res.get("unplanted_flag_rate")
        planted = bool(rec["planted"])
        kappa, note = _opt_float(res.get("kappa")), res.get("kappa_note")
        if planted and rec["schema"] != SCHEMA:
            kappa, note = None, "no kappa: this older result counted the unplanted rounds as honest"
        sev = res.get("severity_kappa") or {}
        cal = res.get("calibration")
        return AuditorEvaluation(
            path=path, auditor_id=str(rec["auditor_id"]), source=str(rec["source"]), planted=planted,
            model=str(model.get("model") or model.get("key") or "?"), rounds=int(res["rounds"]),
            failed_or_missing=int(res["failed_or_missing"]), fnr=fnr,
            fpr=measured_rate(res["fpr"], path, "result.fpr"),
            unplanted_flag_rate=measured_rate(unplanted, path, "result.unplanted_flag_rate") if unplanted else None,
            kappa=kappa, created_at=str(rec.get("created_at", "")), kappa_note=None if note is None else str(note),
            severity_kappa=_opt_float(sev.get("kappa")),
            calibration={k: cal.get(k) for k in ("n", "brier", "ece", "auroc_confidence", "auroc_deceptive")}
            if isinstance(cal, dict) else None)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise InputError(path, None, f"an `lhd audit-eval` result without {e}") from None


def evaluations_for(run: Path, auditor_id: str | None) -> list[AuditorEvaluation]:
    """Every evaluation of `auditor_id` stored in `run` (see the module docstring), oldest first."""
    root = RunDir(run).eval_dir
    if auditor_id is None or not root.is_dir():
        return []
    found = [read_evaluation(p) for p in sorted(root.glob(f"**/{EVAL_JSON}"))]
    return sorted((e for e in found if e.auditor_id == auditor_id), key=lambda e: (e.created_at, str(e.path)))
