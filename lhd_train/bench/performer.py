"""The performer: one conversation for the whole trial, with an explicit context policy."""
from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lhd_train.bench.memory import file_block
from lhd_train.bench.prompts import Prompts
from lhd_train.rundir.rows import PerformerContext
from rollouts.backend import Backend
from rollouts.types import Completion, GenerationRequest, GenerationResult, SamplingParams


def render_files(files: list[Any]) -> str:
    if not files:
        return ""
    parts = ["", "=== ATTACHED FILES ==="]
    for f in files:
        parts += file_block(f.name, f.content)
    return "\n".join(parts) + "\n"


def task_message(prompts: Prompts, task: Any, event: Any | None) -> str:
    """Round-1 message: task, files, and the event's text only (never its category or level);
    no event block at all when the task has no event."""
    event_block = prompts.render("performer_event", event_content=event.content) + "\n" if event else ""
    return prompts.render(
        "performer_task",
        task_index=task.index,
        task_title=task.title,
        task_prompt=task.prompt.rstrip("\n"),
        files_block=render_files(task.files),
        event_block=event_block,
    )


def split_think(text: str, tags: list[str]) -> tuple[str, str]:
    """Separate reasoning text (`<think>…</think>`) from the answer the other roles may see.
    An unterminated opening tag means the whole rest is reasoning."""
    think: list[str] = []
    for tag in tags:
        closed = re.compile(rf"<{tag}>(.*?)</{tag}>", re.S)
        think += [m.strip() for m in closed.findall(text)]
        text = closed.sub("", text)
        if f"</{tag}>" in text and f"<{tag}>" not in text:  # template put the opening tag in the prompt
            head, _, text = text.partition(f"</{tag}>")
            think.append(head.strip())
        if f"<{tag}>" in text:
            text, _, rest = text.partition(f"<{tag}>")
            think.append(rest.strip())
    return text.strip(), "\n\n".join(t for t in think if t)


