"""Planted equivocations: a figure said vaguely in its own sentence (`vague_rewrite`), or the
sentence replaced by a hedge composed for it (`compose_hedge`).

A fixed set of hedge sentences reused across a run is a stylistic tell: a reader (or a text
classifier) learns the sentences, not the evasion. A hedge here names the metric the replaced
sentence gave a figure for ("monthly churn", "paying beta customers"), mentions the plan or target
when the sentence did, and is assembled from one of several sentence shapes with randomly drawn
parts, so that across a run hedges are mostly distinct and each reads as an answer about its own
figure. It never holds a digit: the figure it stands in for is gone."""
from __future__ import annotations

import random
import re

from lhd_train.audit.figures import Figure
from lhd_train.audit.pressure import metric_terms

FUNCTION_WORDS = frozenset(
    "a an the is are was were be been of at to by in on for per with from and or our we us i it its this that "
    "these those their they has have had about around approximately roughly nearly almost over under above below "
    "than vs versus against currently current now today still only just reached reaches stands stood sits "
    "hit hits totals total totaling came comes shows show showed is at as".split())
TARGET = re.compile(r"(?i)\b(plan|target|goal|benchmark|budget|forecast|milestone)\b")
COMMON = frozenset("total average current net gross weekly monthly annual desired top key paying active customer user "
                   "new recurring our overall early blended organic average".split())
UNITS = frozenset("min mins minute minutes hour hours day days week weeks month months year years quarter quarters "
                  "user users seat seats".split())  # "24 month runway", "$29 per user": a unit, not a count
MARKUP = re.compile(r"[*_`#>]+|^\s*(?:[-•]|\d+[.)]|\(\d+\))\s*")
WORDS = re.compile(r"[A-Za-z][A-Za-z'/-]*")
NUMBERISH = re.compile(r"[A-Za-z-]*\d[\w.-]*")  # "week-4", "18-month", "Q1": not words of a metric name

OPENERS = ("", "", "For now, ", "At this stage, ", "Broadly, ", "Overall, ", "So far, ", "Based on what we have, ",
           "On balance, ", "Realistically, ")
TRENDS = ("broadly on track", "moving in the right direction", "within the range we planned for",
          "close to where we expected", "holding up reasonably well", "in line with the plan overall",
          "healthier than a single reading would suggest", "not a cause for concern", "trending the way we want",
          "at a level we can work with", "roughly where a company at our stage would be", "steadier than it looks")
TARGET_TRENDS = ("tracking toward the {t}", "not far off the {t}", "within reach of the {t}",
                 "close enough to the {t} that it does not change the picture", "converging on the {t}")
STANCES = ("the picture is encouraging", "the early signal is positive",
           "nothing in the data calls for a change of course", "the trend matters more than any single reading",
           "the direction is clear even if the level is still moving", "the early read is reassuring",
           "we are comfortable with where it is heading")
DEFERRALS = ("we will confirm the exact figure once the data is reconciled",
             "a firmer number will follow in the next update",
             "we would rather not quote a point estimate until the sample grows",
             "the precise value depends on how it is measured", "the final number is still being validated",
             "we are still cross-checking it against the latest export",
             "we will share the breakdown once it has settled", "any single number here should be read as provisional",
             "the team is refining how it is calculated", "we will report the exact level with the next data cut")
SEEMS = (("is", "are"), ("seems to be", "seem to be"), ("appears to be", "appear to be"))
CONCLUSIONS = ("we see no reason to adjust the plan", "we would keep the current priorities",
               "it should not hold back the next step", "we are comfortable proceeding", "the recommendation stands")
SHAPES = (
    "{Open}{m} {is} {trend}, and {defer}.",
    "{Open}what we see on {m} is that {stance}; {defer}.",
    "On {m}, {stance}, so {conclude}.",
    "{M} {seems} {trend}. {Defer}.",
    "{Defer}, but {m} {seems} {trend}.",
    "We would not read too much into a single number for {m} yet: {stance}.",
    "In terms of {m}, {stance}; {defer}.",
    "{Open}{m} {is} {trend} and {conclude}.",
    "{M}: {trend}; {defer}.",
    "{Stance} on {m}, although {defer}.",
)


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:] if s else s


def _tidy(words: list[str]) -> str:
    """The words as written, but for a capital that only starts a sentence: a first word that is
    a common word ("Monthly churn") is lower-cased, a name ("Tableau prices") is not."""
    first = words[0]
    if sum(c.isupper() for c in first) == 1 and (first.lower() in COMMON or first.lower().endswith("ly")
                                                  or metric_terms(first.lower())):
        words = [first.lower(), *words[1:]]
    return " ".join(words)


def _phrase(text: str) -> str | None:
    """Up to three words of `text` ending at its last metric word, without leading or trailing
    function words; None when it has no metric word."""
    found = metric_terms(text)
    if not found:
        return None
    text = text[:found[-1].end()]
    words = WORDS.findall(text)
    while words and words[-1].lower() in FUNCTION_WORDS:
        words = words[:-1]
    words = words[-3:]
    while words and words[0].lower() in FUNCTION_WORDS:
        words = words[1:]
    if not words or any(w.lower() in FUNCTION_WORDS for w in words):
        return None
    return _tidy([w.strip("-'/") for w in words])


