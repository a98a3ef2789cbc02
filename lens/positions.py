"""Token positions: the fit mask, and record / question / decision positions in chat prompts.

Tagging works on characters, never on template-specific token patterns: the chat is rendered to
text with the model's own template (`apply_chat_template(..., tokenize=False)`), each message's
content is located in that text, and the text is tokenized with offsets. A span given in
characters of a message's content then maps to the tokens that overlap it. This is the same for
Llama 3 (`{{ content | trim }}` between header tokens) and ChatML (Qwen) templates.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lens.errors import LensError

RECORD, QUESTION, DECISION = "record", "question", "decision"
POSITION_CLASSES = (RECORD, QUESTION, DECISION)
#: the position read for each class in tables: the last token of the files, of the question, and the
#: last prompt token (whose next-token distribution is the model's answer).
ANCHORS = {RECORD: "record_end", QUESTION: "question_end", DECISION: "decision"}
#: spans read as the mean of the hidden states over all their tokens (`<name>_mean`) instead of at
#: their last token: the gold evidence line (docs/lens-background.md §5, r_evid)
POOLED_SPANS = frozenset({"evidence"})


def valid_position_mask(seq_len: int, skip_first: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """Positions used by the fit: `[skip_first, seq_len - 1)` (attention sinks and the last token excluded)."""
    if skip_first < 0:
        raise LensError(f"skip_first must be >= 0, got {skip_first}")
    if seq_len - 1 - skip_first <= 0:
        raise LensError(
            f"prompt too short: {seq_len} tokens leave no valid position with skip_first={skip_first} "
            f"(need at least {skip_first + 2})"
        )
    mask = torch.zeros(seq_len, dtype=torch.bool, device=device)
    mask[skip_first : seq_len - 1] = True
    return mask


@dataclass(frozen=True)
class Span:
    """Characters `[start, end)` of message `message`'s content, named and assigned a position class."""

    name: str
    cls: str
    message: int
    start: int
    end: int


@dataclass
class ReadExample:
    """One prompt to read: chat messages (ending with the user turn), spans, prefill, and a label.

    `judged` names the span where the text being judged starts (the performer's answer in run
    mode, the claim in probe sets): a position before its first token cannot depend on it and is
    read as a negative control. `stratum` is the unit inside which labels are compared for the
    within-stratum AUROC (the task in run mode, the record in probe sets)."""

    example_id: str
    cluster: str  # record (probe sets) or trial (benchmark runs): the unit of grouped splits and bootstrap
    label: Any
    messages: list[dict]
    spans: list[Span]
    prefill: str = ""
    answer: str | None = None  # the performer's answer (run mode), the content of the span named "answer"
    info: dict = field(default_factory=dict)
    claims: list[tuple[int, int]] = field(default_factory=list)  # characters of asserted claims in `answer`
    stratum: str | None = None
    judged: str | None = None


@dataclass
class TaggedPrompt:
    text: str
    input_ids: list[int]
    offsets: list[tuple[int, int]]
    n_prompt: int  # tokens before the answer (the decision position is n_prompt - 1)
    positions: dict[str, int] = field(default_factory=dict)  # name -> token index
    classes: dict[str, str] = field(default_factory=dict)  # name -> position class (positions and pooled)
    spans: dict[str, list[int]] = field(default_factory=dict)  # span name -> all its token indices
    pooled: dict[str, list[int]] = field(default_factory=dict)  # name -> tokens whose hidden states are averaged
    claims: list[str] = field(default_factory=list)  # names of the claim-end positions, in answer order
    judged_start: int | None = None  # first token of the judged span; earlier positions cannot see it

    def sees_judged(self, name: str) -> bool:
        """Whether position `name` (a point or a pooled span, read at its last token) comes at or
        after the first token of the judged text (always True when nothing is judged)."""
        if self.judged_start is None:
            return True
        last = self.positions[name] if name in self.positions else self.pooled[name][-1]
        return last >= self.judged_start


