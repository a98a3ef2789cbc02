"""Chat transcripts of a task pack's round-1 performer calls, as `lhd run` sends them (system prompt,
then the task message with its files), written as `{"messages": [...]}` lines for
`lhd lens eval --corpus FILE --format messages`. For a machine with no run directory: a run's own
transcripts (`lhd lens corpus OUT --source run --run RUN`) are the better corpus, since they hold
the performer's answers too.

    python scripts/lens_task_chats.py startup_consulting chats.jsonl
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from lhd_train.bench.performer import task_message
from lhd_train.bench.prompts import Prompts
from lhd_train.bench.taskpack import load_pack


def main(pack_name: str, out: str) -> None:
    pack = load_pack(pack_name)
    prompts = Prompts()
    system = prompts.render("performer_system", pack_description=pack.description)
    lines = [json.dumps({"messages": [{"role": "system", "content": system},
                                      {"role": "user", "content": task_message(prompts, task, None)}]})
             for task in pack.tasks]
    Path(out).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    print(f"{len(lines)} chats -> {out}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
