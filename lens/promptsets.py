"""Lens-quality prompt sets in the Jacobian-lens release's format, and how each item is read.

A set is a JSON file `{"items": [{"name", "prompt", "intermediates", "target"?}]}` (the release's
`data/evaluations/lens-eval-<set>.json`; three of them ship in `lens/evalsets/`, Apache-2.0).
`prompt` is a string, or a list of chat messages rendered with the model's chat template.
`intermediates` are the words the model should represent on the way to its answer; `target`
only marks the read position and is not scored.

Read position (one per item): the last prompt token, except the `poetry` set, read at the last
token holding a newline (the end of the couplet's first line).

Token forms of an intermediate: each form of `as given`, `lower-case`, `Capitalised`, with and
without a leading space, is kept if the tokenizer makes it one token. In `order-ops` an
intermediate stands for a synonym set (a number: its digits and its English word; an operation:
its symbols and word forms, `OPERATION_SYNONYMS`) and every synonym contributes its forms. When no
form of any synonym is one token, the first token of the leading-space form of the intermediate is
used instead and the intermediate is counted as a fallback.

Kind of an intermediate (science-5 §3.1): in `order-ops` a number is the `result` of a
sub-expression and a word of `OPERATION_SYNONYMS` the `operation` applied next; every other
intermediate is a `word`. An intermediate is **in the prompt** when one of the token ids it is
scored by occurs among the prompt's tokens up to the read position: a readout that echoes recent
input can surface it without any unverbalised computation, so pass@k is also reported without them.
"""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lens.errors import LensError
from lens.margins import surface_forms

EVALSETS = Path(__file__).resolve().parent / "evalsets"
PREFIX = "lens-eval-"
#: sets whose intermediates stand for synonym sets
SYNONYM_SETS = frozenset({"order-ops"})
#: sets read at the last newline token instead of the last prompt token
NEWLINE_SETS = frozenset({"poetry"})

OPERATION_SYNONYMS: dict[str, tuple[str, ...]] = {
    "addition": ("+", "plus", "add", "addition"),
    "subtraction": ("-", "−", "minus", "subtract", "subtraction"),
    "multiplication": ("*", "×", "times", "multiply", "multiplication"),
    "division": ("/", "÷", "divide", "divided", "division"),
    "squared": ("^", "²", "square", "squared"),
    "mod": ("%", "mod", "modulo", "remainder"),
}
#: intermediate kinds (`intermediate_kind`)
RESULT, OPERATION, WORD = "result", "operation", "word"
_ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
         "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


def number_word(n: int) -> str | None:
    """English word of 0..99 ("twenty-four"); None outside that range."""
    if 0 <= n < 20:
        return _ONES[n]
    if 20 <= n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else "-" + _ONES[n % 10])
    return None


def synonyms(word: str, set_name: str) -> list[str]:
    """The words an intermediate stands for: itself, plus in `order-ops` its digit/word or symbol/word forms."""
    if set_name not in SYNONYM_SETS:
        return [word]
    out = [word]
    key = word.strip().lower()
    if key.lstrip("-").isdigit():
        spelled = number_word(int(key))
        out += [spelled] if spelled else []
    else:
        digits = next((str(i) for i in range(100) if number_word(i) == key), None)
        out += [digits] if digits else []
        for name, forms in OPERATION_SYNONYMS.items():
            if key == name or key in forms:
                out += [name, *forms]
    return list(dict.fromkeys(out))


def intermediate_kind(word: str, set_name: str) -> str:
    """`result` (a number) or `operation` in the synonym sets (`order-ops`); `word` otherwise."""
    if set_name not in SYNONYM_SETS:
        return WORD
    key = word.strip().lower()
    if key.lstrip("-").isdigit() or any(number_word(i) == key for i in range(100)):
        return RESULT
    if any(key == name or key in forms for name, forms in OPERATION_SYNONYMS.items()):
        return OPERATION
    return WORD


@dataclass
class TokenForms:
    """The token ids an intermediate is scored by, which surface forms gave them, and whether it fell back."""

    word: str
    ids: list[int]
    forms: list[str]
    fallback: bool = False


def token_forms(tokenizer: Any, word: str, set_name: str) -> TokenForms:
    ids: list[int] = []
    forms: list[str] = []
    for syn in synonyms(word, set_name):
        for form in surface_forms(syn):
            toks = tokenizer(form, add_special_tokens=False)["input_ids"]
            if len(toks) == 1 and int(toks[0]) not in ids:
                ids.append(int(toks[0]))
                forms.append(form)
    if ids:
        return TokenForms(word, ids, forms)
    toks = tokenizer(" " + word, add_special_tokens=False)["input_ids"]
    if not toks:
        raise LensError(f"intermediate {word!r} tokenizes to nothing")
    return TokenForms(word, [int(toks[0])], [f" {word}[0]"], fallback=True)


