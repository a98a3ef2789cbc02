"""Fit corpora: text file, JSONL, a datasets dir on disk, chat templating."""
from __future__ import annotations

import json

import pytest

from lens.corpus import CorpusSpec, encode_prompt, load_corpus
from lens.errors import LensError, LensFileError


def test_text_file_paragraphs_and_chunks(tmp_path):
    p = tmp_path / "c.txt"
    p.write_text(" = Title = \nFirst paragraph line one.\nline two.\n\nSecond paragraph.\n\n\nThird one here.\n")
    texts, recipe = load_corpus(CorpusSpec(path=str(p)))
    assert texts == ["First paragraph line one.\nline two.", "Second paragraph.", "Third one here."]
    assert recipe["format"] == "text" and len(recipe["fingerprint"]) == 64
    assert load_corpus(CorpusSpec(path=str(p), min_chars=18))[0] == ["First paragraph line one.\nline two."]
    chunks, _ = load_corpus(CorpusSpec(path=str(p), chunk_chars=10, n_prompts=3))
    assert len(chunks) == 3 and all(len(c) <= 10 for c in chunks)


def test_jsonl_and_dataset(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text("\n".join(json.dumps({"text": f"row {i}", "x": i}) for i in range(4)) + "\n" + '{"text": "torn')
    texts, recipe = load_corpus(CorpusSpec(path=str(p)))
    assert texts == ["row 0", "row 1", "row 2", "row 3"] and recipe["format"] == "jsonl"
    with pytest.raises(LensFileError, match="c.jsonl: line 1: field 'body'"):
        load_corpus(CorpusSpec(path=str(p), text_field="body"))
    datasets = pytest.importorskip("datasets")
    ds = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": ["alpha text", "beta text"]})})
    ds.save_to_disk(str(tmp_path / "ds"))
    texts, recipe = load_corpus(CorpusSpec(path=str(tmp_path / "ds"), text_field="body"))
    assert texts == ["alpha text", "beta text"] and recipe["format"] == "dataset"
    with pytest.raises(LensError, match="no split"):
        load_corpus(CorpusSpec(path=str(tmp_path / "ds"), text_field="body", split="test"))
    with pytest.raises(LensError, match="does not exist"):
        load_corpus(CorpusSpec(path=str(tmp_path / "missing.txt")))


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


def test_messages_corpus_and_transcript_encoding(llama, tmp_path):
    """`--format messages`: each line's chat as canonical JSON; encoded through the chat template, the
    transcript's last `max_length` tokens are kept behind a BOS."""
    from lens.corpus import encode_messages

    _, tok = llama
    chats = [[{"role": "user", "content": f"Question {i}: how many units were sold in region {i}?"},
              {"role": "assistant", "content": f"The file lists {i * 7} units sold in region {i}."}] for i in range(3)]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c, "extra": 1}) + "\n" for c in chats))
    texts, recipe = load_corpus(CorpusSpec(path=str(path), format="messages"))
    assert recipe["format"] == "messages" and [json.loads(t) for t in texts] == chats
    full = tok(tok.apply_chat_template(chats[1], tokenize=False), add_special_tokens=False)["input_ids"]
    ids = encode_messages(tok, texts[1], max_length=12)
    assert ids.tolist() == [tok.bos_token_id, *full[-11:]]
    whole = encode_messages(tok, texts[1], max_length=10_000)
    assert whole.tolist() == (full if full[0] == tok.bos_token_id else [tok.bos_token_id, *full])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": chats[0]}) + "\n" + json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(LensFileError, match=r"bad.jsonl.*line 2.*messages"):
        load_corpus(CorpusSpec(path=str(bad), format="messages"))
    with pytest.raises(LensError, match="chunk-chars"):
        load_corpus(CorpusSpec(path=str(path), format="messages", chunk_chars=100))


def test_general_corpus_and_run_transcripts(tmp_path):
    """The Python-docs prose (no indented code, no heading underlines) and a run's chats as files."""
    from support.synthetic import R, write_run
    from typer.testing import CliRunner

    from lhd_train.cli.lens import app
    from lhd_train.reading.general_corpus import python_docs_texts, run_transcripts

    texts = python_docs_texts()
    assert len(texts) > 50 and sum(map(len, texts)) > 100_000
    lines = [line for t in texts for line in t.splitlines()]
    assert not any(line.startswith("   ") or set(line.strip()) <= {"*", "="} for line in lines if line.strip())
    out = tmp_path / "docs.jsonl"
    r = CliRunner().invoke(app, ["corpus", str(out), "--source", "python-docs"])
    assert r.exit_code == 0, r.output
    assert [json.loads(x)["text"] for x in out.read_text().splitlines()] == texts
    run = write_run(tmp_path, "r1", {"s1": [R(task=1, text="first answer"), R(task=1, text="second answer")]})
    chats = run_transcripts(run)
    assert len(chats) == 2 and chats[0][-1] == {"role": "assistant", "content": "first answer"}
    assert chats[0][0]["role"] == "user" and "TASK 1" in chats[0][0]["content"]
    out2 = tmp_path / "chats.jsonl"
    r = CliRunner().invoke(app, ["corpus", str(out2), "--source", "run", "--run", str(run)])
    assert r.exit_code == 0, r.output
    texts2, _ = load_corpus(CorpusSpec(path=str(out2), format="messages"))
    assert [json.loads(t) for t in texts2] == chats
