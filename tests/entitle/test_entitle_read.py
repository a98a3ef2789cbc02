"""`lhd entitle read` on the tiny model: the positions are the tokens they claim to be, a margin
equals the one computed from the model's own output, the negative control is flat, and every
paired AUROC recounts from margins.csv; plus the paired AUROC against sklearn and by hand."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from scipy.special import logsumexp
from sklearn.metrics import roc_auc_score

from lens.elicit import elicitation, resolve_answer_sets
from lens.entitle_positions import answer_tokens
from lens.entitle_read import EntitleReadConfig, read_entitle
from lens.errors import LensError
from lens.margins import resolve_token_sets
from lens.model import load_hf
from lens.paired_auroc import paired_auroc
from lens.readout import JacobianLens, LogitLens
from lens.store import Lens
from lhd_train.bench.prompts import Prompts
from lhd_train.bench.taskpack import load_pack
from lhd_train.entitle.conditions import Condition, render
from lhd_train.entitle.items import build_items
from lhd_train.entitle.labels import label_answer


def test_paired_auroc_is_the_ordinary_auroc_within_one_group():
    rng = np.random.default_rng(1)
    s, y = rng.normal(size=40), rng.random(40) < 0.4
    r = paired_auroc(s, y, ["f"] * 40, n_boot=0)
    assert r.auroc == pytest.approx(roc_auc_score(y, s)) and r.n_pairs == y.sum() * (~y).sum()


def test_paired_auroc_by_hand():
    # fact a: pos 3 vs neg 1, 2 -> 2 wins of 2; fact b: pos 0 vs neg 0, 5 -> tie + loss = 0.5 of 2; fact c: no pair
    s = [3, 1, 2, 0, 0, 5, 9]
    y = [True, False, False, True, False, False, True]
    g = ["a", "a", "a", "b", "b", "b", "c"]
    r = paired_auroc(s, y, g, ["t1", "t1", "t1", "t2", "t2", "t2", "t3"], n_boot=500)
    assert r.auroc == pytest.approx(2.5 / 4) and (r.n_pairs, r.n_groups, r.n_pos, r.n_neg) == (4, 2, 2, 4)
    assert 0 <= r.lo <= r.auroc <= r.hi <= 1 and r.n_clusters == 2


def rows_for(tok, n_facts=4):
    """Hand-written answers of a fact in the full (supported) and deleted (fabricated) files."""
    pack = load_pack("lhd_startup_consulting")
    items, _ = build_items(pack, n_facts, seed=0)
    rows = []
    for item in items:
        for files, answer in (("full", f"It is {item.value} per the file."), ("deleted", "It is 987654 per the file.")):
            r = render(pack, item, Condition(files, "none"), Prompts())
            lab = label_answer(answer, r.shown, None, r.not_claims, r.context).to_json()
            prompt = tok.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            rows.append({"id": f"{item.fact_id}/{files}/none/s0", "fact": item.fact_id, "task": item.task,
                         "files": files, "pressure": "none", "sample": 0, "question": r.question,
                         "label": lab["label"], "asserted_span": lab["asserted_span"], "answer": answer,
                         "messages": r.messages, "prompt_token_ids": list(prompt),
                         "answer_token_ids": tok(answer, add_special_tokens=False)["input_ids"]})
    assert {r["label"] for r in rows} == {"supported", "fabricated"}
    return rows


def test_read_on_the_tiny_model(tmp_path, tiny_llama_dir):
    torch.manual_seed(0)
    m, tok = load_hf(str(tiny_llama_dir), device="cpu")
    rows = rows_for(tok)
    for r in rows:  # the claim position is the figure's last token
        t = answer_tokens(tok, r)
        upto = tok.decode(t.ids[t.n_prompt:t.positions["claim"] + 1])
        figure = r["answer"][r["asserted_span"][0]:r["asserted_span"][1]]
        assert upto.rstrip().endswith(figure) and not tok.decode(t.ids[t.n_prompt:t.positions["claim"]]).rstrip()\
            .endswith(figure)
        piece = tok.decode([t.ids[t.positions["question"]]]).strip()  # the token may carry the newline after it
        assert piece and r["question"].endswith(piece)
        # the elicitation turn follows the generated ids, which stay as generated; it ends the context
        n_gen = t.n_prompt + len(r["answer_token_ids"])
        assert t.ids[:n_gen] == r["prompt_token_ids"] + r["answer_token_ids"]
        assert t.positions["elicit"] == len(t.ids) - 1
        assert elicitation() in tok.decode(t.ids[n_gen:])
        # ... and it is what the chat template renders for the conversation with the answer and the question
        conv = [*r["messages"], {"role": "assistant", "content": r["answer"]},
                {"role": "user", "content": elicitation()}]
        assert t.ids == tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=False)
        # an answer that kept its end-of-sequence token reads the same context (the template closes the turn)
        assert tok.eos_token_id in tok.all_special_ids
        kept_eos = answer_tokens(tok, {**r, "answer_token_ids": r["answer_token_ids"] + [tok.eos_token_id]})
        assert kept_eos.ids == t.ids and kept_eos.positions == t.positions
        # an answer ending in a newline keeps it once: the turn's tokens start after the answer as written
        nl = {**r, "answer": r["answer"] + "\n", "answer_token_ids": tok(r["answer"] + "\n",
                                                                       add_special_tokens=False)["input_ids"]}
        conv[-2] = {"role": "assistant", "content": nl["answer"]}
        rendered = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        whole = tok(rendered, add_special_tokens=False)["input_ids"]
        assert tok.decode(answer_tokens(tok, nl).ids) == tok.decode(whole)
    lens = Lens({0: torch.randn(m.d_model, m.d_model) / m.d_model ** 0.5}, {"target_layer": m.n_layers - 1})
    sets = resolve_token_sets(tok, fallback="first-token")
    out = tmp_path / "read"
    cfg = EntitleReadConfig(band=(0.0, 1.0), n_boot=200, progress=False, probe=True)
    summary = read_entitle(m, tok, rows, [JacobianLens(m, lens), LogitLens(m)], sets, out, cfg)
    assert summary["n_answers"] == len(rows) and summary["primary"]["readout"] == "jacobian"
    margins = list(csv.DictReader((out / "margins.csv").open()))
    probe = [x for x in margins if x["readout"] == "probe"]  # out of fold, folds grouped by task
    assert {x["position"] for x in probe} == {"claim", "decision", "question", "elicit"}
    assert len(probe) == len(rows) * 4 * m.n_layers
    # the logit lens at the decision position of the last block is the model's own next-token margin
    r0 = rows[0]
    ids = torch.tensor([r0["prompt_token_ids"]])
    with torch.no_grad():
        logits = m.hf(input_ids=ids).logits[0, -1].double().numpy()
    own = logsumexp(logits[sets.S]) - logsumexp(logits[sets.N])
    [cell] = [x for x in margins if (x["id"], x["readout"], x["position"], x["layer"]) ==
              (r0["id"], "logit", "decision", str(m.n_layers - 1))]
    assert float(cell["m_E"]) == pytest.approx(own, abs=1e-3)
    # the stated margin is the model's own Yes - No after the elicitation turn
    yes_no = resolve_answer_sets(tok, fallback="first-token")
    t0 = answer_tokens(tok, r0)
    with torch.no_grad():
        after = m.hf(input_ids=torch.tensor([t0.ids])).logits[0, -1].double().numpy()
    answers = {x["id"]: x for x in csv.DictReader((out / "examples.csv").open())}
    assert float(answers[r0["id"]]["stated"]) == pytest.approx(
        logsumexp(after[yes_no.yes]) - logsumexp(after[yes_no.no]), abs=1e-3)
    # the question stands before the files: the same hidden state in both conditions of a fact
    q = {}
    for x in margins:
        if x["position"] == "question":
            q.setdefault((x["fact"], x["readout"], x["layer"]), []).append(float(x["m_E"]))
    assert all(abs(a - b) < 1e-4 for a, b in q.values())
    # every band cell recounts from margins.csv by hand
    table = list(csv.DictReader((out / "auroc.csv").open()))
    for t in table:
        if t["layer"] != "-1" or t["readout"] in ("length", "echo", "stated"):
            continue
        mean: dict[str, list] = {}
        for x in margins:
            if (x["readout"], x["position"]) == (t["readout"], t["position"]):
                mean.setdefault(x["id"], [x["fact"], x["id"].split("/")[-3], []])[2].append(float(x["m_E"]))
        wins = pairs = 0.0
        for fact in {v[0] for v in mean.values()}:
            fab = [-np.mean(v[2]) for v in mean.values() if v[0] == fact and v[1] == "deleted"]
            sup = [-np.mean(v[2]) for v in mean.values() if v[0] == fact and v[1] == "full"]
            for a in fab:
                for b in sup:
                    wins += 1.0 if a > b + 1e-12 else 0.5 if abs(a - b) <= 1e-12 else 0.0
                    pairs += 1
        assert float(t["auroc"]) == pytest.approx(wins / pairs, abs=1e-6), t
    # the stated cell (saying No = suspicious) and the answer-controlled cell recount from the two files
    [st] = [t for t in table if t["readout"] == "stated"]
    ex = list(answers.values())
    by_hand = paired_auroc([-float(e["stated"]) for e in ex], [e["label"] == "fabricated" for e in ex],
                           [e["fact"] for e in ex], n_boot=0)
    assert st["position"] == "elicit" and float(st["auroc"]) == pytest.approx(by_hand.auroc, abs=1e-9)
    yes = {e["id"] for e in ex if float(e["stated"]) > 0}
    band_m = {}
    for x in margins:
        if (x["readout"], x["position"]) == ("jacobian", "elicit") and x["id"] in yes:
            band_m.setdefault(x["id"], []).append(float(x["m_E"]))
    kept = [e for e in ex if e["id"] in band_m]
    ac = summary["answer_controlled"]
    assert ac["n_stated_yes"] == {lab: sum(e["id"] in yes and e["label"] == lab for e in ex)
                                  for lab in ("fabricated", "supported")}
    assert ac["n_pairs"] == paired_auroc([0.0] * len(kept), [e["label"] == "fabricated" for e in kept],
                                         [e["fact"] for e in kept], n_boot=0).n_pairs
    if ac["n_pairs"]:
        assert ac["auroc"] == pytest.approx(paired_auroc(
            [-float(np.mean(band_m[e["id"]])) for e in kept], [e["label"] == "fabricated" for e in kept],
            [e["fact"] for e in kept], n_boot=0).auroc, abs=1e-9)
    plan = json.loads((out / "plan.json").read_text())
    assert plan["primary"] == {"readout": "jacobian", "position": "claim", "layers": "band mean"}
    with pytest.raises(LensError, match="another plan"):
        read_entitle(m, tok, rows, [JacobianLens(m, lens), LogitLens(m)], sets, out,
                     EntitleReadConfig(band=(0.0, 0.5), n_boot=10, progress=False, probe=False))
