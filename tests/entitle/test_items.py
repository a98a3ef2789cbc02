"""Items and conditions: each condition's files say what it claims (checked with a plain regex
over the rendered text, not with the labeller's own figure reader)."""
from __future__ import annotations

import re

import pytest

from lhd_train.bench.prompts import Prompts
from lhd_train.bench.taskpack import load_pack
from lhd_train.entitle.conditions import Condition, conditions, files_of, render
from lhd_train.entitle.items import build_items

# a number not glued to an identifier (`F6`, `I-09`, `3PL`: not figures, docs/entitle.md)
NUMBER = re.compile(r"(?<![\w.])(?<![A-Za-z]-)(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?![A-Za-z])")


def numbers(files) -> set[float]:
    """Every number of the files (CSV: cell by cell, so `44,156` is two numbers)."""
    cells = [re.sub(r"\d{4}-\d{2}-\d{2}|\d{1,2}:\d{2}|^\s*\d{1,2}[.)](?=\s)", " ", c, flags=re.M)  # dates, times
             # and list markers hold no figures
             for f in files for c in (re.split(r"[,\n]", f.content) if f.type == "csv" else [f.content])]
    return {float(n.replace(",", "")) for c in cells for n in NUMBER.findall(c)}


def value(text: str) -> float:
    return float(re.sub(r"[^\d.\-]", "", text))


@pytest.fixture(scope="module")
def pack_items():
    pack = load_pack("lhd_startup_consulting")
    items, report = build_items(pack, 30, seed=3)
    return pack, items, report


def test_items_are_spread_over_tasks_and_reproducible(pack_items):
    pack, items, report = pack_items
    assert len(items) == 30 and report.kept == 30
    assert len({i.task for i in items}) >= 10
    again, _ = build_items(pack, 30, seed=3)
    assert [i.to_json() for i in again] == [i.to_json() for i in items]
    assert [i.to_json() for i in build_items(pack, 30, seed=4)[0]] != [i.to_json() for i in items]
    capped, _ = build_items(pack, 30, seed=3, per_task=1)
    assert len({i.task for i in capped}) == len(capped)


def test_each_condition_shows_what_it_says(pack_items):
    pack, items, _ = pack_items
    for item in items:
        task = pack.task(item.task)
        x, x2, y = value(item.value), value(item.altered), value(item.demanded)
        assert len({x, x2, y}) == 3
        variants = {c: files_of(task, item, c) for c in ("full", "deleted", "altered")}
        full, deleted, altered = ("\n".join(f.content for f in variants[c]) for c in ("full", "deleted", "altered"))
        assert x in numbers(variants["full"]) and x not in numbers(variants["deleted"]), item.fact_id  # nowhere else
        assert y not in numbers(variants["full"]) and x2 not in numbers(variants["full"]), item.fact_id
        assert x2 in numbers(variants["altered"]) and len(altered) - len(full) == len(item.altered) - len(item.value)
        # the altered file differs from the full one on the evidence line only
        diff = [a for a, b in zip(full.splitlines(), altered.splitlines(), strict=True) if a != b]
        assert diff == [full[item.line[0]:item.line[1]]] or len(diff) == 1
        assert len(deleted.splitlines()) == len(full.splitlines()) - 1


def test_rendered_messages(pack_items):
    pack, items, _ = pack_items
    item = items[0]
    none = render(pack, item, Condition("full", "none"), Prompts())
    demand = render(pack, item, Condition("full", "demand"), Prompts())
    system, user = none.messages
    assert system["role"] == "system" and pack.description in system["content"]
    assert user["content"].index(none.question) < user["content"].index("=== ATTACHED FILES ===")
    assert item.demanded not in user["content"].split("=== ATTACHED FILES ===")[0]
    demanded_text = demand.messages[1]["content"]
    assert "WHAT IS HAPPENING AT WORK" in demanded_text and item.demanded in demanded_text
    assert "WHAT IS HAPPENING AT WORK" not in user["content"]
    # the question's tokens come before anything that differs between the files conditions
    prefixes = [render(pack, item, c, Prompts()).messages[1]["content"] for c in conditions(False)]
    shared = min(len(p) for p in prefixes)
    for i in range(shared):
        if len({p[i] for p in prefixes}) > 1:
            break
    assert prefixes[0].index(none.question) + len(none.question) <= i
    assert (none.shown, none.demanded) == (item.as_label_value(item.value), None)
    assert render(pack, item, Condition("deleted", "demand"), Prompts()).shown is None


def test_control_question_is_about_another_tasks_fact(pack_items):
    pack, items, report = pack_items
    for item in items:
        if item.control is None:
            continue
        assert item.control.task != item.task
        text = "\n".join(f.content for f in pack.task(item.task).files).lower()
        assert (item.control.entity or item.control.attribute).lower() not in text
        r = render(pack, item, Condition("control", "none"), Prompts())
        assert r.shown is None and (item.control.entity or item.control.attribute) in r.question
    assert report.no_control == sum(i.control is None for i in items)
