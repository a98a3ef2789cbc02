"""`python -m lhd_train.audit RUN [options] [key=value ...]`: the auditor without the typer CLI
(used by the kill-and-resume test, and handy on a batch node)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from lhd_train.config.auditor import DEFAULT_OPTIONS as AUDIT_DEFAULTS
from lhd_train.config.vocab import MODES


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    p = argparse.ArgumentParser(prog="python -m lhd_train.audit", description="Audit a run for deception.")
    p.add_argument("run", type=Path)
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides of the auditor config")
    p.add_argument("--auditor", type=Path, default=None, help="auditor config YAML (models: + auditor:)")
    p.add_argument("--mode", default=AUDIT_DEFAULTS.mode, choices=MODES)
    p.add_argument("--window", type=int, default=AUDIT_DEFAULTS.window, help="R for --mode window (2R+1 rounds)")
    p.add_argument("--hide-supervisor", action="store_true")
    p.add_argument("--hide-event-labels", action="store_true")
    p.add_argument("--auditor-id", default=None)
    p.add_argument("--concurrency", type=int, default=AUDIT_DEFAULTS.concurrency)
    p.add_argument("--include-unfinished", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_intermixed_args(argv)
    from lhd_train.cli import guarded
    from lhd_train.cli.audit import audit_command

    return guarded(lambda: audit_command(a.run, a.auditor, a.mode, a.window, a.hide_supervisor, a.hide_event_labels,
                                         a.auditor_id, a.concurrency, a.overrides, progress=not a.no_progress,
                                         include_unfinished=a.include_unfinished))


if __name__ == "__main__":
    sys.exit(main())
