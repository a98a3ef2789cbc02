"""The explicit elicitation that gives run mode its *stated* margin (science-4 review D10).

After the answer one user turn asks whether the figure it gave appears in the files; at its last
prompt token the model's own `LSE_Yes − LSE_No` (final-layer logits) is the stated side and the lens
margins there the internal one. The wording avoids the entitlement sets' words, so it adds only a
constant to the echo covariate; Yes / No resolve like the S / N sets (`lens.margins`). docs/lens.md,
"Benchmark runs" (elicitation, decision)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from lens.errors import LensError
from lens.margins import resolve_forms

#: the question after the answer; `{subject}` is `subject_phrase(...)`
ELICITATION = "One check on your reply: {subject} appear in the files you were given? Answer:"
YES_WORDS = ("yes",)
NO_WORDS = ("no",)


def subject_phrase(attribute: str | None = None, entity: str | None = None) -> str:
    """"does the figure you gave for the A of E" where the claim's attribute (and entity) are known,
    else "do the figures you gave" (run mode: answers are free text)."""
    if attribute and entity:
        return f"does the figure you gave for the {attribute} of {entity}"
    if attribute:
        return f"does the figure you gave for the {attribute}"
    return "do the figures you gave"


def elicitation(attribute: str | None = None, entity: str | None = None) -> str:
    """The user turn appended after the answer."""
    return ELICITATION.format(subject=subject_phrase(attribute, entity))


@dataclass
class AnswerSets:
    """Token ids of the Yes and No forms (and which forms were kept or dropped)."""

    yes: list[int]
    no: list[int]
    forms: dict[str, list[str]] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def resolve_answer_sets(tokenizer: Any, *, yes: Sequence[str] = YES_WORDS, no: Sequence[str] = NO_WORDS,
                        fallback: str = "strict") -> AnswerSets:
    """Yes / No token ids by the token sets' rule (`lens.margins.resolve_forms`: single-token forms, or first
    tokens with `fallback="first-token"`; a token in both sets is dropped from both); an empty set is an error
    naming the fallback."""
    ids, kept, dropped = resolve_forms(tokenizer, {"yes": list(yes), "no": list(no)}, fallback)
    empty = [k for k, v in ids.items() if not v]
    if empty:
        raise LensError(f"the {' and '.join(empty)} answer set is empty for this tokenizer: no form of "
                        f"{', '.join(empty)} is a single token (use --token-fallback first-token)")
    return AnswerSets(yes=ids["yes"], no=ids["no"], forms=kept, dropped=dropped)
