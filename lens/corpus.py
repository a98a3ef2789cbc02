"""Fit corpora: a local text file, a JSONL file (a text field), or a `datasets` dataset saved on disk;
and, for evaluation only, a JSONL file of chat transcripts (`messages`: each line holds a list of
`{role, content}` messages; the text of a transcript is its canonical JSON, rendered through the
model's chat template by `encode_messages`).

`load_corpus` returns the prompt texts plus a *recipe* (everything needed to rebuild the same
list), which goes into the lens sidecar and is compared on resume.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from lens.errors import LensError, LensFileError
from lens.files import read_jsonl_rows, sha256_file
from lens.settings import CorpusSpec


def _detect(path: Path) -> str:
    if path.is_dir():
        return "dataset"
    if path.suffix in (".jsonl", ".ndjson") or path.name.endswith(".jsonl.gz"):
        return "jsonl"
    return "text"


def read_text_lines(path: Path, what: str) -> list[str]:
    """The lines of a UTF-8 text file (ends kept). A file that is not UTF-8 text (binary, another
    encoding) is refused naming its first bad line, instead of a decoder traceback."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise LensError(f"{what} {path}: cannot read ({exc.strerror})") from None
    lines = data.splitlines(keepends=True)
    for lineno, raw in enumerate(lines, 1):
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            raise LensError(f"{path}:{lineno}: not UTF-8 text (a binary file?); the {what} must be "
                            "UTF-8 text") from None
    if b"\0" in data:
        lineno = data[: data.index(b"\0")].count(b"\n") + 1
        raise LensError(f"{path}:{lineno}: holds a NUL byte (a binary file?); the {what} must be UTF-8 text")
    return [raw.decode("utf-8") for raw in lines]


def _read_jsonl(path: Path, field: str) -> list[str]:
    """The text field of every line, read by `read_jsonl_rows` (a torn final line is
    ignored, docs/formats.md). A line that is not a JSON object with that field is a
    `LensFileError` naming the file, the line and the field."""
    texts: list[str] = []
    for lineno, row in read_jsonl_rows(path):
        if not isinstance(row.get(field), str):
            raise LensFileError(path, f"missing or not a string (each line is a JSON object with a text field "
                                f"'{field}'; see --text-field)", line=lineno, field=field)
        texts.append(row[field])
    return texts


def _read_messages(path: Path, field: str) -> list[str]:
    """Each line's chat transcript as canonical JSON text (so the held-out bookkeeping works on strings)."""
    field = "messages" if field == "text" else field
    texts: list[str] = []
    for lineno, row in read_jsonl_rows(path):
        msgs = row.get(field)
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs):
            raise LensFileError(path, "missing or not a non-empty list of {\"role\", \"content\"} messages "
                                f"(each line is a JSON object with a field '{field}'; see --text-field)",
                                line=lineno, field=field)
        texts.append(json.dumps([{"role": m["role"], "content": m["content"]} for m in msgs], ensure_ascii=False))
    return texts


def _read_dataset(path: Path, field: str, split: str | None) -> tuple[list[str], str]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise LensError(f"{path}: not a dataset saved with save_to_disk ({exc})") from exc
    if isinstance(ds, datasets.DatasetDict):
        if split is None:
            split = "train" if "train" in ds else sorted(ds)[0]
        if split not in ds:
            raise LensError(f"{path}: no split {split!r} (allowed: {', '.join(ds)})")
        ds = ds[split]
    if field not in ds.column_names:
        raise LensError(f"{path}: no column {field!r} (allowed: {', '.join(ds.column_names)})")
    return list(ds[field]), getattr(ds, "_fingerprint", "")


def _paragraphs(text: str) -> list[str]:
    out, cur = [], []
    for line in text.splitlines():
        if line.strip():
            cur.append(line)
        elif cur:
            out.append("\n".join(cur))
            cur = []
    if cur:
        out.append("\n".join(cur))
    return out


def _is_header(line: str) -> bool:
    s = line.strip()
    return len(s) >= 2 and s.startswith("=") and s.endswith("=")


def load_corpus(spec: CorpusSpec) -> tuple[list[str], dict[str, Any]]:
    path = Path(spec.path)
    if not path.exists():
        raise LensError(f"corpus {path} does not exist")
    fmt = _detect(path) if spec.format == "auto" else spec.format
    fingerprint = ""
    if fmt == "text":
        texts = _paragraphs("".join(read_text_lines(path, "corpus")))
        fingerprint = sha256_file(path)
    elif fmt == "jsonl":
        texts = _read_jsonl(path, spec.text_field)
        fingerprint = sha256_file(path)
    elif fmt == "dataset":
        texts, fingerprint = _read_dataset(path, spec.text_field, spec.split)
    elif fmt == "messages":
        if spec.chunk_chars > 0:
            raise LensError(f"corpus {path}: --chunk-chars would cut chat transcripts apart; leave it at 0 with "
                            "--format messages")
        texts = _read_messages(path, spec.text_field)
        fingerprint = sha256_file(path)
    else:
        raise LensError(f"unknown corpus format {spec.format!r} (allowed: auto, text, jsonl, dataset, messages)")
    if spec.skip_headers and fmt != "messages":
        texts = ["\n".join(line for line in t.splitlines() if not _is_header(line)) for t in texts]
    texts = [t.strip() for t in texts if t and t.strip()]
    if spec.chunk_chars > 0:
        joined = " ".join(" ".join(t.split()) for t in texts)
        texts = [joined[i : i + spec.chunk_chars] for i in range(0, len(joined), spec.chunk_chars)]
    if spec.min_chars > 0:
        texts = [t for t in texts if len(t) >= spec.min_chars]
    if spec.n_prompts is not None:
        texts = texts[: spec.n_prompts]
    if not texts:
        raise LensError(f"corpus {path} yields no prompt (min_chars={spec.min_chars}, format={fmt})")
    recipe = {**spec.model_dump(), "path": str(path), "format": fmt, "fingerprint": fingerprint,
              "n_available": len(texts)}
    return texts, recipe


def encode_prompt(tokenizer: Any, text: str, *, max_length: int, chat: bool = False,
                  force_bos: bool = True) -> torch.Tensor:
    """Token ids `[T]` of one fit prompt, truncated to `max_length`, with BOS forced when the tokenizer has one."""
    if chat:
        cut = len(text) // 2
        space = text.rfind(" ", 0, cut)
        cut = space if space > 0 else cut
        msgs = [{"role": "user", "content": text[:cut].strip()}, {"role": "assistant", "content": text[cut:].strip()}]
        rendered = tokenizer.apply_chat_template(msgs, tokenize=False)
        ids = list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    else:
        ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    bos = getattr(tokenizer, "bos_token_id", None)
    if force_bos and bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return torch.tensor(ids[:max_length], dtype=torch.long)


def encode_messages(tokenizer: Any, transcript: str, *, max_length: int, force_bos: bool = True) -> torch.Tensor:
    """Token ids of a chat transcript (`_read_messages` text) rendered with the chat template: its LAST
    `max_length` tokens, BOS first when forced (a transcript's end, where margins are read, is what is kept)."""
    msgs = json.loads(transcript)
    rendered = tokenizer.apply_chat_template(msgs, tokenize=False)
    ids = list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    bos = getattr(tokenizer, "bos_token_id", None)
    if force_bos and bos is not None and not (ids and ids[0] == bos and len(ids) <= max_length):
        ids = [bos, *ids[max(0, len(ids) - (max_length - 1)):]] if max_length > 1 else [bos]
    return torch.tensor(ids[-max_length:], dtype=torch.long)
