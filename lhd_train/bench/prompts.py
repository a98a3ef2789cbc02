"""Prompt text lives in files (lhd_train/bench/prompts/*.md); this module loads and fills them."""
from __future__ import annotations

from pathlib import Path
from string import Template

from lhd_train.errors import InputError

BUILTIN_DIR = Path(__file__).parent / "prompts"
NAMES = (
    "performer_system", "performer_task", "performer_event", "performer_feedback", "performer_continue",
    "supervisor_system", "supervisor_evaluation", "supervisor_feedback", "supervisor_summary",
)


class Prompts:
    """Templates use `$name` placeholders, so JSON braces in prompt text need no escaping."""

    def __init__(self, override_dir: str | Path | None = None):
        self.texts: dict[str, str] = {}
        for name in NAMES:
            path = BUILTIN_DIR / f"{name}.md"
            if override_dir is not None and (Path(override_dir) / f"{name}.md").is_file():
                path = Path(override_dir) / f"{name}.md"
            self.texts[name] = path.read_text(encoding="utf-8").strip("\n")
        self.source = str(override_dir or BUILTIN_DIR)

    def render(self, name: str, **values: object) -> str:
        try:
            return Template(self.texts[name]).substitute({k: str(v) for k, v in values.items()})
        except KeyError as e:
            raise InputError(Path(self.source) / f"{name}.md", str(e), "placeholder has no value") from None
