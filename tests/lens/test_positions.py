"""Position tagging from character spans under Llama-3-style and Qwen-style chat templates."""
from __future__ import annotations

import pytest

from lens.errors import LensError
from lens.positions import DECISION, QUESTION, RECORD, Span, char_span_tokens, tag_chat_prompt
from lens.probes import render_probe
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


def test_answer_tokens_follow_the_decision(qwen):
    _, tok = qwen
    msgs = [{"role": "user", "content": USER}]
    sp = [Span(s.name, s.cls, 0, s.start, s.end) for s in spans()]
    tag = tag_chat_prompt(tok, msgs, sp, answer="Supported, see a.csv row North.", answer_tokens=3)
    d = tag.positions["decision"]
    assert [tag.positions[f"answer_{k}"] for k in (1, 2, 3)] == [d + 1, d + 2, d + 3]
    assert tok.decode(tag.input_ids[:d + 1]).endswith("assistant\n")
    assert tok.decode(tag.input_ids[d + 1:]).startswith("Supported")


def test_claims_in_the_answer_are_decision_positions(qwen):
    _, tok = qwen
    msgs = [{"role": "user", "content": USER}]
    sp = [Span(s.name, s.cls, 0, s.start, s.end) for s in spans()]
    answer = "North sold 120 units. South sold 85 units."
    claims = [(0, answer.index(".") + 1), (answer.index("South"), len(answer))]
    tag = tag_chat_prompt(tok, msgs, sp, answer=answer, answer_tokens=1, claims=claims)
    d = tag.positions["decision"]
    c1, c2 = tag.positions["claim_1"], tag.positions["claim_2"]
    assert d < c1 < c2 < len(tag.input_ids)
    assert tok.decode(tag.input_ids[d + 1:c1 + 1]).strip() == "North sold 120 units."
    assert tok.decode(tag.input_ids[c1 + 1:c2 + 1]).strip() == "South sold 85 units."
    assert tag.classes["claim_1"] == tag.classes["claim_2"] == DECISION
    assert tag.claims == ["claim_1", "claim_2"]


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
    _, tok = llama
    row = {"files": [{"name": "a.csv", "content": "region,units\nNorth,120\nSouth,80\n"}],
           "claim": "According to a.csv, the units of North is 120.",
           "evidence": {"file": "a.csv", "start": 13, "end": 22}}
    msgs, sp, prefill = render_probe(row)
    tag = tag_chat_prompt(tok, msgs, sp, prefill=prefill)
    assert _decode(tok, tag, "evidence").strip() == "North,120"
    assert _decode(tok, tag, "claim").strip() == row["claim"]
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
