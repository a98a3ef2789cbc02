"""Base vs adapter without a judge: `lhd entitle compare` on two scripted experiments whose
answers differ in known cells, recounted from the trial files; and the experiment read by the
ordinary run commands (`report`, `view`, `export`)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from entitle_disk import answers_on_disk
from entitle_script import SampledScripted, script
from scipy.stats import binomtest
from typer.testing import CliRunner

from lhd_train.bench.taskpack import load_pack
from lhd_train.cli.app import app
from lhd_train.entitle.compare import compare
from lhd_train.entitle.items import build_items
from lhd_train.entitle.run import run_entitle
from lhd_train.entitle.settings import EntitleRunCommand
from lhd_train.entitle.store import EntitleDir
from lhd_train.errors import InputError

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
        rows[d] = {r["id"]: r for r in answers_on_disk(d)}
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
    # the verdict comes from the sign-flip test over tasks: every task's mean change is negative
    n_tasks = len({(r["pack"], r["task"]) for r in answers_on_disk(base)})
    assert fab["cluster_test"]["n_tasks"] == n_tasks and fab["cluster_test"]["p"] == pytest.approx(2 / 2 ** n_tasks)
    assert fab["verdict"] == "lower than the base (better)"
    assert c["measures"]["support"]["verdict"].startswith("cannot tell")  # the full and altered cells are the same
    # the unparsed share is a measure of its own, over every pair: the "chatter" answers, in both
    unp = c["measures"]["unparsed"]
    n_chatter = sum(r["label"] == "unparsed" for r in answers_on_disk(base))
    assert (unp["both"], unp["a_only"], unp["b_only"]) == (n_chatter, 0, 0)
    res = CliRunner().invoke(app, ["entitle", "compare", str(base), str(other)])
    assert res.exit_code == 0 and "fabrication" in res.output
    with pytest.raises(InputError, match="settings.seed"):
        compare(EntitleDir(base), EntitleDir(experiment(tmp_path / "other-seed", seed=1)))


def test_an_experiment_compared_with_itself_is_refused(tmp_path):
    """Issue 40.3: the real command, one experiment given twice (also through another spelling)."""
    base = experiment(tmp_path / "base")
    for other in (base, tmp_path / "." / "base"):
        res = CliRunner().invoke(app, ["entitle", "compare", str(base), str(other)])
        assert res.exit_code != 0 and "is the base experiment itself" in str(res.exception) + res.output


def test_the_run_commands_read_the_experiment(tmp_path):
    """report, view and export read the experiment as the ordinary run it is; their rows are its answers."""
    base = experiment(tmp_path / "base")
    rows = answers_on_disk(base)
    runner = CliRunner()
    res = runner.invoke(app, ["export", str(base), "--out", str(tmp_path / "ds")])
    assert res.exit_code == 0, res.output
    from datasets import load_from_disk

    ds = load_from_disk(str(tmp_path / "ds"))
    assert sorted(ds["trial_id"]) == sorted(r["trial_id"] for r in rows)
    by_trial = {r["trial_id"]: r for r in rows}
    assert all(by_trial[t]["answer"] == text for t, text in zip(ds["trial_id"], ds["performer_text"], strict=True))
    res = runner.invoke(app, ["report", str(base), "--out", str(tmp_path / "rep")])
    assert res.exit_code == 0 and (tmp_path / "rep" / "report.html").is_file(), res.output
    res = runner.invoke(app, ["view", str(base), "--out", str(tmp_path / "view")])
    assert res.exit_code == 0 and (tmp_path / "view" / "index.html").is_file(), res.output
    assert json.loads((base / "manifest.json").read_text())["kind"] == "entitle experiment"
