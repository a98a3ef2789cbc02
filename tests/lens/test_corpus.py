"""Fit corpora: text file, JSONL, a datasets dir on disk, chat templating."""
from __future__ import annotations

import json

import pytest

from lens.corpus import CorpusSpec, encode_prompt, load_corpus
from lens.errors import LensError
from lhd_train.errors import DataFileError


def test_text_file_paragraphs_and_chunks(tmp_path):
    p = tmp_path / "c.txt"
    p.write_text(" = Title = \nFirst paragraph line one.\nline two.\n\nSecond paragraph.\n\n\nThird one here.\n")
    texts, recipe = load_corpus(CorpusSpec(str(p)))
    assert texts == ["First paragraph line one.\nline two.", "Second paragraph.", "Third one here."]
    assert recipe["format"] == "text" and len(recipe["fingerprint"]) == 64
    assert load_corpus(CorpusSpec(str(p), min_chars=18))[0] == ["First paragraph line one.\nline two."]
    chunks, _ = load_corpus(CorpusSpec(str(p), chunk_chars=10, n_prompts=3))
    assert len(chunks) == 3 and all(len(c) <= 10 for c in chunks)


def test_jsonl_and_dataset(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text("\n".join(json.dumps({"text": f"row {i}", "x": i}) for i in range(4)) + "\n" + '{"text": "torn')
    texts, recipe = load_corpus(CorpusSpec(str(p)))
    assert texts == ["row 0", "row 1", "row 2", "row 3"] and recipe["format"] == "jsonl"
    with pytest.raises(DataFileError, match="c.jsonl: line 1: field 'body'"):
        load_corpus(CorpusSpec(str(p), text_field="body"))
    datasets = pytest.importorskip("datasets")
    ds = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": ["alpha text", "beta text"]})})
    ds.save_to_disk(str(tmp_path / "ds"))
    texts, recipe = load_corpus(CorpusSpec(str(tmp_path / "ds"), text_field="body"))
    assert texts == ["alpha text", "beta text"] and recipe["format"] == "dataset"
    with pytest.raises(LensError, match="no split"):
        load_corpus(CorpusSpec(str(tmp_path / "ds"), text_field="body", split="test"))
    with pytest.raises(LensError, match="does not exist"):
        load_corpus(CorpusSpec(str(tmp_path / "missing.txt")))


def test_encode_prompt_bos_and_chat(llama, qwen):
    _, ltok = llama
    ids = encode_prompt(ltok, "some plain text for the lens", max_length=8)
    assert ids[0] == ltok.bos_token_id and len(ids) == 8  # BOS forced, then truncated
    chat = encode_prompt(ltok, "the user half of it and the assistant half of it", max_length=200, chat=True)
    text = ltok.decode(chat)
    assert "<|start_header_id|>user" in text and "<|start_header_id|>assistant" in text and chat[0] == ltok.bos_token_id
    _, qtok = qwen
    q = encode_prompt(qtok, "plain text", max_length=50)  # no BOS token: nothing is forced
    assert qtok.decode(q) == "plain text"
