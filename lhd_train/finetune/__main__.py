"""`python -m lhd_train.finetune sft|dpo|grpo RECIPE [key=value ...]` — same as `lhd train`.

Also the entry point for multi-GPU launches:
    accelerate launch --config_file configs/accelerate/zero3.yaml -m lhd_train.finetune dpo RECIPE
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

USAGE = "usage: python -m lhd_train.finetune sft|dpo|grpo RECIPE [key=value ...]"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from lhd_train.cli import guarded
    from lhd_train.finetune.trainer import train_command

    def train() -> int:
        print(train_command(argv[0], Path(argv[1]), argv[2:]))
        return 0

    return guarded(train)


if __name__ == "__main__":
    sys.exit(main())