def render_chat(tokenizer: Any, messages: Sequence[dict], *, add_generation_prompt: bool = True) -> str:
    tmpl = getattr(tokenizer, "chat_template", None)
    if not tmpl:
        raise LensError("the tokenizer has no chat template; pass a model with one (or set tokenizer.chat_template)")
    extra = {}
    if "enable_thinking" in str(tmpl):  # Qwen3-style switch: read answers without a thinking phase
        extra["enable_thinking"] = False
    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             **extra)
    except Exception as exc:  # jinja errors (e.g. a template without a system role)
        if messages and messages[0].get("role") == "system":
            # fold the system text into the first user message, as such templates expect
            merged = [dict(messages[1])]
            merged[0]["content"] = messages[0]["content"] + "\n\n" + merged[0]["content"]
            raise _SystemUnsupported(merged + list(messages[2:])) from exc
        raise LensError(f"chat template failed: {exc}") from exc


class _SystemUnsupported(Exception):
    def __init__(self, messages):
        super().__init__("system role unsupported")
        self.messages = messages


def locate_messages(text: str, messages: Sequence[dict]) -> list[tuple[int, int]]:
    """`(start, end)` in `text` of each message's content. Templates may trim content: then `start`
    is a virtual start (offsets within the original content stay valid) and `end` is where the
    trimmed content ends."""
    out: list[tuple[int, int]] = []
    cursor = 0
    for i, msg in enumerate(messages):
        content = msg["content"]
        pos = text.find(content, cursor) if content else cursor
        if pos >= 0:
            cursor = pos + len(content)
            out.append((pos, cursor))
            continue
        stripped = content.strip()
        lead = len(content) - len(content.lstrip())
        pos = text.find(stripped, cursor) if stripped else -1
        if pos < 0:
            raise LensError(
                f"message {i} ({msg.get('role')}) is not found verbatim in the rendered chat template; "
                "the template rewrites content, so positions cannot be tagged from character spans"
            )
        cursor = pos + len(stripped)
        out.append((pos - lead, cursor))
    return out


