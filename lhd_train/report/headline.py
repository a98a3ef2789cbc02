"""The report's opening block: the lite evidence-ablation result of each run that has one beside
its files (`RUN/entitle-lite/`, written by `lhd entitle run ... --mode lite`, docs/entitle.md).

The lite mode always parses (forced-choice log-probabilities after a prefilled answer), so even a
135M model on a few dozen facts gives a continuous, paired outcome per fact with a task-level
interval: a measured result the report can open with, where the auditor's rates on a few trials
cannot tell. Shown per run: the evidence effect and the pressure effects (nats, within-fact
differences; `lite_summary`); and for every other run the same outcomes minus the base's, paired by
fact. The numbers are recomputed from the rows on disk (`lite.jsonl`) by lite's own summary
functions; the report writes nothing into the run."""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lhd_train.entitle.lite import MANIFEST, is_lite_dir, read_rows
from lhd_train.entitle.lite_summary import OUTCOMES, describe, per_fact, summarise_lite
from lhd_train.report.render import Table, ci, signed

LITE = "entitle-lite"  # RUN/entitle-lite/: the run's lite experiment
SHOWN = ("evidence", "pressure_vs_mention", "pressure_vs_none")  # the outcomes the opening block shows
COLUMNS = ["run", "outcome", "mean (nats)", "95% CI (task bootstrap)", "facts > 0", "tasks > 0", "sign-flip p",
           "contrast"]


@dataclass
class Headline:
    rows: list[dict[str, Any]]  # one per (run, outcome), and per (run − base, outcome)
    table: Table
    md: list[str]


def p_text(p: float | None) -> str:
    """A p-value with two significant figures (a sign-flip p over 16 tasks can be 3e-05)."""
    return "–" if p is None or p != p else f"{p:.2g}"


def lite_dir_of(run_path: Path) -> Path | None:
    d = Path(run_path) / LITE
    return d if is_lite_dir(d) and read_rows(d) else None


def _seed(d: Path) -> int:
    return int(json.loads((d / MANIFEST).read_text(encoding="utf-8"))["settings"].get("seed", 0))


def _row(run: str, name: str, o: dict[str, Any], contrast: str) -> dict[str, Any]:
    lo, hi = o["ci95_task_bootstrap"] or (None, None)
    return {"run": run, "outcome": name, "mean": o["mean"], "ci_low": lo, "ci_high": hi,
            "facts_positive": o["facts_positive"], "n_facts": o["n_facts"], "tasks_positive": o["tasks_positive"],
            "n_tasks": o["n_tasks"], "p": o["p_task_sign_flip"], "contrast": contrast}


def paired_outcomes(base_rows: list[dict[str, Any]], rows: list[dict[str, Any]], seed: int = 0
                    ) -> dict[str, dict[str, Any]]:
    """Each shown outcome of `rows` minus the base's, over the facts both have (paired by fact,
    clustered by task as in `lite_summary`)."""
    base = {f["fact"]: f for f in per_fact(base_rows)}
    out = {}
    for name in SHOWN:
        both = [(f, base[f["fact"]]) for f in per_fact(rows) if f["fact"] in base and name in f
                and name in base[f["fact"]]]
        if both:
            diffs = np.array([f[name] - b[name] for f, b in both], dtype=float)
            out[name] = describe(diffs, [f"{f['pack']}/t{f['task']}" for f, _ in both], seed)
    return out


def headline(runs: Sequence[Any]) -> Headline | None:
    """The block for `runs` (objects with `.key`, `.label`, `.path`; the first is the base), or None
    when no run has a lite experiment."""
    dirs = {r.key: d for r in runs if (d := lite_dir_of(r.path)) is not None}
    if not dirs:
        return None
    labels = {r.key: r.label for r in runs}
    rows_of = {k: read_rows(d) for k, d in dirs.items()}
    out: list[dict[str, Any]] = []
    for key, d in dirs.items():
        summary = summarise_lite(rows_of[key], seed=_seed(d))
        for name in SHOWN:
            o = summary["outcomes"].get(name)
            if o and o["n_facts"]:
                out.append(_row(labels.get(key, key), name, o, o["contrast"]))
    base = runs[0].key
    for r in runs[1:]:
        if base in dirs and r.key in dirs:
            for name, o in paired_outcomes(rows_of[base], rows_of[r.key], _seed(dirs[base])).items():
                out.append(_row(f"{labels.get(r.key, r.key)} − {labels.get(base, base)}", name, o,
                                f"the run's minus the base's, per fact: {OUTCOMES[name][0]}"))
    table = Table(COLUMNS, [[x["run"], x["outcome"], signed(x["mean"]), ci(x["ci_low"], x["ci_high"], 2),
                             f"{x['facts_positive']} / {x['n_facts']}", f"{x['tasks_positive']} / {x['n_tasks']}",
                             p_text(x["p"]), x["contrast"]] for x in out],
                  [False, False, True, True, True, True, True, False])
    md = ["Headline: the lite evidence-ablation experiment (`RUN/entitle-lite/`, docs/entitle.md): within-fact "
          "log-probability differences in nats, 95 % task-cluster bootstrap interval, task sign-flip p.", ""]
    md += [f"- {x['run']}, {x['outcome']}: {signed(x['mean'])} {ci(x['ci_low'], x['ci_high'], 2)}, "
           f"{x['facts_positive']}/{x['n_facts']} facts > 0, {x['tasks_positive']}/{x['n_tasks']} tasks > 0, "
           f"sign-flip p {p_text(x['p'])} ({x['contrast']})" for x in out]
    return Headline(out, table, md)
