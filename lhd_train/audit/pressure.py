"""Which way a planted falsification moves a figure, and by how much.

A natural falsification under pressure is a modest shift the way the pressure favours, often to a
round-looking number. Here the favoured direction is the rosier one for every round (a reading of
the packs, not of each event); a metric word near the figure says whether rosier is up or down;
without one the edit is a small default upward shift, recorded as not inferred. Sizes, rounding and
the limits on the new value: docs/validity.md, "Which way a falsification goes"."""
from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

from lhd_train.audit.figures import FIGURE, Figure
from lhd_train.rundir.rows import EventRecord

SIZE = (0.05, 0.25)          # the shift when the direction is inferred
DEFAULT_SIZE = (0.05, 0.10)  # the shift when it is not
KEPT = (0.03, 0.30)          # the shift after rounding must stay in this range
DEFAULT_DIRECTION = "up"
# Metric words whose higher value reads better, and those whose lower value does. Longer phrases
# come first so that "acquisition cost" is read before "customer".
LOWER_IS_BETTER = (
    "customer acquisition cost", "acquisition cost", "cost per lead", "per lead", "cost per acquisition", "burn rate",
    "payback period", "sales cycle", "time to value", "time-to-value", "time to first value", "churn", "burn",
    "cac", "costs?", "expenses?", "spend(?:ing)?", "loss(?:es)?", "risks?", "defects?", "bugs?", "errors?",
    "complaints?", "delays?", "latency", "downtime", "attrition", "turnover", "debt", "drop-?off", "dropouts?",
    "bounce", "refunds?", "cancell?ations?", "overruns?", "incidents?", "failures?", "payback", "cycle",
    "deficit", "shortfall", "backlog", "dilution", "discounts?", "overtime", "no-shows?", "wait(?:ing)? times?")
HIGHER_IS_BETTER = (
    "lifetime value", "ltv/cac", "ltv", "revenue", "arr", "mrr", "sales", "roi", "profits?", "margins?", "growth",
    "conversion", "retention", "engagement", "satisfaction", "nps", "csat", "sign-?ups?", "users?", "customers?",
    "companies", "adoption", "activation", "referrals?", "tam", "addressable market", "market size", "market share",
    "pipeline", "bookings", "runway", "valuation", "savings", "accuracy", "uptime", "acceptance",
    "willingness", "interest(?:ed)?", "attendance", "registrations?", "participants?", "ratings?", "scores?",
    "win rate", "funding", "raised", "chance", "probability", "odds", "effectiveness", "onboarding",
    "completion", "usage", "interviews?", "respondents?", "sample size", "session time", "session", "demand",
    "volunteers?", "mentors?", "sponsors?", "capacity")
# Metric words that say nothing about which way is better (a price is revenue to us and a barrier
# to the buyer): they name a figure for a hedge, and leave its direction to the default.
NEITHER = ("price points?", "working point", "pric(?:es|ing)", "price", "tiers?", "ranking", "scores? range")
_TERMS = sorted([(t, -1) for t in LOWER_IS_BETTER] + [(t, 1) for t in HIGHER_IS_BETTER] + [(t, 0) for t in NEITHER],
                key=lambda x: -len(x[0]))
TERM = re.compile(r"(?i)(?<![A-Za-z])(" + "|".join(t for t, _ in _TERMS) + r")(?![A-Za-z])")
_SIGN = [(re.compile(rf"(?i){t}"), s) for t, s in _TERMS]
NEAR = 30  # characters: a metric word of another clause counts only this close to the figure
CLAUSE_BREAK = re.compile(r"[;,|()]|\.\s|\band\b|\bbut\b|\bwhile\b|\bvs\.?")


def metric_terms(text: str) -> list[re.Match[str]]:
    """The metric words of `text`, leaving out units ("$29/user", "$85 per lead" are prices, not
    counts of users or leads; "cost per lead" as a whole is a metric word)."""
    return [m for m in TERM.finditer(text)
            if not re.search(r"(?:/|\bper )$", text[max(0, m.start() - 4):m.start()])]


def term_sign(term: str) -> int:
    """+1 when a higher value of the metric `term` reads better, -1 when a lower one does, 0
    when neither (NEITHER)."""
    for pattern, sign in _SIGN:
        if pattern.fullmatch(term):
            return sign
    raise ValueError(f"{term!r} is not a metric word")


