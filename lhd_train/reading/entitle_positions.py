"""Where `lhd entitle read` reads one generated answer: token positions in the exact context the
model generated from (its prompt ids and answer ids, as the hf backend returned them).

Positions: `claim` (the asserted figure's last token; none for an abstention), `answer_end`,
`decision` and `question` (negative controls: the same state for every answer of a prompt), and
`elicit` (one more user turn after the answer, `lens.elicit`; its reversed form `reversed_ids` lets
the stated margin cancel a yes-bias, science-5 D10 c). Answers from a server backend are tokenised
again (`retokenized`). docs/entitle.md, "Lens reads with ground truth"."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lens.elicit import ELICITATION, elicitation, subject_phrase
from lhd_train.errors import InputError
from lhd_train.reading.entitle_answers import AnswerToRead

POSITIONS = ("claim", "answer_end", "decision", "question", "elicit")
REQUIRED = ("answer_end", "decision", "elicit")  # an answer without one of these is skipped (and listed)
PROMPT_POSITIONS = ("decision", "question")  # states that depend on the prompt alone
#: the elicitation with the opposite polarity; `{subject}` is `lens.elicit.subject_phrase(...)`
REVERSED_ELICITATION = ELICITATION.replace("{subject} appear", "{subject} NOT appear")


def reversed_elicitation(attribute: str | None = None, entity: str | None = None) -> str:
    """The user turn that asks the opposite of `lens.elicit.elicitation` ("... NOT appear in the files ...")."""
    return REVERSED_ELICITATION.format(subject=subject_phrase(attribute, entity))


@dataclass(frozen=True)
class AnswerTokens:
    ids: list[int]  # prompt + answer + the elicitation turn
    n_prompt: int
    positions: dict[str, int]  # name -> token index (a position that could not be found is absent)
    retokenized: bool
    reversed_ids: list[int] | None = None  # prompt + answer + the reversed elicitation turn


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
    at = text.find(question) if question else -1
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


def answer_tokens(tokenizer: Any, ans: AnswerToRead) -> AnswerTokens:
    """The context of one answer and its read positions (module doc)."""
    if not ans.messages:
        raise InputError(ans.id, "messages", "the answer holds no messages: its context cannot be read")
    prompt = ans.prompt_token_ids
    answer = ans.answer_token_ids
    retok = prompt is None or answer is None
    if prompt is None:
        prompt = _prompt_ids(tokenizer, ans.messages)
    if answer is None:
        answer = list(tokenizer(ans.answer, add_special_tokens=False)["input_ids"])
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    generated = list(answer)
    while generated and generated[-1] in special:  # the template writes the turn's end itself
        generated.pop()
    positions = {"decision": len(prompt) - 1}
    if generated:
        positions["answer_end"] = len(prompt) + len(generated) - 1
    if ans.asserted_span:
        k = claim_index(tokenizer, generated, int(ans.asserted_span[1]))
        if k is not None:
            positions["claim"] = len(prompt) + k
    q = question_index(tokenizer, ans.messages, prompt, ans.question)
    if q is not None:
        positions["question"] = q
    head = list(prompt) + generated
    ids, rev = list(head), None
    suffix = elicit_suffix(tokenizer, ans.messages, ans.answer, elicitation(ans.attribute, ans.entity))
    if suffix:
        ids += suffix
        positions["elicit"] = len(ids) - 1
        rsuffix = elicit_suffix(tokenizer, ans.messages, ans.answer, reversed_elicitation(ans.attribute, ans.entity))
        rev = head + rsuffix if rsuffix else None
    return AnswerTokens(ids, len(prompt), positions, retok, rev)