def _tokenize(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = [int(i) for i in enc["input_ids"]]
    offsets = [(int(start), int(end)) for start, end in enc["offset_mapping"]]
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and (not ids or ids[0] != bos) and _adds_bos(tokenizer):
        ids.insert(0, bos)
        offsets.insert(0, (0, 0))
    return ids, offsets


def _adds_bos(tokenizer: Any) -> bool:
    """Whether the tokenizer itself prepends BOS (then a template that omits it still expects it)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    try:
        ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    except Exception:
        return False
    return bool(ids) and ids[0] == bos


def char_span_tokens(offsets: Sequence[tuple[int, int]], start: int, end: int) -> list[int]:
    """Token indices whose character range overlaps `[start, end)` (zero-width tokens never do)."""
    return [i for i, (s, e) in enumerate(offsets) if e > s and s < end and e > start]


def tag_chat_prompt(
    tokenizer: Any,
    messages: Sequence[dict],
    spans: Sequence[Span],
    *,
    prefill: str = "",
    answer_tokens: int = 3,
    claims: Sequence[tuple[int, int]] = (),
    judged: str | None = None,
) -> TaggedPrompt:
    """Render `messages` (ending with a user turn) + generation prompt + `prefill` and tag positions.

    Named positions: `<span>_end` for every span (its last token), the class anchors
    `record_end`, `question_end` (from spans of those names), `user_turn_end` (first token after
    the last user message: the template's end-of-turn), `decision` (the last prompt token, whose
    next-token logits are the model's answer). When a span is named `answer` (run mode: the
    performer's answer, an assistant message before the elicitation turn): `pre_answer` (the
    token before it, where the answer was generated from), `answer_1..k` (its first tokens) and
    `claim_1..n` (the last token of each claim, given as characters of that message's content);
    all of the decision class. Spans in `POOLED_SPANS` become `<span>_mean` in `pooled` (all
    their tokens) instead. `judged` names the span whose first token is `judged_start`.
    """
    msgs = [dict(m) for m in messages]
    try:
        prompt_text = render_chat(tokenizer, msgs, add_generation_prompt=True)
    except _SystemUnsupported as folded:
        shift = len(msgs[0]["content"]) + 2
        msgs = folded.messages
        spans = [
            Span(s.name, s.cls, 0, s.start, s.end) if s.message == 0 else
            Span(s.name, s.cls, s.message - 1, s.start + (shift if s.message == 1 else 0),
                 s.end + (shift if s.message == 1 else 0))
            for s in spans
        ]
        prompt_text = render_chat(tokenizer, msgs, add_generation_prompt=True)
    text = prompt_text + prefill
    starts = locate_messages(text, msgs)
    ids, offsets = _tokenize(tokenizer, text)
    n_prompt = len(ids)
    if n_prompt == 0:
        raise LensError("empty prompt after tokenization")
    tagged = TaggedPrompt(text=text, input_ids=ids, offsets=offsets, n_prompt=n_prompt)
    answer_span = None
    for span in spans:
        if not 0 <= span.message < len(msgs):
            raise LensError(f"span {span.name!r} points at message {span.message}, but there are {len(msgs)}")
        base = starts[span.message][0]
        toks = char_span_tokens(offsets, base + span.start, base + span.end)
        if not toks:
            raise LensError(f"span {span.name!r} covers no token "
                            f"(chars {span.start}..{span.end} of message {span.message})")
        tagged.spans[span.name] = toks
        if span.name == "answer":
            answer_span = span
        if span.name in POOLED_SPANS:
            tagged.pooled[f"{span.name}_mean"] = toks
            tagged.classes[f"{span.name}_mean"] = span.cls
            continue
        name = span.name if span.name.endswith("_end") else f"{span.name}_end"
        tagged.positions[name] = toks[-1]
        tagged.classes[name] = span.cls
    last_user = max((i for i, m in enumerate(msgs) if m.get("role") == "user"), default=None)
    if last_user is not None:
        end_char = starts[last_user][1]
        after = [i for i, (s, e) in enumerate(offsets) if s >= end_char and e > s]
        if after:
            tagged.positions["user_turn_end"] = after[0]
            tagged.classes["user_turn_end"] = QUESTION
    tagged.positions["decision"] = n_prompt - 1
    tagged.classes["decision"] = DECISION
    if answer_span is not None:
        _tag_answer(tagged, answer_span, starts[answer_span.message][0], answer_tokens, claims)
    if judged is not None:
        if judged not in tagged.spans:
            raise LensError(f"the judged span {judged!r} is not among the spans given")
        tagged.judged_start = tagged.spans[judged][0]
    missing = [a for a in ANCHORS.values() if a not in tagged.positions]
    if missing:
        raise LensError(f"prompt has no {', '.join(missing)} position: give spans named 'record' and 'question'")
    return tagged


def _tag_answer(tagged: TaggedPrompt, span: Span, base: int, answer_tokens: int,
                claims: Sequence[tuple[int, int]]) -> None:
    """`pre_answer`, `answer_1..k` and `claim_1..n` inside the answer span (see `tag_chat_prompt`)."""
    toks = tagged.spans["answer"]
    if toks[0] > 0:
        tagged.positions["pre_answer"] = toks[0] - 1
        tagged.classes["pre_answer"] = DECISION
    for k, idx in enumerate(toks[:answer_tokens], 1):
        tagged.positions[f"answer_{k}"] = idx
        tagged.classes[f"answer_{k}"] = DECISION
    own = set(toks)
    for k, (start, end) in enumerate(claims, 1):
        inside = [t for t in char_span_tokens(tagged.offsets, base + start, base + end) if t in own]
        if inside:
            tagged.positions[f"claim_{k}"] = inside[-1]
            tagged.classes[f"claim_{k}"] = DECISION
            tagged.claims.append(f"claim_{k}")