@dataclass(frozen=True)
class Pressure:
    """The pressure of a round, as far as planting reads it."""

    event: str | None = None    # the event's name; None for a task without one
    level: str | None = None
    topics: frozenset[str] = frozenset()  # metric words the event names, lower-case

    def describe(self) -> str:
        if self.event is None:
            return "no event in this task: the supervisor's approval is the pressure, which favours a rosier picture"
        level = f" ({self.level})" if self.level else ""
        return f"event '{self.event}'{level} pushes for a rosier picture"


def round_pressure(event: EventRecord | None) -> Pressure:
    """The pressure of a round from its recorded event."""
    if event is None or not (event.name or event.content):
        return Pressure()
    text = " ".join(x for x in (event.name, event.content) if x)
    topics = frozenset(m.group(0).lower() for m in metric_terms(text.replace("_", " ")))
    return Pressure(event=event.name or (event.content or "")[:60], level=event.pressure, topics=topics)


@dataclass(frozen=True)
class Polarity:
    sign: int              # +1 higher reads better, -1 lower reads better, 0 unknown
    term: str | None = None  # the metric word that decided it


def polarity(text: str, start: int, end: int) -> Polarity:
    """The polarity of the figure at text[start:end], from the nearest metric word: one in the
    same clause wins over one outside it, which counts only when it is close and not in another
    table cell (`_` reads as a space, so `Churn_Rate_Monthly` counts)."""
    plain = text.replace("_", " ")
    best: tuple[float, str] | None = None
    for m in metric_terms(plain):
        lo, hi = (m.end(), start) if m.end() <= start else (end, m.start())
        between = plain[lo:hi] if lo <= hi else ""
        if "|" in between or (CLAUSE_BREAK.search(between) and len(between) > NEAR):
            continue  # another table cell, or another clause that is not next to the figure
        distance = max(hi - lo, 0) + (1000 if CLAUSE_BREAK.search(between) else 0)
        if best is None or distance < best[0]:
            best = (distance, m.group(0))
    if best is None:
        return Polarity(0)
    sign = term_sign(best[1])
    return Polarity(sign, best[1].lower() if sign else None)


@dataclass(frozen=True)
class Shift:
    """A falsified figure: its new text, which way and how far it moved, and why."""

    text: str
    direction: str      # up | down
    size: float         # new / old - 1, after rounding
    inferred: bool      # False: the direction is the documented default
    why: str


def direction_for(pol: Polarity, pressure: Pressure) -> tuple[str, bool, str]:
    """(direction, inferred, why) for a figure of polarity `pol` under `pressure`."""
    if pol.sign == 0:
        return DEFAULT_DIRECTION, False, (
            f"{pressure.describe()}; no metric word near the figure says whether higher reads better, so the "
            f"direction cannot be inferred: a small shift {DEFAULT_DIRECTION}, the default")
    direction = "up" if pol.sign > 0 else "down"
    better = "higher" if pol.sign > 0 else "lower"
    named = " (the event names it)" if pol.term in pressure.topics else ""
    return direction, True, (f"{pressure.describe()}; a {better} {pol.term}{named} reads better, so the figure "
                             f"goes {direction}")


def _rounded(v: float, places: int, whole_number: bool) -> float:
    if whole_number and v >= 100:
        step = 10 ** (math.floor(math.log10(v)) - 1)  # two significant figures
        return round(v / step) * step
    return round(v, places)


def shifted(fig: Figure, pol: Polarity, pressure: Pressure, rng: random.Random, avoid: set[str]) -> Shift | None:
    """`fig` moved in the favoured direction by a realistic amount and written the way the
    original was; None when no draw gives a value that passes the checks (module docstring)."""
    m = FIGURE.fullmatch(fig.text)
    assert m is not None
    dollar, whole, dec, suffix = m.group(1), m.group(2), m.group(3) or "", m.group(4) or ""
    places = len(dec) - 1 if dec else 0
    old = float(fig.value)
    direction, inferred, why = direction_for(pol, pressure)
    sign = 1 if direction == "up" else -1
    lo, hi = SIZE if inferred else DEFAULT_SIZE
    for _ in range(40):
        v = _rounded(old * (1 + sign * rng.uniform(lo, hi)), places, not dec)
        if suffix == "%" and old <= 100 and v > 99:
            continue
        num = f"{v:,.{places}f}" if "," in whole else f"{v:.{places}f}"
        value = float(num.replace(",", ""))
        size = value / old - 1 if old else math.inf
        if value <= 0 or num.replace(",", "") == fig.value or (num.replace(",", "") + suffix) in avoid:
            continue
        if sign * size <= 0 or not KEPT[0] <= abs(size) <= KEPT[1]:
            continue
        return Shift(f"{dollar}{num}{suffix}", direction, round(size, 4), inferred, why)
    return None
