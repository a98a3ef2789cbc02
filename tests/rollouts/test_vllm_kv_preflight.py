"""The preflight of `lhd run`/`audit`/`data` refuses a vLLM server whose KV cache cannot hold one
`max_model_len` sequence when a GPU is visible (issue 38, item 2): before, only `lhd doctor
--config` said so, and `lhd run` loaded a 72B for minutes before vLLM refused it.

This machine has no GPU: the GPU torch would report is given to `visible_gpu` (an H100 80GB, then
an H200), and vLLM's own argv verdict (`validate_vllm`, which needs a vLLM env) is left out; the
estimate itself is the real one, on the models' shipped config.json."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lhd_train.config.run import load_config, preflight
from lhd_train.errors import InputError
from rollouts.backend import SpecError
from rollouts.vllm import kv_check
from rollouts.vllm import preflight as vllm_preflight

ROOT = Path(__file__).resolve().parents[2]
FLAGSHIP = ROOT / "configs" / "examples" / "vllm-llama8b.yaml"
H100 = ("NVIDIA H100 80GB HBM3", 79.1 * kv_check.GIB)
H200 = ("NVIDIA H200", 139.8 * kv_check.GIB)


@pytest.fixture
def tp2(tmp_path) -> Path:
    """Qwen2.5-72B on two GPUs: 67.7 GiB of weights per GPU (docs/gpu.md: 'does not start' on H100)."""
    data = yaml.safe_load(FLAGSHIP.read_text())
    data["models"]["qwen72b"].update(tensor_parallel_size=2, gpus="1,2")
    path = tmp_path / "tp2.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_short_kv_cache_is_refused_when_a_gpu_is_visible(tp2, monkeypatch):
    specs = {k: s for k, s in load_config(tp2).models.items() if s.backend == "vllm"}
    monkeypatch.setattr(kv_check, "visible_gpu", lambda: H100)
    with pytest.raises(SpecError) as err:
        kv_check.refuse_short_kv(specs)
    assert err.value.key == "qwen72b" and err.value.field == "gpu_memory_utilization"
    assert "on NVIDIA H100 80GB HBM3 of 79.1 GiB, TP 2" in err.value.problem
    assert "0.0 sequence(s) of max_model_len 131072" in err.value.problem
    monkeypatch.setattr(kv_check, "visible_gpu", lambda: H200)
    assert kv_check.refuse_short_kv(specs) == []  # two 141 GB GPUs hold it
    monkeypatch.setattr(kv_check, "visible_gpu", lambda: None)
    assert kv_check.refuse_short_kv(specs) == []  # no GPU here (a login node): lhd doctor --config estimates


def test_the_run_preflight_names_the_file_and_field(tp2, monkeypatch):
    cfg = load_config(tp2)
    monkeypatch.setattr(kv_check, "visible_gpu", lambda: H100)
    monkeypatch.setattr(vllm_preflight, "validate_vllm", lambda specs, *a, **k: [])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    with pytest.raises(InputError) as err:
        preflight(cfg.models, tp2)
    msg = str(err.value)
    assert str(tp2) in msg and "models.qwen72b.gpu_memory_utilization" in msg and "refuse to start" in msg
    # the flagship (TP 4) passes the same preflight on the same GPU
    assert preflight(load_config(FLAGSHIP).models, FLAGSHIP) == []
