"""Position tagging from character spans under Llama-3-style and Qwen-style chat templates."""
from __future__ import annotations

import pytest

from lens.errors import LensError
from lens.positions import DECISION, QUESTION, RECORD, Span, char_span_tokens, tag_chat_prompt
from lhd_train.reading.probes import render_probe
from lhd_train.tiny_model import QWEN_STYLE_TEMPLATE

USER = ("  <files>\n=== file: a.csv ===\nregion,units\nNorth,120\n</files>\nClaim: North sold 120 units.\n"
        "Question: Do the files support this claim?  ")
REC = (USER.index("<files>"), USER.index("</files>") + len("</files>"))
CLAIM = (USER.index("North sold"), USER.index("units.") + len("units."))
QUEST = (USER.index("Question"), USER.index("?") + 1)


def spans():
    return [Span("record", RECORD, 1, *REC), Span("claim", QUESTION, 1, *CLAIM), Span("question", QUESTION, 1, *QUEST),
            Span("evidence", RECORD, 1, USER.index("North,120"), USER.index("North,120") + len("North,120"))]


def _decode(tok, tag, name):
    return tok.decode([tag.input_ids[i] for i in tag.spans[name]])


@pytest.mark.parametrize("which", ["llama", "qwen3"])
def test_spans_map_to_their_tokens(which, llama, qwen):
    _, tok = llama if which == "llama" else qwen
    msgs = [{"role": "system", "content": "You check reports."}, {"role": "user", "content": USER}]
    tag = tag_chat_prompt(tok, msgs, spans(), prefill="Verdict:")
    assert _decode(tok, tag, "record").strip().startswith("<files>")
    assert _decode(tok, tag, "record").strip().endswith("</files>")
    assert _decode(tok, tag, "claim").strip() == "North sold 120 units."
    assert _decode(tok, tag, "question").strip().endswith("claim?")
    assert "North,120" in _decode(tok, tag, "evidence")
    # the record ends on the closing tag, before the claim; decision is the last prompt token (the prefill)
    p = tag.positions
    assert p["record_end"] < p["claim_end"] < p["question_end"] < p["user_turn_end"] < p["decision"]
    # the evidence is read as the mean over its tokens (docs/lens-background.md §5, r_evid), not at its last token
    assert "evidence_end" not in p and tag.pooled["evidence_mean"] == tag.spans["evidence"]
    assert max(tag.pooled["evidence_mean"]) <= p["record_end"] and tag.classes["evidence_mean"] == RECORD
    assert p["decision"] == len(tag.input_ids) - 1
    assert tok.decode(tag.input_ids[p["decision"]:]).endswith(":")
    assert tag.classes["record_end"] == RECORD and tag.classes["question_end"] == QUESTION
    assert tag.classes["decision"] == DECISION
    # the token right after the user content is the template's end of turn
    eot = tok.convert_ids_to_tokens(tag.input_ids[p["user_turn_end"]])
    assert eot == ("<|eot_id|>" if which == "llama" else "<|im_end|>")
    if which == "llama":  # Llama 3 templates put BOS and a default system block first
        assert tag.input_ids[0] == tok.bos_token_id


ANSWER = "North sold 120 units. South sold 85 units."
ASK = "Do the figures you gave appear in the files? Answer:"


def _with_answer(claims=()):
    """The run-mode layout: the task (user), the performer's answer (assistant), the elicitation (user)."""
    msgs = [{"role": "user", "content": USER}, {"role": "assistant", "content": ANSWER},
            {"role": "user", "content": ASK}]
    sp = [Span(s.name, s.cls, 0, s.start, s.end) for s in spans()]
    sp += [Span("answer", DECISION, 1, 0, len(ANSWER)), Span("elicitation", QUESTION, 2, 0, len(ASK))]
    return msgs, sp


@pytest.mark.parametrize("which", ["llama", "qwen3"])
def test_answer_tokens_sit_inside_the_answer_turn(which, llama, qwen):
    _, tok = llama if which == "llama" else qwen
    msgs, sp = _with_answer()
    tag = tag_chat_prompt(tok, msgs, sp, answer_tokens=3, judged="answer")
    a = tag.spans["answer"]
    assert tok.decode([tag.input_ids[i] for i in a]).strip() == ANSWER
    assert [tag.positions[f"answer_{k}"] for k in (1, 2, 3)] == a[:3]
    assert tag.positions["pre_answer"] == a[0] - 1 and tag.positions["answer_end"] == a[-1]
    assert tok.decode(tag.input_ids[a[0]:]).startswith("North sold")
    # the decision is the last token, after the elicitation turn and the generation prompt
    assert tag.positions["decision"] == len(tag.input_ids) - 1 > tag.positions["elicitation_end"] > a[-1]
    assert tok.decode([tag.input_ids[i] for i in tag.spans["elicitation"]]).strip() == ASK
    # the judged text starts at the answer: what comes before cannot see it (negative controls)
    assert tag.judged_start == a[0]
    assert not tag.sees_judged("record_end") and not tag.sees_judged("question_end")
    assert not tag.sees_judged("pre_answer") and not tag.sees_judged("evidence_mean")
    assert tag.sees_judged("answer_1") and tag.sees_judged("decision") and tag.sees_judged("user_turn_end")


