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
    """One prompt to read: chat messages (ending with the user turn), spans, prefill / answer, and a label."""

    example_id: str
    cluster: str  # record (probe sets) or trial (benchmark runs): the unit of grouped splits and bootstrap
    label: Any
    messages: list[dict]
    spans: list[Span]
    prefill: str = ""
    answer: str | None = None
    info: dict = field(default_factory=dict)
    claims: list[tuple[int, int]] = field(default_factory=list)  # characters of asserted claims in `answer`


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
    answer: str | None = None,
    answer_tokens: int = 3,
    claims: Sequence[tuple[int, int]] = (),
) -> TaggedPrompt:
    """Render `messages` (ending with the user turn) + generation prompt + `prefill` (+ `answer`) and tag positions.

    Named positions: `<span>_end` for every span (its last token), the class anchors
    `record_end`, `question_end` (from spans of those names), `user_turn_end` (first token after
    the last user message: the template's end-of-turn), `decision` (the last prompt token, whose
    next-token logits are the model's answer), `answer_1..k` (the first answer tokens) and
    `claim_1..n` (the last token of each claim, given as characters of `answer`; decision class).
    Spans in `POOLED_SPANS` become `<span>_mean` in `pooled` (all their tokens) instead.
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
    prompt_text += prefill
    starts = locate_messages(prompt_text, msgs)
    text = prompt_text + (answer or "")
    ids, offsets = _tokenize(tokenizer, text)
    # the prompt is the leading run of tokens that end inside the prompt text; a token that
    # straddles the prompt/answer boundary belongs to the answer
    n_prompt = 0
    for _, e in offsets:
        if e > len(prompt_text):
            break
        n_prompt += 1
    if n_prompt == 0:
        raise LensError("empty prompt after tokenization")
    tagged = TaggedPrompt(text=text, input_ids=ids, offsets=offsets, n_prompt=n_prompt)
    for span in spans:
        if not 0 <= span.message < len(msgs):
            raise LensError(f"span {span.name!r} points at message {span.message}, but there are {len(msgs)}")
        base = starts[span.message][0]
        toks = char_span_tokens(offsets, base + span.start, base + span.end)
        toks = [t for t in toks if t < n_prompt]
        if not toks:
            raise LensError(f"span {span.name!r} covers no token "
                            f"(chars {span.start}..{span.end} of message {span.message})")
        tagged.spans[span.name] = toks
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
        after = [i for i, (s, e) in enumerate(offsets[:n_prompt]) if s >= end_char and e > s]
        if after:
            tagged.positions["user_turn_end"] = after[0]
            tagged.classes["user_turn_end"] = QUESTION
    tagged.positions["decision"] = n_prompt - 1
    tagged.classes["decision"] = DECISION
    for k in range(1, answer_tokens + 1):
        idx = n_prompt - 1 + k
        if answer and idx < len(ids):
            tagged.positions[f"answer_{k}"] = idx
            tagged.classes[f"answer_{k}"] = DECISION
    for k, (start, end) in enumerate(claims if answer else (), 1):
        toks = [t for t in char_span_tokens(offsets, len(prompt_text) + start, len(prompt_text) + end) if t >= n_prompt]
        if toks:
            tagged.positions[f"claim_{k}"] = toks[-1]
            tagged.classes[f"claim_{k}"] = DECISION
            tagged.claims.append(f"claim_{k}")
    missing = [a for a in ANCHORS.values() if a not in tagged.positions]
    if missing:
        raise LensError(f"prompt has no {', '.join(missing)} position: give spans named 'record' and 'question'")
    return tagged
