"""Figures in free text, found and compared by code: the part of the labeller that reads numbers.

`find_figures` keeps the numbers written as claims (not file names, identifiers, ordinals, dates,
years, counts of the prompt's parts, references, list markers, the word `one`, or text the caller
names); "about"/"~" mark a figure `approx` without making it less asserted, a fall in words is
negative, and a range gives two figures marked `in_range`. `same_figure` compares after units
are normalised, allowing the answer's own rounding (coarser within `ROUNDING_SLACK`). The full
rules, with examples: docs/entitle.md, "Labels" ("Reading figures", "Same figure")."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

CURRENCY = {"$": "$", "us$": "$", "usd": "$", "dollar": "$", "dollars": "$", "€": "€", "eur": "€", "euro": "€",
            "euros": "€", "£": "£", "gbp": "£", "pound": "£", "pounds": "£"}
SCALE = {"k": 1e3, "thousand": 1e3, "m": 1e6, "mn": 1e6, "mm": 1e6, "million": 1e6, "b": 1e9, "bn": 1e9,
         "billion": 1e9}

#: how far a coarse rounding may be from the target (share of the target) when it counts at all
ROUNDING_SLACK = 0.10

_UNITS = {"zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
          "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15,
          "sixteen": 16, "seventeen": 17, "eighteen": 18, "nineteen": 19}
_TENS = {"twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80,
         "ninety": 90}
_WORD_SCALES = {"hundred": 100, "thousand": 1_000, "million": 1_000_000, "billion": 1_000_000_000}
_NUMBER_WORD = "|".join(sorted([*_UNITS, *_TENS, *_WORD_SCALES], key=len, reverse=True))

_APPROX = re.compile(r"(?:\b(?:about|around|approximately|approx\.?|roughly|nearly|almost|some)|~|≈)\s*$", re.I)
_CUR_PRE = r"(?P<cur>US\$|\$|€|£|USD|EUR|GBP)?\s?"
_DIGITS = r"(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
_SUFFIX = (r"(?:\s?(?P<scale>k|K|mn|MM|m|M|bn|b|B|thousand|million|billion)(?![A-Za-z]))?"
           r"(?:\s?(?P<pct>%|percent(?:age points?)?|per\s?cent|pct)(?![A-Za-z]))?"
           r"(?:\s?(?P<cur2>USD|usd|EUR|eur|GBP|dollars?|euros?|pounds?)(?![A-Za-z]))?")
# not glued to a letter, a digit or an identifier's hyphen (`P1`, `I-01`, `2025-Q4`) on the left,
# nor to a letter on the right (`3rd`, `12abc`); a leading minus sign is kept
_NUMERIC = re.compile(r"(?<![A-Za-z0-9_.])(?<![A-Za-z_]-)(?P<neg>-)?" + _CUR_PRE + _DIGITS + _SUFFIX
                      + r"(?![A-Za-z0-9])")
_WORDS = re.compile(rf"\b(?P<words>(?:{_NUMBER_WORD})(?:(?:[\s-]+|\s+and\s+)(?:{_NUMBER_WORD}))*)\b"
                    r"(?:\s?(?P<pct>percent|per\s?cent|%))?", re.I)
_MONTH = (r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|Sep(?:t(?:ember)?)?|"
          r"Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)\b")
_SMALL_WORD = r"(?:two|three|four|five|six|seven|eight|nine|ten)"
# a change written in words: `down 12%`, `fell by 12%`, `negative 12%` (never `fell to 12%`, a level) ...
_NEG_BEFORE = re.compile(r"\b(?:down|fell|fall(?:s|ing)?|dropped|drops?|declined|declines?|decreased|decreases?|"
                         r"shrank|shrunk|shrinks?|lost|loses?|contracted|minus|negative|decrease of|decline of|"
                         r"drop of|fall of|reduction of|loss of)\s+(?:by\s+)?"
                         r"(?:(?:about|around|approximately|roughly|nearly|some)\s+)?$", re.I)
# ... or after the figure: `a 12% loss`, `12% lower`
_NEG_AFTER = re.compile(r"^\s*(?:loss|decline|drop|decrease|fall|contraction|reduction|lower|less|down)\b", re.I)
_RANGE_JOIN = re.compile(r"^\s*(?:-|–|—|to|and)\s*$", re.I)
_BETWEEN = re.compile(r"(?:between|from)\s*$", re.I)
# spans whose numbers are never claims
_NOT_CLAIMS = [
    re.compile(r"[\w.-]+\.(?:csv|json|txt|md|xlsx?|pdf|docx?)\b", re.I),  # file names
    re.compile(r"\d{1,4}[-/]\d{1,2}[-/]\d{1,4}"),  # dates
    re.compile(r"\b(?:19|20)\d{2}[-/](?:(?:19|20)?\d{2}|\d{1,2})\b"),  # 2026-09, 2025-26, 2025-2026
    re.compile(r"\b\d{1,2}:\d{2}\b"),  # times
    re.compile(r"\b\d+/\d+\b"),  # 3/4, 2/5 (a fraction or a date: never read as one figure)
    re.compile(r"\b(?:row|rows|line|lines|task|step|section|item|column|col|page|table|figure|chapter|no\.|"
               r"number|phase|round|week|q|quarter|h|fy)\s*[:#]?\s*\d+(?:\s*(?:-|–|to|and)\s*\d+)?", re.I),
    re.compile(r"(?<![\w.])\d+(?:\.\d+)?-(?=[A-Za-z])"),  # compound modifiers: `11-person`, `40-door`
    re.compile(r"#\s*\d+"),
    re.compile(r"^\s*\d{1,2}[.)](?=\s)", re.M),  # list markers
    # dates with a month's name: `15 March`, `March 15th`
    re.compile(rf"\b\d{{1,2}}(?:st|nd|rd|th)?\s+(?:of\s+)?{_MONTH}|{_MONTH}\s+\d{{1,2}}(?:st|nd|rd|th)?\b", re.I),
    # counts of the prompt's own parts: `all 3 files`, `both two sheets`, `4 rows`
    re.compile(rf"\b(?:\d+|{_SMALL_WORD})\s+(?:files?|documents?|sheets?|attachments?|rows?|columns?|tables?)\b",
               re.I),
]


@dataclass(frozen=True)
class Figure:
    """One number as written: where (`start`, `end` in the text), its value with any scale word
    applied (`1.2 million` = 1,200,000; `12%` = 12), its unit (`%`, a currency symbol or ""), and
    the precision it was written with (`step`: one unit of its last digit, scaled)."""

    text: str
    start: int
    end: int
    value: float
    unit: str = ""
    currency: str = ""
    step: float = 1.0
    significant: int = 1
    decimals: int = 0
    round_step: float = 1.0  # the step an integer's trailing zeros imply (`4,200`: 100), else `step`
    approx: bool = False
    in_range: bool = False

    def to_json(self) -> dict[str, object]:
        return {"text": self.text, "start": self.start, "end": self.end, "value": self.value, "unit": self.unit,
                "currency": self.currency, "approx": self.approx, "in_range": self.in_range}


def _significant(digits: str) -> int:
    """Significant digits as written: leading zeros never count, an integer's trailing zeros
    neither (`30` has one, `30.0` three)."""
    whole, _, frac = digits.replace(",", "").partition(".")
    if frac:
        return len((whole + frac).lstrip("0")) or 1
    stripped = whole.lstrip("0").rstrip("0")
    return len(stripped) or 1


def _round_step(digits: str) -> float:
    """The rounding an integer's trailing zeros may stand for (`4,200`: 100, `30`: 10); one unit of
    the last digit for a number with decimals."""
    whole, _, frac = digits.replace(",", "").partition(".")
    if frac:
        return 10.0 ** -len(frac)
    zeros = len(whole) - len(whole.rstrip("0")) if whole.strip("0") else 0
    return 10.0 ** zeros


def _masked(text: str, extra: list[str]) -> str:
    """`text` with every non-claim span blanked (same length, so offsets hold)."""
    out = list(text)

    def blank(a: int, b: int) -> None:
        out[a:b] = " " * (b - a)

    for pattern in _NOT_CLAIMS:
        for m in pattern.finditer(text):
            blank(m.start(), m.end())
    for phrase in extra:
        if phrase and phrase.strip():
            for m in re.finditer(re.escape(phrase.strip()), text, re.I):
                blank(m.start(), m.end())
    return "".join(out)


def _words_value(words: str) -> int | None:
    """`twenty-five` -> 25, `one hundred and five` -> 105, `three thousand` -> 3000."""
    total, current, seen = 0, 0, False
    for w in re.split(r"[\s-]+", words.lower()):
        if w == "and" or not w:
            continue
        seen = True
        if w in _UNITS:
            current += _UNITS[w]
        elif w in _TENS:
            current += _TENS[w]
        elif w == "hundred":
            current = max(current, 1) * 100
        elif w in _WORD_SCALES:
            total += max(current, 1) * _WORD_SCALES[w]
            current = 0
        else:
            return None
    return total + current if seen else None


def find_figures(text: str, not_claims: list[str] | None = None, keep_years: set[float] | None = None) -> list[Figure]:
    """Every figure `text` asserts, in order (see module doc). `not_claims`: phrases whose numbers
    are not claims (an entity `Region 2`); `keep_years`: year-like values kept all the same
    (the fact's own values, when they look like years)."""
    masked = _masked(text, not_claims or [])
    found: list[Figure] = []
    for m in _NUMERIC.finditer(masked):
        num = m.group("num")
        value = float(num.replace(",", ""))
        scale_word = (m.group("scale") or "").lower()
        scale = SCALE.get(scale_word, 1.0)
        pct = m.group("pct") is not None
        cur = CURRENCY.get((m.group("cur") or m.group("cur2") or "").lower(), "")
        decimals = len(num.partition(".")[2])
        is_year = (not pct and not cur and scale == 1.0 and "." not in num and "," not in num
                   and 1900 <= value <= 2100 and len(num) == 4)
        if is_year and value not in (keep_years or set()):
            continue
        sign = -1.0 if m.group("neg") or _worded_negative(masked, m.start(), m.end()) else 1.0
        found.append(Figure(text=text[m.start():m.end()].strip(), start=m.start(), end=m.end(),
                            value=sign * value * scale, unit="%" if pct else "", currency=cur,
                            step=10.0 ** -decimals * scale, significant=_significant(num), decimals=decimals,
                            round_step=_round_step(num) * scale,
                            approx=bool(_APPROX.search(masked[:m.start()]))))
    for m in _WORDS.finditer(masked):
        words = m.group("words")
        if words.lower() == "one" and not m.group("pct"):
            continue  # "one of the", "no one": a pronoun far more often than a count
        count = _words_value(words)
        if count is None or any(f.start < m.end() and m.start() < f.end for f in found):
            continue
        sign = -1.0 if _worded_negative(masked, m.start(), m.end()) else 1.0
        found.append(Figure(text=text[m.start():m.end()], start=m.start(), end=m.end(), value=sign * count,
                            unit="%" if m.group("pct") else "", step=1.0, round_step=_round_step(str(count)),
                            significant=_significant(str(count)),
                            approx=bool(_APPROX.search(masked[:m.start()]))))
    found.sort(key=lambda f: f.start)
    return _mark_ranges(masked, found)


def _worded_negative(masked: str, start: int, end: int) -> bool:
    """Whether the figure at `start:end` is a fall written in words (`down 12%`, `a 12% loss`)."""
    return bool(_NEG_BEFORE.search(masked[max(0, start - 40):start]) or _NEG_AFTER.match(masked[end:end + 20]))


def _mark_ranges(masked: str, figs: list[Figure]) -> list[Figure]:
    """Mark both ends of `A-B`, `A to B`, `between A and B` as `in_range`; a unit written on one
    end only (`10-12%`) is given to both."""
    out = list(figs)
    for i in range(len(out) - 1):
        a, b = out[i], out[i + 1]
        gap = masked[a.end:b.start]
        if not gap.strip() and b.text.startswith("-") and b.value < 0:  # `10 - 12`: a dash, not a minus sign
            b = out[i + 1] = _replace(b, value=-b.value, text=b.text[1:].strip(), start=b.start + 1)
            gap = "-"
        between = _BETWEEN.search(masked[:a.start]) and re.fullmatch(r"\s*and\s*", gap, re.I)
        if _RANGE_JOIN.match(gap) and (gap.strip().lower() != "and" or between):
            unit = a.unit or b.unit
            cur = a.currency or b.currency
            out[i] = _replace(a, in_range=True, unit=unit, currency=cur)
            out[i + 1] = _replace(b, in_range=True, unit=unit, currency=cur)
    return out


def _replace(f: Figure, **changes: object) -> Figure:
    from dataclasses import replace

    return replace(f, **changes)  # type: ignore[arg-type]


def parse_value(text: str) -> Figure:
    """A fact's value as written in a file (`$1,200.50`, `40%`, `3.5`) as a `Figure`; ValueError
    when it holds no figure."""
    figs = find_figures(text, keep_years={float(text.strip())} if text.strip().isdigit() else None)
    if not figs:
        raise ValueError(f"not a figure: {text!r}")
    return figs[0]


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def _within(answer: float, target: float, answer_fig: Figure, target_fig: Figure) -> bool:
    """Equal, or `target` rounded to `answer_fig`'s precision: at two significant digits or more;
    coarser only when the answer says "about" (then an integer's trailing zeros are rounding too:
    `roughly $4,200` for $4,180) or the target has one decimal (`8%` for 8.4%), and then within
    `ROUNDING_SLACK` of the target (`about $2M` is not $1.5M)."""
    if _close(answer, target):
        return True
    step = answer_fig.round_step if answer_fig.approx else answer_fig.step
    if abs(answer - target) > step / 2 * (1 + 1e-9):
        return False
    if answer_fig.significant >= 2 and step == answer_fig.step:
        return True
    loose = answer_fig.approx or (target_fig.decimals == 1 and abs(target) >= target_fig.step * 10)
    return loose and abs(answer - target) <= ROUNDING_SLACK * abs(target)


def same_figure(answer: Figure, target: Figure) -> bool:
    """Whether `answer` (a figure of a model's answer) states `target` (a file's or a demanded
    value): the module doc's rule."""
    if answer.currency and target.currency and answer.currency != target.currency:
        return False
    if _within(answer.value, target.value, answer, target):
        return True  # as written: 12% ~ 12%, 12 ~ 12%, 1.2 million ~ 1,200,000
    if answer.unit == "%" and target.unit != "%":
        return _within(answer.value / 100.0, target.value, _replace(answer, step=answer.step / 100.0), target)
    if target.unit == "%" and answer.unit != "%":
        return _within(answer.value * 100.0, target.value, _replace(answer, step=answer.step * 100.0), target)
    return False
