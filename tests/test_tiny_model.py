"""Tiny random models: tokenizer round trip through AutoTokenizer, chat template, determinism."""
from __future__ import annotations

import json

import pytest

from lhd_train.tiny_model import (
    CHAT_TEMPLATE,
    IM_END,
    PAD_TOKEN,
    SIDECAR,
    build_tiny_model,
    builtin_corpus,
    tiny_model_command,
    train_tokenizer,
)

TEXTS = [
    'Hello {"score": 12345, "confidence": -3.14e5, "flag": true}\n\n  tabs\tand  spaces',
    "ünïcødé 日本語 emoji 🙂 and numbers 0 7 42 1000000",
    "The supervisor asked for the Q3 report by Friday; the data were incomplete.",
    "<think>private</think>```json\n{\"a\": [1, 2, null]}\n```",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>",
]


@pytest.fixture(scope="module")
def trained_tokenizer():
    return train_tokenizer(builtin_corpus(), vocab_size=2048)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_autotokenizer_gives_the_trained_ids(arch, request, trained_tokenizer):
    from transformers import AutoConfig, AutoTokenizer

    path = request.getfixturevalue(f"tiny_{arch}_dir")
    assert AutoConfig.from_pretrained(path).model_type == arch
    auto = AutoTokenizer.from_pretrained(path)
    for text in TEXTS:
        assert auto(text)["input_ids"] == trained_tokenizer(text)["input_ids"], (arch, text)
        assert auto.decode(auto(text)["input_ids"]) == text
    msgs = [{"role": "system", "content": "sys 12"}, {"role": "user", "content": TEXTS[0]}]
    assert auto.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False) == \
        trained_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    assert auto.eos_token == IM_END and auto.pad_token == PAD_TOKEN


def test_chat_template_system_generation_prompt_and_assistant_mask(tiny_llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert tok.chat_template == CHAT_TEMPLATE
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                    "<|im_start|>assistant\nhello there<|im_end|>\n")
    prompt = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    enc = tok.apply_chat_template(msgs, return_dict=True, return_assistant_tokens_mask=True)
    ids = [i for i, m in zip(enc["input_ids"], enc["assistant_masks"], strict=True) if m]
    assert tok.decode(ids) == "hello there<|im_end|>"


def test_model_files_sidecar_and_generation_config(tiny_qwen3_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = json.loads((tiny_qwen3_dir / SIDECAR).read_text())
    assert info["arch"] == "qwen3" and info["seed"] == 0 and info["hidden_size"] == 64
    assert info["num_layers"] == 2 and info["vocab_size"] == 2048
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir)
    tok = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    cfg = model.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.max_position_embeddings == 8192 and cfg.vocab_size == 2048 >= len(tok)
    assert model.generation_config.eos_token_id == tok.convert_tokens_to_ids(IM_END) == tok.eos_token_id
    assert model.generation_config.pad_token_id == tok.pad_token_id
    assert sum(p.numel() for p in model.parameters()) == info["n_params"]


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_same_seed_same_weights_and_vocab(tmp_path, tiny_llama_dir):
    import torch

    corpus = builtin_corpus()
    again = build_tiny_model("llama", tmp_path / "again", seed=0, corpus=corpus)
    other = build_tiny_model("llama", tmp_path / "other", seed=1, corpus=corpus)
    a, b, c = _weights(tiny_llama_dir), _weights(again), _weights(other)
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].dim() > 1)
    vocab = lambda p: json.loads((p / "tokenizer.json").read_text())["model"]  # noqa: E731
    assert vocab(tiny_llama_dir) == vocab(again) == vocab(other)


def test_command_writes_a_loadable_model(tmp_path):
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from lhd_train.cli.app import app
    from lhd_train.errors import InputError

    out = tmp_path / "m"
    r = CliRunner().invoke(app, ["tiny-model", "--arch", "qwen2", "--out", str(out), "--seed", "3", "--hidden-size",
                                 "32", "--layers", "1"])
    assert r.exit_code == 0 and f"wrote tiny qwen2 model to {out}: " in r.stdout, r.output
    assert "2048), chatml chat template, seed 3" in r.stdout, r.stdout
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 1
    assert json.loads((out / SIDECAR).read_text())["seed"] == 3
    with pytest.raises(InputError, match="arch"):
        tiny_model_command("gpt2", tmp_path / "bad")


def test_chat_styles_imitate_their_families(tmp_path):
    """The lens position tests need Llama-3-like and Qwen-like templates; one builder makes them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lhd_train.errors import InputError

    msgs = [{"role": "user", "content": "  hello  "}]
    llama = build_tiny_model("llama", tmp_path / "l3", corpus=["hello world"] * 5, chat_style="llama3",
                             tie_word_embeddings=False, vocab_size=400)
    tok = AutoTokenizer.from_pretrained(llama)
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>")
    assert "<|start_header_id|>user<|end_header_id|>\n\nhello<|eot_id|>" in text  # content trimmed
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tok.convert_ids_to_tokens(ids[:2]) == ["<|begin_of_text|>", "<|start_header_id|>"]  # single tokens
    assert tok.eos_token == "<|eot_id|>"
    model = AutoModelForCausalLM.from_pretrained(llama)
    assert model.config.bos_token_id == tok.bos_token_id and not model.config.tie_word_embeddings
    assert json.loads((llama / SIDECAR).read_text())["chat_style"] == "llama3"

    qwen = build_tiny_model("qwen3", tmp_path / "q3", corpus=["hello world"] * 5, chat_style="qwen", vocab_size=400)
    text = AutoTokenizer.from_pretrained(qwen).apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n")
    with pytest.raises(InputError, match="chat-style"):
        tiny_model_command("llama", tmp_path / "bad", chat_style="mistral")
