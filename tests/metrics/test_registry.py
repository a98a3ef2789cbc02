"""The registry of trial metrics (issue 32, item 4): a metric registered in one place reaches every
table of the report (per trial, runs, control, paired; HTML, Markdown and CSV), and no module but
the registry spells a summary's column names.

Every expected number is computed here from the severities the synthetic runs are written with."""
from __future__ import annotations

import ast
import csv
import html
import math
import re
import statistics
from pathlib import Path

import pytest
from markdown_tables import md_rows
from test_metrics import _old_bootstrap
from test_paired import _runs

from lhd_train.metrics.registry import METRICS, TrialLabels, trial_metric
from lhd_train.report import build_report

ROOT = Path(__file__).resolve().parents[2]
REGISTRY = ROOT / "lhd_train" / "metrics" / "registry.py"
# Per seed, four rounds: a severity > 0 is a flagged round with that severity (test_paired's format).
BASE = {1: [2, 0, 3, 0], 2: [1, 0, 0, 0], 3: [0, 0, 0, 0]}
LORA = {1: [0, 0, 2, 0], 2: [0, 0, 0, 0], 3: [4, 0, 0, 0]}


@pytest.fixture
def max_severity():
    """A metric the code base does not have: the largest severity among a trial's valid labels."""
    @trial_metric("max_severity", label="max severity", bounds=(0, 4), paired=True)
    def _max_severity(t: TrialLabels) -> float:
        return float(t.severity.max()) if t.n else float("nan")

    yield METRICS["max_severity"]
    del METRICS["max_severity"]


def _csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _html_tables(page: str) -> dict[str, list[dict[str, str]]]:
    """Every `<table class="data">` of a page by its id (`""` for one without), as rows of
    {column title: cell text}; a later table without an id replaces an earlier one."""
    out = {}
    for table_id, body in re.findall(r'<table class="data"(?: id="([^"]*)")?>(.*?)</table>', page, re.S):
        head = [html.unescape(h) for h in re.findall(r"<th>(.*?)</th>", body, re.S)]
        rows = re.findall(r"<tr>(.*?)</tr>", body.split("</thead>")[1], re.S)
        out[table_id] = [dict(zip(head, [html.unescape(re.sub(r"<[^>]+>", "", c)).strip()
                                         for c in re.findall(r"<td[^>]*>(.*?)</td>", r, re.S)], strict=True))
                         for r in rows]
    return out


def test_a_registered_metric_reaches_every_table_of_the_report(max_severity, tmp_path):
    a, b = _runs(tmp_path, BASE, LORA)
    out = tmp_path / "report"
    page = build_report([a, b], out).read_text()
    per_seed = {run: {s: float(max(v)) for s, v in sev.items()} for run, sev in (("base", BASE), ("lora", LORA))}

    per_trial = {(r["run"], r["trial_id"]): r for r in _csv(out / "tables" / "per_trial.csv")}
    for run, values in per_seed.items():
        for s, v in values.items():
            assert float(per_trial[(run, f"s{s}")]["max_severity"]) == v

    runs = {r["run"]: r for r in _csv(out / "tables" / "runs.csv")}
    md = {r["run"]: r for r in md_rows((out / "summary.md").read_text()) if "performer" in r}
    tables = _html_tables(page)
    shown = {r["run"]: r for r in tables["table-runs"]}
    for run, values in per_seed.items():
        x = list(values.values())
        mean, se = statistics.mean(x), statistics.stdev(x) / math.sqrt(len(x))
        r = runs[run]
        assert (float(r["max_severity_mean"]), float(r["max_severity_se"])) == pytest.approx((mean, se))
        assert (float(r["max_severity_ci_low"]), float(r["max_severity_ci_high"])) == pytest.approx(_old_bootstrap(x))
        assert float(r["max_severity_covered_mean"]) == pytest.approx(mean)  # every trial fully labelled
        cell = f"{mean:.3f} ± {se:.3f}"
        assert shown[run]["max severity"] == cell and md[run]["max severity"] == cell
    control = _csv(out / "tables" / "control.csv")
    assert sorted(float(r["max_severity_mean"]) for r in control) == pytest.approx([4 / 3, 2.0])

    # paired by seed: the table row, its CSV line, and the per-seed values
    diffs = [per_seed["lora"][s] - per_seed["base"][s] for s in BASE]
    [effect] = [r for r in _csv(out / "tables" / "paired.csv") if r["metric"] == "max_severity"]
    assert float(effect["mean_diff"]) == pytest.approx(statistics.mean(diffs)) and effect["n_pairs"] == "3"
    [row] = [r for r in tables["table-paired"] if r["metric"] == "max severity"]
    assert row["mean difference (run − base)"] == f"{statistics.mean(diffs):+.3f}"
    seeds = {r["trial_id"]: r for r in _csv(out / "tables" / "paired_trials.csv")}
    assert [float(seeds[f"s{s}"]["max_severity_diff"]) for s in BASE] == diffs
    # the trials table of the last run (lora), beside the trial's other numbers
    assert [float(r["max severity"]) for r in tables[""] if "trial" in r] == list(per_seed["lora"].values())


def test_the_registry_entry_is_gone_after_the_fixture(tmp_path):
    assert "max_severity" not in METRICS  # the test above registered it; nothing else names it


# ----------------------------------------------------------------------------- layout
SUMMARY_COLUMN = re.compile(r"\w*_(mean|se|ci_low|ci_high)")


def summary_column_strings(source: str) -> list[str]:
    """`line: 'text'` for each string literal (an f-string's text parts included) shaped like a
    summary's CSV column (`deception_rate_mean`, f"{m}_se", "_ci_low", ...): the column-name protocol
    the registry replaced, where code picked numbers out of a table by building its column names."""
    return [f"{node.lineno}: {node.value!r}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and SUMMARY_COLUMN.fullmatch(node.value)]


def test_the_column_name_finder_finds_them():
    src = ('a = df["deception_rate_mean"]\nb = row[f"{m}_se"]\nc = {f"{m}_covered_mean": 1}\n'
           'd = "mean of the trials"\ne = "rate_mean ± rate_se"\nf = df["mean_satisfaction"]\n')
    assert summary_column_strings(src) == ["1: 'deception_rate_mean'", "2: '_se'", "3: '_covered_mean'"]


def test_only_the_registry_spells_summary_columns():
    """Code reads `MetricSummary` fields; the CSV column names are spelled by `registry.csv_frame` alone."""
    found = []
    for path in sorted((ROOT / "lhd_train").rglob("*.py")):
        if path != REGISTRY:
            found += [f"{path.relative_to(ROOT)}:{hit}" for hit in summary_column_strings(path.read_text())]
    assert found == [], "summary column names outside lhd_train/metrics/registry.py:\n" + "\n".join(found)
    assert summary_column_strings(REGISTRY.read_text())  # the finder does see the registry's own


def test_the_headline_metric_is_named_by_the_registry_alone():
    """Issue 37 item 5: `HEADLINE` is the one metric registered with `headline=True`; every default that
    means "the headline" takes it from there, so no other module spells its name (the authors'
    summary.json keys, a file format, are the one exception)."""
    from lhd_train.metrics.registry import HEADLINE, METRICS

    assert METRICS[HEADLINE].headline and sum(m.headline for m in METRICS.values()) == 1
    formats = {REGISTRY, ROOT / "lhd_train" / "interop" / "reference_import.py"}
    found = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in sorted((ROOT / "lhd_train").rglob("*.py"))
             if path not in formats for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Constant) and node.value == HEADLINE]
    assert found == [], f"the headline metric spelled outside the registry: {found}"
