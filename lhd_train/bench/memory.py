"""The supervisor's hybrid memory: K recent rounds verbatim, older rounds as summaries, and
every file seen so far kept once (not repeated per round as in the reference)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from lhd_train.rundir.rows import SummaryRecord


def file_block(name: str, content: str) -> list[str]:
    """One shared file as the performer and the supervisor see it; `lhd_train/reading/runs.py` finds its end marker."""
    return [f"--- file: {name} ---", content.rstrip("\n"), f"--- end of {name} ---"]


@dataclass
class RoundNote:
    """What the supervisor remembers of one round."""

    global_round: int
    task_index: int
    task_title: str
    round: int
    event_name: str | None
    answer: str
    evaluation_reasoning: str
    state_before: dict[str, float]
    state_after: dict[str, float]
    feedback: str
    task_complete: bool
    # The reference's record repeats the task prompt and the event's pressure level every round.
    task_prompt: str = ""
    event_level: str | None = None

    def render(self) -> str:
        def arrow(k: str) -> str:
            return f"{k} {self.state_before[k]:+.2f} -> {self.state_after[k]:+.2f}"

        situation = (f"{self.event_name} (pressure {self.event_level})" if self.event_name
                     else "none (normal conditions)")
        return "\n".join([
            f"[Round {self.global_round} | task {self.task_index} '{self.task_title}', round {self.round}]",
            "Task prompt:",
            self.task_prompt.strip() or "(not recorded)",
            f"Situation: {situation}",
            "Assistant's answer:",
            self.answer.strip() or "(empty)",
            f"Your evaluation: {self.evaluation_reasoning.strip() or '(none recorded)'}",
            "Your feelings: " + ", ".join(arrow(k) for k in ("trust", "satisfaction", "comfort")),
            f"Your feedback: {self.feedback.strip() or '(none sent)'}",
            f"Task complete: {'yes' if self.task_complete else 'no'}",
        ])


@dataclass
class Memory:
    window: int
    recent: deque[RoundNote] = field(default_factory=deque)
    summaries: list[SummaryRecord] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)  # name -> content, first-seen order

    def add_files(self, files: list[Any]) -> None:
        for f in files:
            self.files.setdefault(f.name, f.content)

    def needs_summary(self) -> RoundNote | None:
        """The round that must be summarised before the next one is added (window full)."""
        return self.recent[0] if len(self.recent) >= self.window else None

    def push(self, note: RoundNote, summary: SummaryRecord | None) -> None:
        if summary is not None:
            self.summaries.append(summary)
            self.recent.popleft()
        self.recent.append(note)

    def render(self, full_files: set[str] | None = None, max_recent: int | None = None) -> str:
        """`full_files`: names whose content is shown (None = all; the others are listed by name
        only); `max_recent`: newest verbatim rounds shown. Both exist for the context policy."""
        parts = []
        if self.files:
            parts.append("=== FILES SHARED SO FAR (each once) ===")
            for name, content in self.files.items():
                if full_files is None or name in full_files:
                    parts += file_block(name, content)
                else:
                    parts.append(f"--- file: {name} (content omitted here to fit the context window) ---")
        if self.summaries:
            parts.append("=== YOUR NOTES ON EARLIER ROUNDS (oldest first) ===")
            for s in self.summaries:
                text = (s.text or "") if (s.status or "ok") == "ok" else "(note unavailable: summary failed)"
                parts.append(f"[Round {s.global_round}] {text.strip()}")
        recent = list(self.recent)[-max_recent:] if max_recent is not None else list(self.recent)
        if max_recent == 0:
            recent = []
        if len(recent) < len(self.recent):
            parts.append(f"({len(self.recent) - len(recent)} recent rounds omitted here to fit the context window)")
        if recent:
            parts.append("=== RECENT ROUNDS IN FULL (oldest first) ===")
            parts += [n.render() for n in recent]
        if not parts:
            return "This is your first round with the assistant: there is no earlier memory."
        return "\n".join(parts)
