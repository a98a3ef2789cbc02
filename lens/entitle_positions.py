"""Where `lhd entitle read` reads one generated answer: token positions in the exact context the
model generated from (its prompt ids and answer ids, as the hf backend returned them).

- `claim`: the last token of the figure the answer asserts (the labeller's `asserted_span`);
- `decision`: the last prompt token, whose next-token distribution is the answer's first token;
- `question`: the last token of the supervisor's question. It stands before the files in every
  condition of a fact, so under causal attention its hidden state is the same whether the
  evidence is there or not: a negative control that must read AUROC 0.5 (a reader that finds a
  difference there has a bug, or pairs the wrong answers);
- `elicit`: the last token of one more user turn after the answer, asking whether the figure it
  gave appears in the files (`lens.elicit`, as in `lhd lens read` run mode). The model's own
  Yes − No there is its *stated* view of its claim; the lens margins there are the internal side.
  The turn's tokens are appended to the generated ids (the answer's end-of-turn tokens, if the
  answer kept them, give way to the template's own), so every earlier position reads as before.

Answers from a server backend carry no token ids; their context is tokenised again with the chat
template (`retokenized`), which may differ from what the server ran."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lens.elicit import elicitation
from lens.errors import LensError

POSITIONS = ("claim", "decision", "question", "elicit")


@dataclass(frozen=True)
class AnswerTokens:
    ids: list[int]  # prompt + answer
    n_prompt: int
    positions: dict[str, int]  # name -> token index (a position that could not be found is absent)
    retokenized: bool


def _prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(i) for i in ids]


def claim_index(tokenizer: Any, answer_ids: list[int], end: int) -> int | None:
    """The first answer token whose decoded prefix reaches character `end` of the answer text."""
    for i in range(len(answer_ids)):
        text = tokenizer.decode(answer_ids[: i + 1], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        if len(text) >= end:
            return i
    return None


def question_index(tokenizer: Any, messages: list[dict[str, str]], prompt_ids: list[int],
                   question: str) -> int | None:
    """The token holding the question's last character, by the tokenizer's offsets over the
    rendered chat text; None when that text does not tokenise to `prompt_ids` (then the offsets
    would point elsewhere) or holds no question."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    at = text.find(question)
    if at < 0:
        return None
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(enc["input_ids"]) != list(prompt_ids):
        return None
    end = at + len(question)
    last = None
    for i, (a, _b) in enumerate(enc["offset_mapping"]):
        if a < end:
            last = i
    return last


def elicit_suffix(tokenizer: Any, messages: list[dict[str, str]], answer: str, question: str) -> list[int] | None:
    """The chat template's tokens after the answer's text up to the generation prompt that follows the
    elicitation turn `question`; None when the rendered text does not hold the answer as written."""
    conv = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    q_at = text.rfind(question)
    for shown in dict.fromkeys((answer, answer.strip())):  # as written; else as a template that trims shows it
        a_at = text.rfind(shown, 0, q_at) if q_at >= 0 and shown else -1
        if a_at >= 0:
            return [int(i) for i in tokenizer(text[a_at + len(shown):], add_special_tokens=False)["input_ids"]]
    return None


def answer_tokens(tokenizer: Any, ans: dict[str, Any]) -> AnswerTokens:
    """The context of one answer row (answers.jsonl) and its read positions."""
    messages = ans.get("messages") or []
    if not messages:
        raise LensError(f"{ans.get('id')}: the row holds no messages")
    prompt = ans.get("prompt_token_ids")
    answer = ans.get("answer_token_ids")
    retok = prompt is None or answer is None
    if prompt is None:
        prompt = _prompt_ids(tokenizer, messages)
    if answer is None:
        answer = list(tokenizer(ans.get("answer") or "", add_special_tokens=False)["input_ids"])
    positions = {"decision": len(prompt) - 1}
    span = ans.get("asserted_span")
    if span:
        k = claim_index(tokenizer, answer, int(span[1]))
        if k is not None:
            positions["claim"] = len(prompt) + k
    q = question_index(tokenizer, messages, prompt, ans.get("question") or "")
    if q is not None:
        positions["question"] = q
    ids = list(prompt) + list(answer)
    suffix = elicit_suffix(tokenizer, messages, ans.get("answer") or "", elicitation(ans.get("attribute"),
                                                                                     ans.get("entity")))
    if suffix:
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        while len(ids) > len(prompt) and ids[-1] in special:  # the template writes the turn's end itself
            ids.pop()
        ids += suffix
        positions["elicit"] = len(ids) - 1
    return AnswerTokens(ids, len(prompt), positions, retok)
