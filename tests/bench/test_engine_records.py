"""`lhd run` reads and writes its run directory as typed records: a finished run written by an
earlier main (tests/data/runs/v1-control-study) is summarised from its `RoundRow`s without a
model, with the same accounting as when it was written."""
from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import yaml

from lhd_train.bench.engine import run_benchmark
from lhd_train.config.run import parse_config
from lhd_train.rundir.run import Run

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "runs" / "v1-control-study"


def test_a_finished_v1_run_is_summarised_from_its_rows_without_a_model(tmp_path: Path) -> None:
    run_dir = tmp_path / "fixture-v1"
    shutil.copytree(FIXTURE, run_dir)
    data = yaml.safe_load((FIXTURE / "config.resolved.yaml").read_text())
    cfg = parse_config({**data, "output_dir": str(tmp_path)}, "fixture config")
    assert [tid for tid, _ in cfg.trials()] == Run.open(FIXTURE).manifest().trials  # the one trial-id rule

    results = asyncio.run(run_benchmark(cfg, progress=False))  # its model folder does not exist: none loads

    before, after = Run.open(FIXTURE).summary(), Run.open(run_dir).summary()
    assert before is not None and after is not None and before.trials and after.trials
    assert (run_dir / "manifest.json").read_bytes() == (FIXTURE / "manifest.json").read_bytes()  # nothing ran
    assert after.usage_by_role == before.usage_by_role  # the same counts from the typed rows
    volatile = {"seconds", "resumed_rounds"}
    assert [t.model_dump(exclude=volatile) for t in after.trials] == \
        [t.model_dump(exclude=volatile) for t in before.trials]
    assert [(r.trial_id, r.status, r.resumed_rounds) for r in results] == [(after.trials[0].trial_id, "done", 3)]
