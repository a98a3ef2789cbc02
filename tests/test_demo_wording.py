"""Issue 31, item 5 (demo): the README says what `scripts/demo.py` builds.

Before: the README said the demo "builds best-of-2 SFT data" while the demo ran `lhd data bon
--n 1`, which samples one answer per context and prints "best-of-1". The number of samples in the
demo's data step, the README's sentence and the demo's own account of what it cut must agree.

Issue 39, item 2: `make demo` is cut to ~6 minutes (best-of-1: the run's answer and one sample)
and `--full` keeps the larger demo (best-of-2); each says so, and the README names the one that
`make demo` runs."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _demo():
    spec = importlib.util.spec_from_file_location("demo_script", ROOT / "scripts" / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _n(profile) -> int:
    args = profile.data_args
    assert args[0] == "bon"
    return int(args[args.index("--n") + 1])


def test_the_readme_names_the_demos_best_of_n():
    demo = _demo()
    n = _n(demo.SMOLLM2)
    readme = (ROOT / "README.md").read_text()
    said = re.findall(r"best-of-(\d+) SFT data", readme)
    assert said == [str(n)], said
    assert f"best-of-{n} (the original + {n} sample" in demo.SMOLLM2.cut, demo.SMOLLM2.cut
    full = _n(demo.SMOLLM2_FULL)
    assert full >= 2, "the full demo chooses among samples"
    assert f"original + {full} samples" in demo.SMOLLM2_FULL.cut, demo.SMOLLM2_FULL.cut
    assert f"`--full`: best-of-{full}" in demo.SMOLLM2.cut, demo.SMOLLM2.cut


def _commands(steps) -> list[tuple[str, ...]]:
    return [s.args for s in steps]


def test_every_stage_runs_and_the_lite_results_land_where_the_report_opens_them():
    """The cut demo still runs every stage, each model's lite experiment writes RUN/entitle-lite/
    (the folder the report's headline reads) before the report, and the generative experiment
    runs only with --full."""
    from lhd_train.report.headline import LITE

    demo = _demo()
    for profile, generative in ((demo.SMOLLM2, False), (demo.SMOLLM2_FULL, True), (demo.TINY, False)):
        pl = demo.plan(profile)
        main = [*pl.pre, *pl.train, *pl.after]
        verbs = [a[:2] if a[0] in ("lens", "data", "entitle") else a[:1] for a in _commands(main)]
        assert verbs == [("run",), ("audit",), ("data", profile.data_args[0]), ("train",), ("run",), ("audit",),
                         *([("entitle", "run"), ("entitle", "run"), ("entitle", "compare")] * generative)], verbs
        assert [a[:3] for a in _commands(pl.side)[1:]] == [("lens", "probe", "build"), ("lens", "fit", profile.model),
                                                          ("lens", "read", profile.model)]
        lites = [pl.side[0].args, *_commands(pl.side2)]
        assert [a[a.index("--out") + 1] for a in lites] == [f"{pl.run_dir}/{LITE}", f"{pl.adapter_run_dir}/{LITE}"]
        assert all(a[:3] == ("entitle", "run", profile.model) and "lite" in a for a in lites)
        assert "--adapter" not in lites[0] and lites[1][lites[1].index("--adapter") + 1] == pl.adapter
        assert pl.train[0].args[-1] == f"output_dir={pl.adapter.removesuffix('/adapter')}"
        assert _commands(pl.report) == [("report", pl.run_dir, pl.adapter_run_dir, "--out", pl.report_dir, "--note",
                                         f"the demo cut: {profile.cut}")]  # the report says what the demo cut
    assert "generative experiment runs only with `--full`" in demo.SMOLLM2.cut
