"""`lhd data bon|dpo` checks the models it starts together before any of them starts (issue 30, B6),
with `lhd run`'s own preflight: a vllm model whose GPUs are not visible (here: no GPU at all), or
two models on one GPU, is refused in one line naming the field, before the output folder is claimed
or a server starts. Before, the data stage found such a config only when a server exited."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_datasets import small_run  # noqa: F401  (module fixture: an audited-able two-task run, tiny models)

ROOT = Path(__file__).resolve().parents[2]


def _run_dir(tmp_path: Path, models: dict, auditor_key: str) -> Path:
    from lhd_train.config.run import parse_config
    from lhd_train.rundir.layout import RunDir
    from lhd_train.rundir.run import Run

    cfg = parse_config({"run_name": "r", "output_dir": str(tmp_path), "seeds": [1], "models": models,
                        "performer": {"model": "perf"}, "supervisor": {"model": "sup"},
                        "auditor": {"model": auditor_key}}, "test")
    rd = RunDir(cfg.run_dir)
    rd.config.parent.mkdir(parents=True, exist_ok=True)
    Run.at(rd.path).write_config(cfg.model_dump(mode="json"))
    return cfg.run_dir


def _lhd(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
           **(env_extra or {})}
    return subprocess.run([sys.executable, "-c", "from lhd_train.cli import main; main()", *args], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("kind", ["bon", "dpo"])
def test_lhd_data_refuses_gpus_it_cannot_have_before_anything_starts(kind, small_run, tmp_path):  # noqa: F811
    """A real run (trials with stored prompts) whose config now names vllm models on GPUs."""
    import shutil

    import yaml

    from lhd_train.rundir.layout import RunDir

    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    config = RunDir(run).config
    data = yaml.safe_load(config.read_text())
    data["models"] = {"tiny": {"backend": "vllm", "model": "meta-llama/Llama-3.1-8B-Instruct", "gpus": "0"}}
    config.write_text(yaml.safe_dump(data))
    out = tmp_path / "data"
    res = _lhd("data", kind, str(run), "--out", str(out))
    assert res.returncode == 2, res.stderr[-2000:]
    [line] = [x for x in res.stderr.splitlines() if x.startswith("error:")]
    assert "models.tiny.gpus" in line and "no GPU is visible" in line, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and not out.exists()


def test_the_data_stage_checks_the_auditor_beside_the_run_models(tmp_path):
    """The auditor from --auditor joins the check: on a node with 5 GPUs, an auditor file that puts
    its model on the performer's GPU is refused as a shared GPU (rollouts.gpus' rule)."""
    import yaml

    from lhd_train.config.data import BuildSettings
    from lhd_train.finetune.datasets import data_specs
    from rollouts.backends import check_gpus
    from rollouts.gpus import GpuAssignmentError

    models = {"perf": {"backend": "vllm", "model": "meta-llama/Llama-3.1-8B-Instruct", "gpus": "0"},
              "sup": {"backend": "vllm", "model": "Qwen/Qwen2.5-72B-Instruct", "tensor_parallel_size": 4,
                      "gpus": "1,2,3,4"}}
    run = _run_dir(tmp_path, models, "sup")
    aud = tmp_path / "auditor.yaml"
    aud.write_text(yaml.safe_dump({"models": {"sup": {"backend": "vllm", "model": "meta-llama/Llama-3.3-70B-Instruct",
                                                      "gpus": "0"}},
                                   "auditor": {"model": "sup"}}))
    specs, source = data_specs(BuildSettings(run_dir=run, out=tmp_path / "o", auditor_config=aud))
    assert set(specs) == {"perf", "sup", "auditor:sup"} and source == str(aud)
    with pytest.raises(GpuAssignmentError) as err:
        check_gpus(specs, visible=5)
    assert (err.value.key, err.value.field) == ("auditor:sup", "gpus") and "GPU position 0" in str(err.value)
    specs, _ = data_specs(BuildSettings(run_dir=run, out=tmp_path / "o"))  # the run's own auditor: one server
    assert set(specs) == {"perf", "sup"}
    check_gpus(specs, visible=5)
