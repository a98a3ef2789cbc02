"""The report's judge-free section: the evidence-ablation experiment (`lhd entitle`, docs/entitle.md)
of each run that has one in `RUN/entitle/`, and every run's answers paired with the base run's.

`lhd entitle run CONFIG --out RUN/entitle` puts the experiment beside a run's files (a folder of
its own, like `RUN/data/`), where `lhd report` finds it without a flag. Its numbers come from code
labels, not from an auditor, so base against adapter here does not rest on the quantity an
adapter may have been trained on."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from lhd_train.entitle.compare import compare
from lhd_train.entitle.store import EntitleDir
from lhd_train.errors import InputError
from lhd_train.report.render import Table, ci, fmt, signed

ENTITLE = "entitle"  # RUN/entitle/: the run's evidence-ablation experiment
HEADLINE = [("fabrication", "deleted/none"), ("fabrication", "deleted/demand"), ("fabrication", "control/none"),
            ("capitulation", "full/demand"), ("support", "full/none")]


@dataclass
class EntitleSection:
    tables: dict[str, pd.DataFrame]
    ctx: dict[str, Any]
    md: list[str] = field(default_factory=list)


def entitle_dir_of(run_path: Path) -> EntitleDir | None:
    d = EntitleDir(Path(run_path) / ENTITLE)
    return d if d.exists() and d.summary_path.is_file() else None


def entitle_section(runs: Sequence[Any]) -> EntitleSection | None:
    """The section for `runs` (objects with `.key`, `.label`, `.path`; the first is the base), or
    None when no run has an experiment."""
    dirs = {r.key: d for r in runs if (d := entitle_dir_of(r.path)) is not None}
    if not dirs:
        return None
    labels = {r.key: r.label for r in runs}
    rate_rows = []
    for key, d in dirs.items():
        rates = d.summary().get("rates") or {}
        for measure, cell in HEADLINE:
            r = (rates.get(measure) or {}).get(cell)
            if r:
                rate_rows.append({"run": key, "measure": measure, "cell": cell, "k": r["k"], "n": r["n"],
                                  "rate": r["rate"], "ci_low": r["ci95"][0], "ci_high": r["ci95"][1],
                                  "unparsed": r["n_unparsed"]})
    base = runs[0]
    paired_rows, notes = [], []
    if base.key in dirs:
        for r in runs[1:]:
            if r.key not in dirs:
                continue
            try:
                c = compare(dirs[base.key], dirs[r.key])
            except InputError as e:
                notes.append(f"{r.key}: its entitle answers cannot be paired with the base's ({e})")
                continue
            for measure, m in c["measures"].items():
                paired_rows.append({"run": r.key, "base": base.key, "measure": measure, "pairs": m["n_pairs"],
                                    "rate_base": m["rate_a"], "rate_run": m["rate_b"], "diff": m["diff"],
                                    "ci_low": m["ci95"][0], "ci_high": m["ci95"][1], "base_only": m["a_only"],
                                    "run_only": m["b_only"], "p_mcnemar": m["p_mcnemar"], "verdict": m["verdict"]})
    elif len(dirs) > 1:
        notes.append(f"the base run {base.key} has no {ENTITLE}/ experiment: nothing to pair the others with")
    rates_df, paired_df = pd.DataFrame(rate_rows), pd.DataFrame(paired_rows)
    ctx = {
        "rates": Table(["run", "measure", "cell", "rate", "95% CI (bootstrap over tasks)", "k / n", "unparsed"],
                        [[labels.get(x["run"], x["run"]), x["measure"], x["cell"], fmt(x["rate"]),
                          ci(x["ci_low"], x["ci_high"]), f"{x['k']} / {x['n']}", str(x["unparsed"])]
                         for x in rate_rows], [False, False, False, True, True, True, True]),
        "paired": Table(["run (against the base)", "measure", "paired answers", "base rate", "run rate",
                          "difference (run − base)", "95% CI (bootstrap over tasks)", "base only / run only",
                          "McNemar exact p", "verdict"],
                         [[labels.get(x["run"], x["run"]), x["measure"], str(x["pairs"]), fmt(x["rate_base"]),
                           fmt(x["rate_run"]), signed(x["diff"], 3), ci(x["ci_low"], x["ci_high"]),
                           f"{x['base_only']} / {x['run_only']}", fmt(x["p_mcnemar"], 4), x["verdict"]]
                          for x in paired_rows], [False, False, True, True, True, True, True, True, True, False])
        if paired_rows else None,
        "notes": notes,
    }
    md = ["", "Judge-free (the evidence-ablation experiment, labels made by code; docs/entitle.md; 95 % bootstrap "
          "intervals over tasks):", ""]
    md += [f"- {x['run']}, {x['measure']} {x['cell']}: {fmt(x['rate'])} {ci(x['ci_low'], x['ci_high'])} "
           f"({x['k']}/{x['n']}, {x['unparsed']} unparsed)" for x in rate_rows]
    md += [f"- {x['run']} vs {x['base']}, {x['measure']}: {x['pairs']} paired answers, {fmt(x['rate_base'])} → "
           f"{fmt(x['rate_run'])}, difference {signed(x['diff'], 3)} {ci(x['ci_low'], x['ci_high'])}, "
           f"base only / run only {x['base_only']}/{x['run_only']}, McNemar p {fmt(x['p_mcnemar'], 4)}: "
           f"{x['verdict']}" for x in paired_rows]
    md += [f"- {n}" for n in notes]
    return EntitleSection({"entitle_rates": rates_df, "entitle_paired": paired_df}, ctx, md)
