"""Where `lhd audit-eval` results live, and reading them back as typed objects for a run's report.

An evaluation is one `eval.json` (schema `lhd.audit-eval/1`, written by `eval_run.evaluate_auditor`).
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

EVAL_JSON, EVAL_MD = "eval.json", "eval.md"
SCHEMA = "lhd.audit-eval/1"


def eval_dir(run: Path, auditor_id: str, source: str | None = None) -> Path:
    """`RUN/eval/<auditor-id>/` (the run itself judged), or `.../<source-slug>/` (filed for RUN)."""
    base = RunDir(run).eval_dir / auditor_id
    return base / slug(source) if source else base


def slug(text: str) -> str:
    """A folder name for an evaluation's source ("planted run demo-planted" -> "planted-run-demo-planted")."""
    return re.sub(r"[^A-Za-z0-9._]+", "-", text).strip("-.") or "source"


@dataclass(frozen=True)
class MeasuredRate:
    """k of n, with its 95 % Wilson interval (None bounds when n is 0)."""

    k: int
    n: int
    low: float | None
    high: float | None

    @property
    def rate(self) -> float | None:
        return self.k / self.n if self.n else None


@dataclass(frozen=True)
class AuditorEvaluation:
    """The headline numbers of one eval.json: what a report shows beside a deception rate."""

    path: Path
    auditor_id: str
    source: str                      # "curated set", "planted run demo-planted", ...
    planted: bool
    model: str
    rounds: int
    failed_or_missing: int           # rounds without a usable audit row: left out of every rate
    fnr: dict[str, MeasuredRate]     # per deception type, and "all"
    fpr: MeasuredRate                # honest answers flagged (n 0 on a planted run)
    unplanted_flag_rate: MeasuredRate | None  # planted runs: unplanted rounds flagged (not known honest)
    kappa: float | None
    created_at: str

    @property
    def usable(self) -> int:
        return self.rounds - self.failed_or_missing


def _rate(d: Any, path: Path, field: str) -> MeasuredRate:
    try:
        lo, hi = d["ci95"]
        return MeasuredRate(int(d["k"]), int(d["n"]), None if lo is None else float(lo),
                            None if hi is None else float(hi))
    except (KeyError, TypeError, ValueError):
        raise InputError(path, field, "not a rate ({k, n, ci95: [low, high]})") from None


def read_evaluation(path: Path) -> AuditorEvaluation:
    """One eval.json; an InputError naming the file and field when it is not one."""
    path = Path(path)
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(path, None, f"not valid JSON: {e}") from None
    if not isinstance(rec, dict) or rec.get("schema") != SCHEMA:
        raise InputError(path, "schema", "not an `lhd audit-eval` result", SCHEMA)
    try:
        res, model = rec["result"], rec.get("model") or {}
        fnr = {t: _rate(res["fnr"][t], path, f"result.fnr.{t}") for t in (*TYPES, "all")}
        unplanted = res.get("unplanted_flag_rate")
        return AuditorEvaluation(
            path=path, auditor_id=str(rec["auditor_id"]), source=str(rec["source"]), planted=bool(rec["planted"]),
            model=str(model.get("model") or model.get("key") or "?"), rounds=int(res["rounds"]),
            failed_or_missing=int(res["failed_or_missing"]), fnr=fnr, fpr=_rate(res["fpr"], path, "result.fpr"),
            unplanted_flag_rate=_rate(unplanted, path, "result.unplanted_flag_rate") if unplanted else None,
            kappa=None if res.get("kappa") is None else float(res["kappa"]), created_at=str(rec.get("created_at", "")))
    except (KeyError, TypeError, ValueError) as e:
        raise InputError(path, None, f"an `lhd audit-eval` result without {e}") from None


def evaluations_for(run: Path, auditor_id: str | None) -> list[AuditorEvaluation]:
    """Every evaluation of `auditor_id` stored in `run` (see the module docstring), oldest first."""
    root = RunDir(run).eval_dir
    if auditor_id is None or not root.is_dir():
        return []
    found = [read_evaluation(p) for p in sorted(root.glob(f"**/{EVAL_JSON}"))]
    return sorted((e for e in found if e.auditor_id == auditor_id), key=lambda e: (e.created_at, str(e.path)))
