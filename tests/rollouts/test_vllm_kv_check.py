"""`lhd doctor --config` estimates each vLLM server's KV cache before anything starts (issue 30, B8):
gpu_memory_utilization x GPU memory - weights / TP - ~3 GiB, against one max_model_len sequence.
The expected numbers are worked out here by hand from the models' published sizes."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lhd_train.ops.doctor_checks import check_config
from rollouts.model_config import ModelShape
from rollouts.vllm.kv_check import GIB, RUNTIME_RESERVE, kv_rows

ROOT = Path(__file__).resolve().parents[2]
FLAGSHIP = ROOT / "configs" / "examples" / "vllm-llama8b.yaml"
H100 = 79.1  # GiB, torch's total_memory of an H100 SXM 80GB


def _tokens(detail: str) -> float:
    return float(detail.split(" GiB/GPU = ")[1].split("k tokens")[0]) * 1000


def test_parameter_counts_match_the_published_ones():
    import json

    cfg = json.loads((ROOT / "configs/models/llama-3.1-8b-instruct/config.json").read_text())
    assert ModelShape.parse(cfg).n_params == 8_030_261_248  # Llama-3.1-8B's model card / safetensors index
    cfg = json.loads((ROOT / "configs/models/qwen2.5-72b-instruct/config.json").read_text())
    assert abs(ModelShape.parse(cfg).n_params - 72.71e9) / 72.71e9 < 0.0005  # 72.71 B, q/k/v biases included


def test_the_flagship_servers_hold_their_window_on_h100():
    from lhd_train.config.run import load_config

    rows = {r[0]: r for r in kv_rows(load_config(FLAGSHIP).models, str(FLAGSHIP), H100)}
    assert rows["kv llama8b"][1] == "ok" and rows["kv qwen72b"][1] == "ok"
    # Llama-3.1-8B, TP 1: 0.9 x 79.1 GiB - 8.03e9 x 2 B - 3 GiB of KV at 32 layers x 8 heads x 128 x 2 x 2 B
    want = (0.9 * H100 * GIB - 8_030_261_248 * 2 - RUNTIME_RESERVE) / (2 * 32 * 8 * 128 * 2)
    assert _tokens(rows["kv llama8b"][2]) == pytest.approx(want, rel=0.002)
    assert "3.3 sequence(s) of max_model_len 131072" in rows["kv llama8b"][2]
    # Qwen2.5-72B, TP 4: weights / 4, the 8 KV heads split 2 per GPU
    want = (0.9 * H100 * GIB - 72.71e9 * 2 / 4 - RUNTIME_RESERVE) / (2 * 80 * 2 * 128 * 2)
    assert _tokens(rows["kv qwen72b"][2]) == pytest.approx(want, rel=0.01)


def test_a_server_whose_kv_cannot_hold_one_sequence_fails_before_it_starts(tmp_path):
    """Qwen2.5-72B on two 80 GB GPUs: 67.7 GiB of weights per GPU leave no room for a 131k sequence
    (docs/gpu.md: 'does not start'); vLLM would say so only after loading 145 GB of weights."""
    data = yaml.safe_load(FLAGSHIP.read_text())
    data["models"]["qwen72b"].update(tensor_parallel_size=2, gpus="1,2")
    cfg = tmp_path / "tp2.yaml"
    cfg.write_text(yaml.safe_dump(data))
    rows = {r[0]: r for r in check_config(cfg, H100)}
    status, detail = rows["kv qwen72b"][1:]
    assert status == "fail" and f"{cfg}: field 'models.qwen72b.gpu_memory_utilization'" in detail
    assert "0.0 sequence(s)" in detail and rows["kv llama8b"][1] == "ok"
    # on 141 GB H200s the same two GPUs hold it
    rows = {r[0]: r for r in check_config(cfg, 139.8)}
    assert rows["kv qwen72b"][1] == "ok"
