"""Issue 39 item 2: the report opens with the lite experiment's result (RUN/entitle-lite/), its
interval beside it, for the base and for the adapter against the base; recounted from lite.jsonl."""
from __future__ import annotations

import html as htmllib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from support.synthetic import R, write_run

from lhd_train.entitle.lite import ROWS, run_lite
from lhd_train.entitle.lite_prompts import X
from lhd_train.entitle.settings import EntitleRunCommand
from lhd_train.report import build_report
from lhd_train.report.headline import LITE

SHIFT = 1.5  # added to log P(X) in the adapter's full/none rows: its evidence effect is the base's + 1.5


def _evidence(lite: Path) -> dict[str, float]:
    rows = [json.loads(line) for line in (lite / ROWS).read_text().splitlines()]
    lp = {(r["fact"], r["cell"]): r["continuations"][X]["logprob"] for r in rows}
    return {f: lp[(f, "full/none")] - lp[(f, "deleted/none")] for f, _ in lp}


@pytest.fixture(scope="module")
def report(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lens.model import load_hf

    root = tmp_path_factory.mktemp("headline")
    no = (False, [], 0)
    runs = [write_run(root, name, {"s1": [R(1, None, label=no)]}, performer_model="tiny<llama>")
            for name in ("base", "honest")]
    model, tok = load_hf(str(tiny_llama_dir))
    run_lite(EntitleRunCommand(model_or_config=str(tiny_llama_dir), out=runs[0] / LITE, mode="lite",
                               pack="lhd_startup_consulting", facts=6, progress=False), model, tok)
    shutil.copytree(runs[0] / LITE, runs[1] / LITE)
    rows = [json.loads(line) for line in (runs[1] / LITE / ROWS).read_text().splitlines()]
    for r in rows:
        if r["cell"] == "full/none":
            r["continuations"][X]["logprob"] += SHIFT
    (runs[1] / LITE / ROWS).write_text("".join(json.dumps(r) + "\n" for r in rows))
    build_report(runs, root / "report")
    return root


def test_the_report_opens_with_the_lite_effects_and_their_intervals(report: Path) -> None:
    html = (report / "report" / "report.html").read_text()
    main = html[html.index("<main>"):]
    assert main.index('id="headline"') < main.index('id="runs"')  # the first block of the page
    block = main[main.index('id="headline"'):main.index('id="runs"')]
    base = _evidence(report / "base" / LITE)
    written = json.loads((report / "base" / LITE / "lite_summary.json").read_text())["outcomes"]["evidence"]
    lo, hi = written["ci95_task_bootstrap"]
    mean = float(np.mean(list(base.values())))
    rows = [[htmllib.unescape(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", tr, flags=re.S)]
            for tr in re.findall(r"<tr>(.*?)</tr>", block, flags=re.S) if "<td" in tr]
    [base_row] = [r for r in rows if r[0].startswith("base") and r[1] == "evidence"]
    positive = sum(v > 0 for v in base.values())
    assert base_row[2:5] == [f"{mean:+.2f}", f"[{lo:.2f}, {hi:.2f}]", f"{positive} / {len(base)}"]
    assert {"pressure_vs_mention", "pressure_vs_none"} <= {r[1] for r in rows}
    # the adapter against the base, paired by fact: exactly the shift, with a zero-width interval
    [paired] = [r for r in rows if " − " in r[0] and r[1] == "evidence"]
    assert paired[0].startswith("honest") and paired[2:5] == [f"{SHIFT:+.2f}", f"[{SHIFT:.2f}, {SHIFT:.2f}]",
                                                               f"{len(base)} / {len(base)}"]
    # model text is escaped: the run labels carry the performer's name
    assert "tiny<llama>" not in html and "tiny&lt;llama&gt;" in block
    summary = (report / "report" / "summary.md").read_text().splitlines()
    assert summary[2].startswith("Headline: the lite evidence-ablation experiment")
    assert any(line.startswith("- base") and f"evidence: {mean:+.2f} [{lo:.2f}, {hi:.2f}]" in line
               for line in summary[3:8])
