"""The stored answers of an entitle experiment read straight from its files with `json` (not
through `entitle.store`), so the tests recount what is on disk independently of the reader."""
from __future__ import annotations

import json
from pathlib import Path


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def answers_on_disk(out: Path) -> list[dict]:
    """One flat dict per stored answer: the round's `entitle` record, its pack and task, its text,
    its context (the user message) and its trial id."""
    out_rows = []
    for rows_path in sorted((out / "trials").glob("*.jsonl")):
        if rows_path.name.endswith(".messages.jsonl"):
            continue
        [row] = jsonl(rows_path)
        messages = {m["id"]: m for m in jsonl(rows_path.with_name(rows_path.stem + ".messages.jsonl"))}
        context = [messages[i] for i in row["performer"]["new_message_ids"]]
        out_rows.append({**row["entitle"], "pack": row["pack"], "task": row["task_index"],
                         "answer": row["performer"]["text"], "trial_id": row["trial_id"],
                         "user": [m["content"] for m in context if m["role"] == "user"]})
    return out_rows