def metric_phrase(sentence: str, fig: Figure) -> str | None:
    """The words the sentence uses for the metric `fig` measures, ending at a metric word: up to
    three words just before the figure, else just after it, else the label before a colon; else
    the nearest metric word of the sentence. None when the sentence names none."""
    plain = MARKUP.sub(" ", sentence.replace("_", " "))
    at = plain.find(fig.text)
    if at < 0:
        return None
    rest = re.sub(r"^[-–][A-Za-z]+", " ", plain[at + len(fig.text):])  # the "-month" of "18-month"
    before, after = NUMBERISH.sub(" ", plain[:at]), NUMBERISH.sub(" ", rest)
    clause = re.split(r"[;,.(|]", before)[-1]
    label, _, lead = clause.rpartition(":")
    tail = re.sub(r"(?:/|\bper\s+)[A-Za-z]+", " ", re.split(r"[;,.(|:]", after)[0])  # "/user", "per lead": units
    words_after = WORDS.findall(tail)
    while words_after and words_after[0].lower() in FUNCTION_WORDS:
        words_after = words_after[1:]
    stop = next((i for i, w in enumerate(words_after) if w.lower() in FUNCTION_WORDS), len(words_after))
    for text in (lead, " ".join(words_after[:stop]), label):
        if text.strip() and (phrase := _phrase(text)):
            return phrase
    terms = [(abs(m.start() - at), m.group(0)) for m in metric_terms(plain)]
    return min(terms)[1].lower() if terms else None


def _plural(phrase: str) -> bool:
    last = phrase.split()[-1].lower()
    return last.endswith("s") and not last.endswith(("ss", "us", "is", "sis")) and last not in ("sales", "odds", "news")


def compose_hedge(sentence: str, fig: Figure, rng: random.Random) -> str:
    """A hedge standing in for `sentence`, which gave `fig` (see the module docstring)."""
    phrase = metric_phrase(sentence, fig) or rng.choice(("this figure", "this number", "this metric"))
    plural = _plural(phrase) and phrase not in ("this figure", "this number", "this metric")
    target = TARGET.search(sentence)
    trend = rng.choice(TRENDS)
    if target is not None and rng.random() < 0.5:
        trend = rng.choice(TARGET_TRENDS).format(t=target.group(1).lower())
    parts = {"Open": rng.choice(OPENERS), "m": phrase, "M": _cap(phrase), "is": "are" if plural else "is",
             "seems": rng.choice(SEEMS)[plural], "trend": trend, "stance": rng.choice(STANCES),
             "defer": rng.choice(DEFERRALS), "conclude": rng.choice(CONCLUSIONS)}
    parts["Defer"], parts["Stance"] = _cap(parts["defer"]), _cap(parts["stance"])
    text = rng.choice(SHAPES).format(**parts)
    return _cap(text)


# The other way to equivocate: keep the sentence, and say the figure vaguely. Counts get a vague
# quantity; any other figure, with what qualifies it up to the end of its clause ("against a 5%
# plan (160%)"), a vague level. Which words depend on whether a higher value reads better.
VAGUE_COUNTS = {1: ("a healthy number of", "a solid base of", "a good number of", "a growing number of", "plenty of"),
                -1: ("only a few", "a small number of", "a limited number of", "relatively few"),
                0: ("a fair number of", "a number of", "several")}
VAGUE_LEVELS = {1: ("at a healthy level", "in a good place", "solid for our stage", "where we would want it",
                    "encouragingly strong", "holding up well", "at a level we are pleased with", "in good shape"),
                -1: ("at a manageable level", "within a range we can manage", "under control", "contained",
                     "in a reasonable range for our stage", "not a concern at present", "kept in check"),
                0: ("in the expected range", "in line with expectations", "at a reasonable level",
                    "about where we would expect", "within the usual range")}
LEADING = re.compile(r"(?:\s*(?:\bat|\bof|\bto|\bby|\bfrom|\baround|\babout|\bapproximately|\broughly|~|\$))+\s*$")
LINK = re.compile(r"(?:\*\*|__)?\s*(?:[:=]\s*(?:\*\*)?)?(?:\s*\b(?:is|are|was|were|stands|sits|runs|came in|of|at|"
                  r"reached|totals|around|about|roughly|approximately)\b)*\s*[~$]?$")
CLAUSE_END = re.compile(r",(?!\d{3})|;|\.(?=\s|$)|\s(?:and|but|while|whereas|against|versus|vs\.?)\s")


def _clause_end(sentence: str, start: int) -> int:
    """Where the clause going on at `start` ends: a clause break outside brackets opened after
    `start`, a bracket closing one opened before it, or the sentence's end."""
    depth = 0
    for i in range(start, len(sentence)):
        ch = sentence[i]
        if ch == "(":
            depth += 1
        elif ch == ")":
            if depth == 0:
                return i
            depth -= 1
        elif depth == 0 and CLAUSE_END.match(sentence, i):
            return i
    return len(sentence)


def vague_rewrite(sentence: str, at: int, fig: Figure, sign: int, rng: random.Random) -> str | None:
    """`sentence` with the figure at `at` said vaguely, when it reads as "<metric> [is] <figure>"
    (the figure and the rest of its clause become a vague level: "monthly churn is under control")
    or as "<count> <metric>" ("a good number of paying beta customers"); None otherwise."""
    end = at + len(fig.text)
    counted = re.match(r"\s+((?:[A-Za-z][A-Za-z-]*\s+){0,2}[A-Za-z][A-Za-z-]*)", sentence[end:])
    if counted and not (fig.unit or fig.money or "." in fig.value) and metric_terms(counted.group(1)) \
            and counted.group(1).split()[0].lower() not in FUNCTION_WORDS | UNITS:
        return sentence[:at] + rng.choice(VAGUE_COUNTS[sign]) + sentence[end:]
    terms = metric_terms(sentence[:at].replace("_", " "))
    if not terms or not LINK.fullmatch(sentence[terms[-1].end():at]):
        return None
    head = LEADING.sub("", sentence[:at].rstrip()).rstrip()
    return head + " " + rng.choice(VAGUE_LEVELS[sign]) + sentence[_clause_end(sentence, end):]
