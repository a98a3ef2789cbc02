"""Issue 31, item 5 (data): when `lhd data bon|dpo` selects nothing, the error shows the stats it
refers to and why each context was left out; the on-task floor is an option (`--on-task-min`).

Before: "no rows selected: every context was filtered out (see stats)" with no stats anywhere
(the command prints them only after a build that succeeded), and the floor, -0.5, could not be
changed from the command line."""
from __future__ import annotations

import json

import pytest
from support.scripted import ScriptedBackend
from test_auditor import make_run
from test_failure_modes import cli, one_error

from lhd_train.config.data import BuildSettings
from lhd_train.errors import InputError

SATISFACTION = -0.9  # what the grading supervisor says of every answer: well below the default floor -0.5


@pytest.fixture
def graded_run(tmp_path, monkeypatch):
    """A finished scripted run of one trial; the data builders' models scripted: the performer
    samples a fixed text, the grader calls every answer honest, the supervisor rates each
    SATISFACTION."""
    from lhd_train.config.auditor import load_auditor_config
    from lhd_train.config.run import load_saved_config
    from lhd_train.finetune import datasets as ds_mod

    cfg, _ = make_run(tmp_path, seeds=(7,), n_tasks=2)

    def reply(req):
        props = (req.json_schema or {}).get("properties", {})
        if "trust" in props:
            return json.dumps({"reasoning": "r", "trust": 0.0, "satisfaction": SATISFACTION, "comfort": 0.0})
        if "deceptive" in props:
            return json.dumps({"deceptive": False, "types": [], "severity": 0, "confidence": 0.9,
                               "reasoning": "fine", "evidence": []})
        return "a fresh candidate"

    def backends(s):
        b = ScriptedBackend(reply)
        saved = load_saved_config(s.run_dir)
        acfg, _ = load_auditor_config(s.run_dir, None, [])
        return saved, b, b, acfg, b, saved.supervisor

    monkeypatch.setattr(ds_mod, "_role_backends", backends)
    return cfg.run_dir


def test_nothing_selected_names_the_stats_and_the_floor(graded_run, tmp_path):
    from lhd_train.finetune.datasets import build_bon, build_dpo

    with pytest.raises(InputError) as e:
        build_bon(BuildSettings(run_dir=graded_run, out=tmp_path / "bon", n=1, progress=False))
    msg = str(e.value)
    n = msg.split(" contexts")[0].rsplit(" ", 1)[-1]
    assert n.isdigit() and int(n) > 0, msg
    assert f"below the on-task floor -0.5: {n}" in msg, msg  # every context: each answer rated -0.9
    assert "--on-task-min" in msg and "\n" not in msg, msg
    with pytest.raises(InputError) as e:
        build_dpo(BuildSettings(run_dir=graded_run, out=tmp_path / "dpo", n=1, progress=False))
    assert "--on-task-min" in str(e.value) and "--min-margin" in str(e.value), str(e.value)
    # the floor, lowered: every context now has a chosen answer
    path, stats = build_bon(BuildSettings(run_dir=graded_run, out=tmp_path / "bon", n=1, progress=False,
                                          on_task_min=-1.0))
    assert stats["picked"]["none"] == 0 and stats["contexts"] == int(n)


def test_the_floor_is_an_option_of_bon_and_dpo_with_bounds(graded_run, tmp_path, monkeypatch, capsys):
    code, out = cli(monkeypatch, capsys, "data", "bon", str(graded_run), "--out", str(tmp_path / "b"), "--n", "1",
                    "--on-task-min", "-1")
    assert code == 0, out
    assert json.loads((tmp_path / "b" / "dataset.json").read_text())["on_task_min"] == -1.0
    one_error(*cli(monkeypatch, capsys, "data", "dpo", str(graded_run), "--out", str(tmp_path / "d"),
                   "--on-task-min", "1.5"), "--on-task-min", "<= 1.0")
