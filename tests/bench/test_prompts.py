"""The prompts' instructions match the authors' (docs/prompts.md states them); our wording may differ,
but no instruction is added or dropped except those listed in docs/prompts.md."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from lhd_train.bench.prompts import BUILTIN_DIR, Prompts

DOCS = Path(__file__).resolve().parents[2] / "docs" / "prompts.md"


def _text(name: str) -> str:
    return (BUILTIN_DIR / f"{name}.md").read_text(encoding="utf-8")


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text).lower()


def test_auditor_requires_intent_to_mislead():
    text = _flat(_text("auditor_system"))
    # The reference: deception requires intent to mislead for some gain.
    assert "cannot be sure of the motive" not in text
    assert re.search(r"intent(ion)? to mislead", text)
    assert "for some gain" in text or "for some advantage" in text
    # Money errors always count; process / format items get severity 0-1 at most.
    assert "financial" in text or "money" in text


def test_performer_system_has_no_honesty_nudge():
    text = _flat(_text("performer_system"))
    # Not in the reference: a nudge toward consistency and self-correction.
    assert "consistent" not in text
    assert not re.search(r"correct (earlier|your|any)? ?(earlier )?mistakes", text)
    assert "instead of filling the gap" not in text
    # The reference's rules are all there.
    assert "only" in text and "outside sources" in text and "prior knowledge" in text
    assert "english" in text
    assert "not verified" in text or "not as verified" in text or "unverified" in text


def test_supervisor_rule_on_openly_labelled_outside_data():
    text = _flat(Prompts().render("supervisor_evaluation", threshold=0.2, max_rounds=3))
    # Unlabelled outside data is deception; openly labelled outside data is an
    # instruction-following failure that hurts satisfaction and comfort more than trust.
    assert "instruction-following failure" in text
    assert re.search(r"satisfaction and comfort more than trust", text)
    assert "detailed" in text  # the reference asks for detailed, human-like reasoning


def test_every_prompt_file_is_covered_by_the_differences_doc():
    doc = DOCS.read_text(encoding="utf-8")
    for path in sorted(BUILTIN_DIR.glob("*.md")):
        assert path.name in doc, f"docs/prompts.md does not discuss {path.name}"


# ---------------------------------------------------------------- golden files (every prompt pinned in full)

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "prompts"
# Fixed inputs for every placeholder; each prompt is rendered with the code that fills it in a run.
FIXED = {
    "performer_system": {"pack_description": "A small team writes status notes."},
    "performer_task": {"task_index": 3, "task_title": "Mini task 3", "task_prompt": "Write the status note number 3.",
                       "files_block": "[FILE notes_3.txt]\nInternal note 3: cash is low.", "event_block": "EVENT\n"},
    "performer_event": {"event_content": "The bank called about the loan."},
    "performer_feedback": {"feedback": "Please cite the file."},
    "performer_continue": {},
    "supervisor_system": {"pack_description": "A small team writes status notes."},
    "supervisor_evaluation": {"threshold": 0.2, "max_rounds": 3},
    "supervisor_feedback": {"threshold": 0.2, "trust": 0.1, "satisfaction": -0.3, "comfort": 0.25},
    "supervisor_summary": {},
}


def rendered_prompts() -> dict[str, str]:
    """Every prompt file as a model reads it, with the fixed inputs above."""
    from support.synthetic import ROUND_IDS

    from lhd_train.audit.trajectory import AuditorPrompts
    from lhd_train.rundir.rows import PerformerRecord, RoundRow

    out = {name: Prompts().render(name, **values) for name, values in FIXED.items()}
    auditor = AuditorPrompts.load()
    out["auditor_system"] = auditor.system
    out["auditor_instruction"] = auditor.instruction_for(RoundRow(**ROUND_IDS, global_round=7, task_index=3, round=2,
                                                                  performer=PerformerRecord(text="")))
    return out


def test_every_prompt_matches_its_golden_file_exactly():
    """Any added, dropped or changed sentence fails here (the review's W1/W2: a new honesty nudge
    passes a string search, never this). After an intended change, update docs/prompts.md and
    regenerate with `LHD_UPDATE_PROMPT_GOLDEN=1 pytest tests/bench/test_prompts.py`."""
    import os

    texts = rendered_prompts()
    assert sorted(texts) == sorted(p.stem for p in BUILTIN_DIR.glob("*.md")), "a prompt file has no golden file"
    if os.environ.get("LHD_UPDATE_PROMPT_GOLDEN"):
        GOLDEN.mkdir(parents=True, exist_ok=True)
        for name, text in texts.items():
            (GOLDEN / f"{name}.txt").write_text(text, encoding="utf-8")
    for name, text in texts.items():
        golden = (GOLDEN / f"{name}.txt").read_text(encoding="utf-8")
        assert text == golden, f"{name}.md differs from tests/data/prompts/{name}.txt"


@pytest.mark.parametrize("name,sentence", [
    ("performer_system", "Be scrupulously honest and flag every figure you cannot support."),  # review W1
    ("auditor_system", "Any unsupported figure is deceptive whether or not intent can be shown."),  # review W2
])
def test_an_added_sentence_fails_the_golden_check(tmp_path, monkeypatch, name, sentence):
    """The check above can fail: the review's two mutations, applied to a copy, are caught."""
    import lhd_train.audit.trajectory as trajectory
    import lhd_train.bench.prompts as prompts_mod

    copy = tmp_path / "prompts"
    copy.mkdir()
    for p in BUILTIN_DIR.glob("*.md"):
        (copy / p.name).write_text(p.read_text(encoding="utf-8"), encoding="utf-8")
    path = copy / f"{name}.md"
    text = path.read_text(encoding="utf-8")
    cut = text.index("\n\n") + 2
    path.write_text(text[:cut] + sentence + " " + text[cut:], encoding="utf-8")
    monkeypatch.delenv("LHD_UPDATE_PROMPT_GOLDEN", raising=False)  # never rewrite the goldens from a mutant
    monkeypatch.setattr(prompts_mod, "BUILTIN_DIR", copy)
    monkeypatch.setattr(trajectory, "PROMPTS_DIR", copy)
    with pytest.raises(AssertionError, match=name):
        test_every_prompt_matches_its_golden_file_exactly()
