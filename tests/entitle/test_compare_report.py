"""Base vs adapter without a judge: `lhd entitle compare` and the report's judge-free section, on
two scripted experiments whose answers differ in known cells; recounted from answers.jsonl."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from entitle_script import SampledScripted, script
from scipy.stats import binomtest
from support.synthetic import R, write_run
from typer.testing import CliRunner

from lhd_train.bench.taskpack import load_pack
from lhd_train.cli.app import app
from lhd_train.entitle.compare import compare
from lhd_train.entitle.items import build_items
from lhd_train.entitle.run import run_entitle
from lhd_train.entitle.settings import EntitleRunCommand
from lhd_train.entitle.store import EntitleDir
from lhd_train.errors import InputError
from lhd_train.report import build_report

PACK = "lhd_startup_consulting"
N = 8
HONEST = {("deleted", "none"): lambda k: "abstain", ("deleted", "demand"): lambda k: "abstain"}


def experiment(out: Path, rules=None, seed=0) -> Path:
    pack = load_pack(PACK)
    items, _ = build_items(pack, N, seed=seed)
    reply, _ = script(pack, items, rules=rules)
    run_entitle(EntitleRunCommand(model_or_config="scripted", out=out, pack=PACK, facts=N, seed=seed, progress=False),
                backend=SampledScripted(reply))
    return out


def expected_fabrication_pairs(base: Path, other: Path) -> tuple[int, int, int]:
    """(pairs, base only, other only) on 'a figure without evidence', counted from the files."""
    rows = {}
    for d in (base, other):
        rows[d] = {r["id"]: r for r in map(json.loads, (d / "answers.jsonl").read_text().splitlines())}
    pairs = a_only = b_only = 0
    for k, a in rows[base].items():
        b = rows[other][k]
        if a["files"] not in ("deleted", "control") or "unparsed" in (a["label"], b["label"]):
            continue
        fa, fb = a["label"] in ("fabricated", "capitulated"), b["label"] in ("fabricated", "capitulated")
        pairs, a_only, b_only = pairs + 1, a_only + (fa and not fb), b_only + (fb and not fa)
    return pairs, a_only, b_only


def test_compare_pairs_answers_and_tests_the_change(tmp_path):
    base, other = experiment(tmp_path / "base"), experiment(tmp_path / "adapter", HONEST)
    c = compare(EntitleDir(base), EntitleDir(other))
    fab = c["measures"]["fabrication"]
    pairs, a_only, b_only = expected_fabrication_pairs(base, other)
    assert (fab["n_pairs"], fab["a_only"], fab["b_only"]) == (pairs, a_only, b_only)
    assert (a_only, b_only) == (N // 2 + N, 0)  # even facts stop inventing; every capitulation stops
    assert fab["p_mcnemar"] == pytest.approx(binomtest(0, a_only, 0.5).pvalue)
    assert fab["diff"] == pytest.approx(-a_only / pairs) and fab["ci95"][1] < 0
    assert fab["verdict"] == "lower than the base (better)"
    assert c["measures"]["support"]["verdict"] == "cannot tell"  # the full and altered cells are the same
    res = CliRunner().invoke(app, ["entitle", "compare", str(base), str(other)])
    assert res.exit_code == 0 and "fabrication" in res.output
    with pytest.raises(InputError, match="settings.seed"):
        compare(EntitleDir(base), EntitleDir(experiment(tmp_path / "other-seed", seed=1)))


def test_report_shows_the_judge_free_comparison(tmp_path):
    no = (False, [], 0)
    runs = [write_run(tmp_path, name, {"s1": [R(1, None, label=no)]}) for name in ("base", "honest")]
    experiment(runs[0] / "entitle")
    experiment(runs[1] / "entitle", HONEST)
    out = tmp_path / "report"
    build_report(runs, out)
    html = (out / "report.html").read_text()
    assert 'id="entitle"' in html and 'id="table-entitle-paired"' in html
    summary = (out / "summary.md").read_text()
    assert "Judge-free" in summary and "honest vs base, fabrication" in summary
    with (out / "tables" / "entitle_paired.csv").open() as f:
        [fab] = [r for r in csv.DictReader(f) if r["measure"] == "fabrication"]
    pairs, a_only, b_only = expected_fabrication_pairs(runs[0] / "entitle", runs[1] / "entitle")
    assert (int(fab["pairs"]), int(fab["base_only"]), int(fab["run_only"])) == (pairs, a_only, b_only)
    with (out / "tables" / "entitle_rates.csv").open() as f:
        rates = {(r["run"], r["measure"], r["cell"]): r for r in csv.DictReader(f)}
    assert (int(rates[("base", "fabrication", "deleted/none")]["k"]),
            int(rates[("honest", "fabrication", "deleted/none")]["k"])) == (N // 2, 0)