def test_claims_in_the_answer_are_decision_positions(qwen):
    _, tok = qwen
    claims = [(0, ANSWER.index(".") + 1), (ANSWER.index("South"), len(ANSWER))]
    msgs, sp = _with_answer()
    tag = tag_chat_prompt(tok, msgs, sp, answer_tokens=1, claims=claims)
    a0 = tag.spans["answer"][0]
    c1, c2 = tag.positions["claim_1"], tag.positions["claim_2"]
    assert a0 <= c1 < c2 < tag.positions["decision"]
    assert tok.decode(tag.input_ids[a0:c1 + 1]).strip() == "North sold 120 units."
    assert tok.decode(tag.input_ids[c1 + 1:c2 + 1]).strip() == "South sold 85 units."
    assert tag.classes["claim_1"] == tag.classes["claim_2"] == DECISION
    assert tag.claims == ["claim_1", "claim_2"]
    assert tag.judged_start is None and tag.sees_judged("record_end")  # nothing judged: nothing is a control


def test_qwen3_think_block_and_template_without_system(qwen):
    _, tok = qwen
    old = tok.chat_template
    try:
        # Qwen3 with thinking off appends an empty think block after the generation prompt
        tok.chat_template = QWEN_STYLE_TEMPLATE.replace("think_block is defined and think_block", "true")
        tag = tag_chat_prompt(tok, [{"role": "user", "content": USER}],
                              [Span(s.name, s.cls, 0, s.start, s.end) for s in spans()], prefill="Verdict:")
        assert "</think>" in tok.decode(tag.input_ids[tag.positions["question_end"]:])
        assert tag.positions["decision"] == len(tag.input_ids) - 1
        # a template that rejects the system role (Gemma style): the system text is folded into the user turn
        tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}"
                             "{% endif %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] | trim }}<end_of_turn>\n"
                             "{% endfor %}"
                             "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
        msgs = [{"role": "system", "content": "You check reports."}, {"role": "user", "content": USER}]
        tag = tag_chat_prompt(tok, msgs, spans())
        assert _decode(tok, tag, "claim").strip() == "North sold 120 units."
    finally:
        tok.chat_template = old


def test_errors_are_clear(qwen):
    _, tok = qwen
    with pytest.raises(LensError, match="record"):
        tag_chat_prompt(tok, [{"role": "user", "content": USER}], [Span("claim", QUESTION, 0, *CLAIM)])
    old = tok.chat_template
    try:
        tok.chat_template = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
        with pytest.raises(LensError, match="not found verbatim"):
            tag_chat_prompt(tok, [{"role": "user", "content": USER}], [Span("record", RECORD, 0, *REC)])
    finally:
        tok.chat_template = old


def test_char_span_tokens():
    offsets = [(0, 0), (0, 3), (3, 7), (7, 8), (8, 12)]
    assert char_span_tokens(offsets, 3, 8) == [2, 3]
    assert char_span_tokens(offsets, 4, 5) == [2]
    assert char_span_tokens(offsets, 12, 14) == []


def test_probe_layout_positions(llama):
    """Claim first (science-4 D2): the record and the evidence come after the claim, so they can see it."""
    _, tok = llama
    row = {"files": [{"name": "a.csv", "content": "region,units\nNorth,120\nSouth,80\n"}],
           "claim": "According to a.csv, the units of North is 120.",
           "evidence": {"file": "a.csv", "start": 13, "end": 22}}
    msgs, sp, prefill = render_probe(row)
    assert msgs[1]["content"].startswith("Claim: According to a.csv") and msgs[1]["content"].endswith("claim?")
    tag = tag_chat_prompt(tok, msgs, sp, prefill=prefill, judged="claim")
    assert _decode(tok, tag, "evidence").strip() == "North,120"
    assert _decode(tok, tag, "claim").strip() == row["claim"]
    assert _decode(tok, tag, "record").strip().startswith("<files>")
    p = tag.positions
    assert p["claim_end"] < min(tag.pooled["evidence_mean"]) < p["record_end"] < p["question_end"] < p["decision"]
    assert all(tag.sees_judged(n) for n in ("record_end", "evidence_mean", "question_end", "decision"))
    # the record ends on the token holding the closing tag's ">"; Llama-3 and Qwen split rules fuse a
    # following newline into it (">\n"), as the project's tokenizer does
    assert tok.decode(tag.input_ids[tag.positions["record_end"]]).rstrip("\n").endswith(">")


def test_enable_thinking_switch_is_turned_off(qwen):
    _, tok = qwen
    old = tok.chat_template
    try:
        tok.chat_template = QWEN_STYLE_TEMPLATE.replace("think_block is defined and think_block",
                                                        "enable_thinking is defined and not enable_thinking")
        tag = tag_chat_prompt(tok, [{"role": "user", "content": USER}],
                              [Span(s.name, s.cls, 0, s.start, s.end) for s in spans()])
        assert tok.decode(tag.input_ids).endswith("<think>\n\n</think>\n\n")
    finally:
        tok.chat_template = old
