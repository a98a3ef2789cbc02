"""Fact extraction from task files (`lhd_train.bench.facts`): values kept whole, lines that hold
no value skipped, and drawn values in the same format and scale (issue 36 item 7)."""
from __future__ import annotations

import random

import pytest

from lhd_train.bench.facts import different_number, extract_facts, parse_number
from lhd_train.entitle.figures import parse_value


def _text_values(content: str) -> dict[str, str]:
    return {f.attribute: f.value_text for f in extract_facts("notes.txt", content, "text")}


@pytest.mark.parametrize(("line", "value"), [
    ("Amount: $1.5M at the seed price.", "$1.5M"),
    ("Market size: 2.4 million households", "2.4 million"),
    ("- Pro: $9.99/user/month (aggressive entry pricing)", "$9.99"),
    ("Rent: $3,600 per month", "$3,600"),
    ("Rent: $3,600/month", "$3,600"),
    ("Budget cap: $60,000.", "$60,000"),
    ("Runway: 18 months", "18"),
    ("Retention: 68% (strong)", "68%"),
    ("- Mobile platform: $350K", "$350K"),
    ("TAM: $2.5B+ annually", "$2.5B"),
    ("Error budget: 0.1% monthly", "0.1%"),
])
def test_text_values_are_kept_whole(line, value):
    facts = extract_facts("notes.txt", f"Intro line\n{line}\n", "text")
    assert [f.value_text for f in facts] == [value]
    f = facts[0]
    assert f"Intro line\n{line}\n"[f.line_start:f.line_end] == line


@pytest.mark.parametrize("line", [
    "Opening talk (Sat 09:00, 20 min): Dr. Marr, confirmed.",  # a clock time, not `Sat 09` = 00
    "IT staff are on call on Saturday from 08:00 to 18:00 only.",
    "Average contract value: $3,600-$18,000 annually",  # one end of a range is not the value
    "Customer growth: 50 -> 500 customers",  # a change, not one value
    "Proof: 2-week pilot plan template",  # a compound modifier
    "On-call: 24/7 pager",
])
def test_lines_without_one_value_give_no_fact(line):
    assert extract_facts("notes.txt", line + "\n", "text") == []


def test_csv_cells_with_scale_are_facts():
    content = "company,raised,users\nAcme,$1.5M,2.4 million\nBeta,$900K,12000\n"
    got = {(f.entity, f.attribute, f.value_text) for f in extract_facts("c.csv", content, "csv")}
    assert got == {("Acme", "raised", "$1.5M"), ("Acme", "users", "2.4 million"), ("Beta", "raised", "$900K"),
                   ("Beta", "users", "12000")}


@pytest.mark.parametrize(("value", "shape"), [
    ("$1.5M", r"\$\d+\.\dM"),
    ("2.4 million", r"\d+\.\d million"),
    ("$9.99", r"\$\d+\.\d\d"),
    ("$3,600", r"\$\d{1,3}(,\d{3})*"),
    ("31%", r"\d+%"),
    ("$350K", r"\$\d+K"),
])
def test_drawn_values_keep_format_and_scale(value, shape):
    import re

    rng = random.Random(3)
    x = parse_value(value)
    for _ in range(20):
        drawn = different_number(value, rng)
        assert re.fullmatch(shape, drawn), (value, drawn)
        y = parse_value(drawn)
        assert y.value != x.value
        # the same order of magnitude as X (the scale word kept): within a factor of 3 or 0.5 (the draws)
        assert 0.45 <= y.value / x.value <= 3.01, (value, drawn)


def test_parse_number_reads_scale_and_gap():
    p = parse_number("2.4 million")
    assert p is not None and (p.value, p.suffix, p.gap, p.decimals) == (2.4, "million", " ", 1)
    assert parse_number("$1.5M").write(3.0) == "$3.0M"
    assert parse_number("$3,600").write(5400) == "$5,400"
    assert parse_number("12 apples") is None