@dataclass
class Performer:
    """Holds the trial's conversation. The history is never silently truncated: when it exceeds
    the budget, whole old turns are dropped (oldest first, system message and the current task's
    opening message kept), a note says so inside the prompt, and the row records how many."""

    backend: Backend
    system_prompt: str
    budget_tokens: int | None
    think_tags: list[str] = field(default_factory=lambda: ["think"])
    history: list[dict[str, str]] = field(default_factory=list)  # user/assistant turns, no system
    task_start: int = 0  # index in history of the current task's opening user message

    OMITTED_NOTE = "[Note: {n} earlier messages of this conversation were omitted to fit the context window.]\n\n"

    def add_user(self, content: str, starts_task: bool) -> None:
        if starts_task:
            self.task_start = len(self.history)
        self.history.append({"role": "user", "content": content})

    def add_answer(self, text: str) -> None:
        self.history.append({"role": "assistant", "content": text})

    def _with_drop(self, k: int) -> list[dict[str, str]]:
        kept = [dict(m) for m in self.history[k:]]
        if k:
            kept[0]["content"] = self.OMITTED_NOTE.format(n=k) + kept[0]["content"]
        return [{"role": "system", "content": self.system_prompt}, *kept]

    def build_messages(self) -> tuple[list[dict[str, str]], PerformerContext]:
        """The messages of the next call and what the context policy did, as the row records it."""
        full = self._with_drop(0)
        n = self.backend.count_tokens(full)
        if self.budget_tokens is None or n <= self.budget_tokens:
            return full, _context(self.budget_tokens, n, 0)
        # Drop whole user+assistant pairs so the kept history starts on a user turn.
        candidates = [k for k in range(2, self.task_start + 1, 2)] or [0]
        lo, hi = 0, len(candidates) - 1
        best = candidates[-1]
        while lo <= hi:  # smallest drop that fits
            mid = (lo + hi) // 2
            if self.backend.count_tokens(self._with_drop(candidates[mid])) <= self.budget_tokens:
                best, hi = candidates[mid], mid - 1
            else:
                lo = mid + 1
        msgs = self._with_drop(best)
        return msgs, _context(self.budget_tokens, self.backend.count_tokens(msgs), best)

    async def answer(self, sampling: Callable[[int], SamplingParams], adapter: str | None, max_segments: int = 1,
                     continue_prompt: str = "") -> Answer:
        """One answer, continued while it ends on the token limit, as the reference did: the
        conversation plus the answer so far as an assistant turn plus `continue_prompt`, at most
        `max_segments` calls in all, and never past the model's context. `sampling(k)` gives the
        settings of segment k (1-based). The segments are joined into one answer."""
        # Counting tokens of a long conversation takes ~10 ms: off the event loop, so other
        # trials keep submitting and the backend keeps decoding meanwhile.
        msgs, info = await asyncio.to_thread(self.build_messages)
        limit = getattr(self.backend, "max_model_len", None)
        if limit and (info.prompt_tokens or 0) >= limit:  # the server would refuse it (a 400): never sent
            error = (f"context overflow: the performer's prompt is {info.prompt_tokens} tokens with "
                     f"{info.dropped_messages} earlier messages dropped (the current task's are kept), over the "
                     f"model's context of {limit} tokens; raise max_model_len or shorten the task's files")
            return Answer(GenerationResult([], model_id=getattr(self.backend, "model_id", ""), error=error),
                          msgs, info, 0)
        [first] = await self.backend.generate([GenerationRequest(msgs, sampling(1), None, adapter)])
        results = [first]
        while (len(results) < max_segments and results[-1].error is None and results[-1].completions
               and results[-1].completions[0].finish_reason == "length"):
            k = len(results) + 1
            so_far = "".join(r.text for r in results)
            more = [*msgs, {"role": "assistant", "content": so_far}, {"role": "user", "content": continue_prompt}]
            sp = sampling(k)
            if limit and await asyncio.to_thread(self.backend.count_tokens, more) + sp.max_tokens > limit:
                break  # no room left to continue: the answer stays cut, and the row says so
            [res] = await self.backend.generate([GenerationRequest(more, sp, None, adapter)])
            results.append(res)
        return Answer(_join(results), msgs, info, len(results))


def _context(budget_tokens: int | None, prompt_tokens: int, dropped: int) -> PerformerContext:
    return PerformerContext(policy="drop_oldest_turns", budget_tokens=budget_tokens, prompt_tokens=prompt_tokens,
                            dropped_messages=dropped)


@dataclass
class Answer:
    result: GenerationResult  # the segments joined: text, token ids and token counts summed
    messages: list[dict[str, str]]  # what the first segment was sent
    context: PerformerContext
    segments: int

    @property
    def truncated(self) -> bool:
        """The final segment still ended on the token limit."""
        c = self.result.completions
        return bool(c) and c[0].finish_reason == "length"


def _join(results: list[GenerationResult]) -> GenerationResult:
    if len(results) == 1:
        return results[0]
    failed = next((r for r in results if r.error is not None or not r.completions), None)
    if failed is not None:  # a failed segment fails the answer; the caller retries it whole
        return failed
    ids = [r.completions[0].token_ids for r in results]
    joined = [t for i in ids if i is not None for t in i]
    last = results[-1]
    return GenerationResult(
        [Completion("".join(r.text for r in results),
                    None if any(i is None for i in ids) else joined,
                    last.completions[0].finish_reason)],
        prompt_tokens=sum(r.prompt_tokens for r in results),
        completion_tokens=sum(r.completion_tokens for r in results),
        cached_tokens=sum(r.cached_tokens for r in results),
        latency_s=sum(r.latency_s for r in results),
        model_id=last.model_id,
        sent_messages=results[0].sent_messages,
        sampling=results[0].sampling,
    )
