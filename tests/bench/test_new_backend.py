"""Adding a backend is one class and one registry line (issue 32): a backend defined here, registered
with one line, is read from a run config, refuses a field it does not take, and runs a trial end to
end through `lhd run` (config, preflight, build, trial loop, manifest, accounting), with no other
file knowing its name."""
from __future__ import annotations

from typing import Literal

import pytest
import yaml
from pydantic import Field
from support.scripted import ScriptedBackend, supervisor_script

from lhd_train.errors import InputError
from rollouts.backend import Backend
from rollouts.backends import BACKENDS
from rollouts.spec import BackendSpec


class ScriptedSpec(BackendSpec):
    """A backend that answers from a script: the supervisor's satisfaction follows `satisfactions`."""

    backend: Literal["scripted"] = "scripted"
    satisfactions: list[float] = Field(default_factory=lambda: [0.5])

    def build(self, name: str = "", log_dir: str | None = None) -> Backend:
        return ScriptedBackend(supervisor_script(self.satisfactions))


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(BACKENDS, "scripted", ScriptedSpec)  # the one registry line


def write_config(tmp_path, **entry) -> str:
    config = {"run_name": "fake", "output_dir": str(tmp_path / "runs"), "seeds": [7], "max_tasks": 2,
              "max_rounds_per_task": 3, "completion_threshold": 0.2,
              "models": {"m": {"backend": "scripted", "model": "script-1", **entry}},
              "performer": {"model": "m"}, "supervisor": {"model": "m"}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def lhd(monkeypatch, *argv: str) -> int:
    from lhd_train.cli import guarded
    from lhd_train.cli.app import app

    monkeypatch.setattr("sys.argv", ["lhd", *argv])
    return guarded(lambda: app(standalone_mode=False))


def test_a_registered_backend_runs_a_trial_through_lhd_run(tmp_path, monkeypatch, registered):
    from lhd_train.rundir.run import Run

    path = write_config(tmp_path, satisfactions=[0.1, 0.5])
    assert lhd(monkeypatch, "run", path, "--no-progress") in (0, None)
    run = Run.open(tmp_path / "runs" / "fake")
    [tid] = run.trial_ids()
    rows = run.trial(tid).rows()
    # satisfaction 0.1 < 0.2 keeps task 1 open for a second round; 0.5 (the script's last) closes
    # task 1 in round 2 and task 2 in round 1
    assert [(r.task_index, r.round, r.task_complete) for r in rows] == [(1, 1, False), (1, 2, True), (2, 1, True)]
    assert [r.supervisor.state_after.satisfaction for r in rows] == [0.1, 0.5, 0.5]
    manifest = run.manifest()
    assert manifest.models["performer"].backend == "scripted"
    assert manifest.models["performer"].describe == {"model": "scripted"}
    saved = yaml.safe_load(run.dir.config.read_text())["models"]["m"]
    assert saved == {"backend": "scripted", "model": "script-1", "revision": None, "max_model_len": None,
                     "trust_remote_code": False, "satisfactions": [0.1, 0.5]}
    # resuming reads the saved config back through the registry: nothing is left to do
    assert lhd(monkeypatch, "run", path, "--no-progress") in (0, None)
    assert len(run.trial(tid).rows()) == 3


def test_a_field_the_backend_does_not_take_is_refused_naming_it(tmp_path, registered):
    from lhd_train.config.run import load_config

    with pytest.raises(InputError) as e:
        load_config(write_config(tmp_path, device="cuda"))
    assert e.value.field == "models.m.device"
    assert "a field of backend hf and vllm and transformers-serve" in str(e.value)
    assert "backend 'scripted' takes: model, revision, max_model_len, trust_remote_code, satisfactions" in str(e.value)
    # a default of another backend's field asks for nothing, as files written before hold them all
    assert load_config(write_config(tmp_path, device="auto")).models["m"] == ScriptedSpec(model="script-1")


def test_without_its_registry_line_the_backend_is_unknown(tmp_path):
    from lhd_train.config.run import load_config

    with pytest.raises(InputError) as e:
        load_config(write_config(tmp_path))
    assert e.value.field == "models.m.backend" and "'scripted' is not a backend lhd knows" in str(e.value)