def forms_in_prompt(forms: TokenForms, prompt_ids: list[int]) -> list[str]:
    """The surface forms of `forms` whose token occurs in `prompt_ids` (the tokens up to the read position)."""
    present = set(prompt_ids)
    return [form for i, form in zip(forms.ids, forms.forms, strict=True) if i in present]


@dataclass
class PromptItem:
    name: str
    prompt: str | list[dict[str, str]]
    intermediates: list[str]
    target: str | None = None


@dataclass
class PromptSet:
    name: str
    path: str
    sha256: str
    items: list[PromptItem] = field(default_factory=list)


def set_name(path: str | Path) -> str:
    """`lens-eval-typo.json` -> `typo` (the key of the set in passk.json)."""
    stem = Path(path).name
    stem = stem[: -len(".json")] if stem.endswith(".json") else stem
    return stem[len(PREFIX):] if stem.startswith(PREFIX) else stem


def resolve_prompt_set(spec: str | Path) -> Path:
    """A path, or the name of a set shipped in lens/evalsets (`multihop`, `order-ops`, `typo`)."""
    p = Path(spec)
    if p.exists():
        return p
    shipped = EVALSETS / f"{PREFIX}{spec}.json"
    if shipped.is_file():
        return shipped
    names = sorted(set_name(x) for x in EVALSETS.glob(f"{PREFIX}*.json"))
    raise LensError(f"prompt set {spec}: no such file, and not a shipped set (shipped: {', '.join(names)})")


def _messages(value: Any, where: str) -> list[dict[str, str]]:
    ok = isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
    if not ok:
        raise LensError(f"{where}.prompt: a string or a non-empty list of {{\"role\", \"content\"}} messages")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def load_prompt_set(spec: str | Path) -> PromptSet:
    path = resolve_prompt_set(spec)
    try:
        raw = path.read_bytes()
        obj = json.loads(raw)
    except (OSError, ValueError) as exc:
        raise LensError(f"{path}: not a readable JSON prompt set ({exc})") from None
    except RecursionError:  # json's decoder recurses once per level of nesting
        raise LensError(f"{path}: not a readable JSON prompt set (nested deeper than Python's recursion "
                        f"limit, {sys.getrecursionlimit()})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("items"), list) or not obj["items"]:
        raise LensError(f"{path}: expected {{\"items\": [...]}} with at least one item")
    items: list[PromptItem] = []
    for i, it in enumerate(obj["items"]):
        where = f"{path}: items[{i}]"
        if not isinstance(it, dict):
            raise LensError(f"{where}: not an object")
        prompt = it.get("prompt")
        if not isinstance(prompt, str):
            prompt = _messages(prompt, where)
        elif not prompt:
            raise LensError(f"{where}.prompt: empty")
        inter = it.get("intermediates")
        if not isinstance(inter, list) or not inter or not all(isinstance(w, str) and w.strip() for w in inter):
            raise LensError(f"{where}.intermediates: a non-empty list of non-empty strings")
        target = it.get("target")
        if target is not None and not isinstance(target, str):
            raise LensError(f"{where}.target: a string when given")
        items.append(PromptItem(name=str(it.get("name", i)), prompt=prompt, intermediates=list(inter), target=target))
    return PromptSet(name=set_name(path), path=str(path), sha256=hashlib.sha256(raw).hexdigest(), items=items)


def encode_item(tokenizer: Any, item: PromptItem, set_name: str, *, force_bos: bool = True) -> tuple[torch.Tensor, int]:
    """Token ids `[T]` of the prompt (chat prompts through the chat template) and the read position."""
    if isinstance(item.prompt, str):
        ids = list(tokenizer(item.prompt, add_special_tokens=True)["input_ids"])
    else:
        last_is_assistant = item.prompt[-1]["role"] == "assistant"
        text = tokenizer.apply_chat_template(item.prompt, tokenize=False, add_generation_prompt=not last_is_assistant,
                                             continue_final_message=last_is_assistant)
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    bos = getattr(tokenizer, "bos_token_id", None)
    if force_bos and bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    if not ids:
        raise LensError(f"item {item.name}: the prompt tokenizes to nothing")
    pos = len(ids) - 1
    if set_name in NEWLINE_SETS:
        newline = [i for i, t in enumerate(ids) if "\n" in tokenizer.decode([t])]
        if not newline:
            raise LensError(f"item {item.name} of set {set_name}: no newline token to read at")
        pos = newline[-1]
    return torch.tensor(ids, dtype=torch.long), pos
