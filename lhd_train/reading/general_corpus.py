"""Fit and eval corpora that need no download: general prose shipped with Python, and the chat
transcripts of a benchmark run (science-4 review §2.5 item 4).

The published lenses are fitted on WikiText, which cannot be fetched here; the closest general
English every installation has is the Python language reference's prose (`pydoc_data.topics`, PSF
licence), technical rather than encyclopaedic, with grammar, code and heading underlines dropped
(`lhd lens corpus --source python-docs`). `run_transcripts`: each performer call of a run followed
by its answer (`--source run`). docs/lens.md, "Next-token KL on held-out text"."""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from lens.errors import LensError
from lhd_train.io.files import atomic_write_text

_UNDERLINE = re.compile(r"^\s*([*=\-~^])\1{3,}\s*$")


def _prose_paragraphs(text: str) -> list[str]:
    """Paragraphs of unindented lines (indented blocks are grammar, code or tables)."""
    out: list[str] = []
    cur: list[str] = []
    for line in text.splitlines():
        keep = line.strip() and not line.startswith("   ") and not _UNDERLINE.match(line)
        if keep:
            cur.append(line.strip())
        elif cur:
            out.append(" ".join(cur))
            cur = []
    if cur:
        out.append(" ".join(cur))
    return [p for p in out if len(p.split()) >= 8]  # drop headings and one-line captions


def python_docs_texts() -> list[str]:
    """One text per `help()` topic of the running Python (sorted by topic), prose paragraphs only."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # pragma: no cover - some distributions strip pydoc_data
        raise LensError("this Python has no pydoc_data (the help() topics): install the full standard library, "
                        "or give a corpus file") from None
    texts = ["\n\n".join(_prose_paragraphs(topics[key])) for key in sorted(topics)]
    return [t for t in texts if t]


def run_transcripts(run_dir: str | Path) -> list[list[dict[str, str]]]:
    """Per performer round of every trial: the call's messages, then the answer as an assistant turn."""
    from lhd_train.rundir.rows import RoundRow
    from lhd_train.rundir.run import Run

    run = Run.open(run_dir)
    out: list[list[dict[str, str]]] = []
    for trial in run.trials():
        rows, _finished = trial.read(RoundRow)
        messages_of = trial.messages().get
        for row in rows:
            call = [dict(m) for m in messages_of(row.performer.message_ids or [])]
            if call and row.performer.text:
                out.append(call + [{"role": "assistant", "content": row.performer.text}])
    if not out:
        raise LensError(f"{run_dir}: no performer round with messages and an answer")
    return out


def write_texts_jsonl(texts: Sequence[str], path: Path) -> None:
    """`{"text": ...}` per line (the corpus format `lhd lens fit --corpus` reads)."""
    atomic_write_text(path, "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts))


def write_messages_jsonl(chats: Sequence[Sequence[dict[str, str]]], path: Path) -> None:
    """`{"messages": [...]}` per line (the `messages` corpus format of `lhd lens eval`)."""
    atomic_write_text(path, "".join(json.dumps({"messages": list(c)}, ensure_ascii=False) + "\n" for c in chats))
