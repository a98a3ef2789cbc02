"""`lens.model.with_adapter`: the lens model that `lhd entitle read` and lite mode read with holds
the adapter's weights, merged, and reads what the adapter model itself computes."""
from __future__ import annotations

from pathlib import Path

import torch


def test_a_merged_adapter_reads_as_the_adapter_model(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lens.model import load_hf, with_adapter

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                           init_lora_weights=False))  # random B: the adapter changes outputs
    peft.save_pretrained(tmp_path / "adapter")
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.no_grad():
        want = peft(input_ids=ids).logits

    model, _ = load_hf(str(tiny_llama_dir))
    assert with_adapter(model, None) is model
    with torch.no_grad():
        plain = model.hf(input_ids=ids).logits
    merged = with_adapter(model, str(tmp_path / "adapter"))
    with torch.no_grad():
        got = merged.hf(input_ids=ids).logits
    assert not torch.allclose(plain, want, atol=1e-4)  # the adapter matters here
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert merged.name.endswith("+" + str(tmp_path / "adapter")) and not merged.hf.training
