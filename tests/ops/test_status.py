"""`lhd slurm status` reads run directories through the Run API, with the one trial-id rule: a
control study's trials (`s<seed>-cat-<category>`) are found, finished, in the shards and the run."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml
from typer.testing import CliRunner

from lhd_train.cli.app import app
from lhd_train.ops.status import run_status

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "runs" / "v1-control-study"
TRIAL = "s390185437-cat-MORAL_DILEMMA"


def _copy(tmp_path: Path, name: str) -> Path:
    run_dir = tmp_path / "runs" / name
    shutil.copytree(FIXTURE, run_dir)
    return run_dir


def _config(tmp_path: Path) -> Path:
    """The fixture's own config, pointed at tmp_path/runs."""
    cfg = yaml.safe_load((FIXTURE / "config.resolved.yaml").read_text())
    cfg["output_dir"] = str(tmp_path / "runs")
    path = tmp_path / "control.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def test_a_finished_control_study_run_reads_as_finished(tmp_path: Path) -> None:
    """Old code built `s<seed>` ids: '0/1 trials done, 0 rows', 'not started'."""
    run_dir = _copy(tmp_path, "fixture-v1")
    st = run_status(run_dir, use_slurm=False)
    run = st.get("run")
    assert (run.status, run.detail) == ("finished", "1/1 trials done, 3 rows")
    audit = st.get("audit", "tiny-full")
    assert (audit.status, audit.detail) == ("finished", "3 rounds labelled of 3")

    # the same through the command line, from the run directory
    res = CliRunner().invoke(app, ["slurm", "status", str(run_dir), "--no-slurm", "--json"])
    assert res.exit_code == 0, res.output
    rows = {(r["stage"], r["part"]): r for r in json.loads(res.output)["rows"]}
    assert rows[("run", "")]["status"] == "finished"


def test_a_control_study_config_finds_its_trials_in_the_run_and_its_shards(tmp_path: Path) -> None:
    """From the run config: the trial list is `RunConfig.trials`, as `lhd run` names the trials."""
    cfg = _config(tmp_path)
    _copy(tmp_path, "fixture-v1")
    run = run_status(cfg, use_slurm=False).get("run")
    assert (run.status, run.detail) == ("finished", "1/1 trials done, 3 rows")
    shutil.rmtree(tmp_path / "runs" / "fixture-v1")
    _copy(tmp_path, "fixture-v1-shard0of1")
    shard = run_status(cfg, use_slurm=False).get("rollout", "shard 0/1")
    assert (shard.status, shard.detail) == ("finished", "1/1 trials done, 3 rows")


def test_an_unfinished_and_a_damaged_trial(tmp_path: Path) -> None:
    run_dir = _copy(tmp_path, "fixture-v1")
    trial = run_dir / "trials"
    (trial / f"{TRIAL}.done").unlink()
    st = run_status(run_dir, use_slurm=False)
    assert (st.get("run").status, st.get("run").detail) == ("incomplete", "0/1 trials done, 3 rows")
    audit = st.get("audit", "tiny-full")
    assert audit.status == "finished"  # every round on disk is labelled

    # a marker over fewer rows than it recorded: what `lhd run` refuses, named, not counted as done
    lines = (trial / f"{TRIAL}.jsonl").read_text().splitlines(keepends=True)
    (trial / f"{TRIAL}.jsonl").write_text("".join(lines[:2]))
    shutil.copy(FIXTURE / "trials" / f"{TRIAL}.done", trial / f"{TRIAL}.done")
    run = run_status(run_dir, use_slurm=False).get("run")
    assert run.status == "damaged" and f"{TRIAL}.done" in run.detail and "3 rounds" in run.detail
