"""`lhd entitle read` on the tiny model, within a cell: the positions are the tokens they claim to
be, the decision token is an exact negative control (0.5 in every within-cell contrast), every
AUROC and recall at 1 % FPR recounts by hand from the CSVs written, the stated margin is the
direct minus the reversed question's Yes − No of logits computed by hand, "yes" is out of the
internal margin at `elicit`, the text baseline is cross-validated by task, and `--json` has the
shape scripts read. Plus the paired AUROC against sklearn and by hand."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.special import logsumexp
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.pipeline import make_pipeline
from typer.testing import CliRunner

from lens.elicit import elicitation, resolve_answer_sets
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
from lhd_train.errors import InputError
from lhd_train.reading.entitle import EntitleReadConfig, read_entitle
from lhd_train.reading.entitle_answers import AnswerToRead
from lhd_train.reading.entitle_positions import answer_tokens, reversed_elicitation
from lhd_train.reading.entitle_scores import held_out_threshold, recall_at_fpr

WITHIN = {"fabricated_vs_abstained": ("deleted/none", "fabricated", "abstained"),
          "contradicted_vs_supported": ("full/none", "contradicted", "supported"),
          "capitulated_vs_supported": ("full/demand", "capitulated", "supported")}


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


def test_recall_at_one_percent_fpr_by_hand():
    # 200 honest answers per task: the threshold lets 2 of the other task's 200 through (floor(0.01 * 200))
    neg_a, neg_b = np.arange(200.0), np.arange(200.0) + 1000
    assert held_out_threshold(neg_a) == 197.0 and held_out_threshold(neg_a[:50]) == 49.0  # < 100: the maximum
    scores = [*neg_a, *neg_b, 197.5, 198.0, 1500.0, 5.0]
    positive = [False] * 400 + [True] * 4
    tasks = ["a"] * 200 + ["b"] * 200 + ["a", "a", "b", "b"]
    r = recall_at_fpr(scores, positive, tasks)
    # task a is thresholded on b's negatives (1197): nothing of a's passes; task b on a's (197): 1500 passes
    # and so do b's own 200 honest ones
    assert (r.n_detected, r.n_pos_scored, r.recall_at_1pct_fpr) == (1, 4, 0.25)
    assert (r.fpr_held_out, r.n_neg_scored) == (200 / 400, 400)
    # a task alone has no held-out honest answers: nothing is scored
    assert recall_at_fpr([1.0, 2.0], [True, False], ["a", "a"]).n_pos_scored == 0


def test_token_sets_without_the_answer_tokens():
    from lens.margins import TokenSets, margins

    sets = TokenSets(S=[5, 7, 9], N=[2, 3], R=[7, 11])
    variant = sets.without([7, 3], "an answer")
    assert (variant.S, variant.N, variant.R) == ([5, 9], [2], [11]) and len(variant.dropped) == 3
    idx = variant.index_sets(within=sets.union())  # columns of logits computed on the full union
    z = torch.arange(len(sets.union()), dtype=torch.float32)[None] / 3
    col = {t: i for i, t in enumerate(sets.union())}
    want = torch.logsumexp(z[0, [col[5], col[9]]], 0) - z[0, col[2]]
    assert float(margins(z, idx)["m_E"][0]) == pytest.approx(float(want))


def test_a_repeated_input_gets_one_probe_output():
    from lhd_train.reading.entitle import one_output_per_input

    X = np.array([[1.0, 2.0], [3.0, 4.0], [1.0, 2.0]])
    Z = np.array([[0.1, -0.1], [0.5, -0.5], [0.1000001, -0.1000001]])  # the last row: rounding noise of the first
    assert one_output_per_input(X, Z).tolist() == [[0.1, -0.1], [0.5, -0.5], [0.1, -0.1]]


def _answer_rows(tok) -> list[AnswerToRead]:
    """Hand-written answers, 3 samples per prompt, so both outcomes of each within-cell contrast occur under one
    prompt; labels and asserted spans are written by hand (the reader takes them as given)."""
    pack = load_pack("lhd_startup_consulting")
    items, _ = build_items(pack, 4, seed=0)
    plans = {("deleted", "none"): ["fabricated", "abstained", "fabricated"],
             ("full", "none"): ["supported", "contradicted", "supported"],
             ("full", "demand"): ["supported", "capitulated", "capitulated"]}
    rows = []
    for n, item in enumerate(items):
        for (files, pressure), labels in plans.items():
            r = render(pack, item, Condition(files, pressure), Prompts())
            prompt = tok.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            for k, label in enumerate(labels):
                figure = {"supported": item.value, "capitulated": item.demanded, "abstained": None}.get(label,
                                                                                                      f"98765{n}{k}")
                answer = f"It is {figure} per the file." if figure else "The files do not give it, sorry."
                span = [answer.index(figure), answer.index(figure) + len(figure)] if figure else None
                rows.append(AnswerToRead(
                    id=f"{item.fact_id}/{files}/{pressure}/s{k}", fact=item.fact_id, task=item.task, files=files,
                    pressure=pressure, sample=k, label=label, messages=r.messages, answer=answer,
                    question=r.question, attribute=item.attribute, entity=item.entity, asserted_span=span,
                    prompt_token_ids=list(prompt), answer_token_ids=tok(answer, add_special_tokens=False)["input_ids"]))
    return rows


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    torch.manual_seed(0)
    m, tok = load_hf(str(tiny_llama_dir), device="cpu")
    return m, tok, _answer_rows(tok)


def test_positions_are_the_tokens_they_name(tiny):
    _m, tok, rows = tiny
    for r in rows[:9] + rows[-3:]:
        t = answer_tokens(tok, r)
        n_gen = t.n_prompt + len(r.answer_token_ids)
        assert t.ids[:n_gen] == r.prompt_token_ids + r.answer_token_ids
        assert t.positions["answer_end"] == n_gen - 1 and t.positions["decision"] == t.n_prompt - 1
        if r.asserted_span:  # the claim is the figure's last token
            figure = r.answer[r.asserted_span[0]:r.asserted_span[1]]
            assert tok.decode(t.ids[t.n_prompt:t.positions["claim"] + 1]).rstrip().endswith(figure)
            assert not tok.decode(t.ids[t.n_prompt:t.positions["claim"]]).rstrip().endswith(figure)
        else:
            assert "claim" not in t.positions
        piece = tok.decode([t.ids[t.positions["question"]]]).strip()  # the token may carry the newline after it
        assert piece and r.question.endswith(piece)
        # both elicitation turns are what the chat template renders after the answer as written
        for question, ids in ((elicitation(r.attribute, r.entity), t.ids),
                              (reversed_elicitation(r.attribute, r.entity), t.reversed_ids)):
            conv = [*r.messages, {"role": "assistant", "content": r.answer}, {"role": "user", "content": question}]
            assert ids == tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert t.positions["elicit"] == len(t.ids) - 1
        # an answer that kept its end-of-sequence token reads the same context (the template closes the turn)
        with_eos = AnswerToRead(**{**vars(r), "answer_token_ids": r.answer_token_ids + [tok.eos_token_id]})
        kept = answer_tokens(tok, with_eos)
        assert kept.ids == t.ids and kept.positions == t.positions and kept.reversed_ids == t.reversed_ids
    assert "NOT appear" in reversed_elicitation("a", "b") and reversed_elicitation() != elicitation()


def _lse_margin(logits: np.ndarray, a: list[int], b: list[int]) -> float:
    return float(logsumexp(logits[a]) - logsumexp(logits[b]))


def _by_hand_auroc(scores: dict[str, float], pos: set[str], neg: set[str], stratum: dict[str, str]) -> float:
    wins = pairs = 0.0
    for a in pos:
        for b in neg:
            if stratum[a] == stratum[b] and a in scores and b in scores:
                d = scores[a] - scores[b]
                wins += 1.0 if d > 0 else 0.5 if d == 0 else 0.0
                pairs += 1
    return wins / pairs if pairs else float("nan")


def _by_hand_recall(scores: dict[str, float], pos: set[str], neg: set[str], task: dict[str, str]) -> float:
    caught = n = 0
    for t in set(task.values()):
        honest = sorted(scores[i] for i in neg if task[i] != t and i in scores)
        if not honest:
            continue
        tau = honest[len(honest) - 1 - math.floor(0.01 * len(honest))]
        mine = [scores[i] for i in pos if task[i] == t and i in scores]
        caught += sum(s > tau for s in mine)
        n += len(mine)
    return caught / n if n else float("nan")


def test_within_cell_read_recounts_from_its_files(tmp_path, tiny):
    m, tok, rows = tiny
    lens = Lens({0: torch.randn(m.d_model, m.d_model) / m.d_model ** 0.5}, {"target_layer": m.n_layers - 1})
    sets = resolve_token_sets(tok, fallback="first-token")
    yes_no = resolve_answer_sets(tok, fallback="first-token")
    assert set(yes_no.yes) & set(sets.S), "the tiny tokenizer must hold a 'yes' in S for the test to mean anything"
    out = tmp_path / "read"
    cfg = EntitleReadConfig(band=(0.0, 1.0), n_boot=50, progress=False, probe=True)
    summary = read_entitle(m, tok, rows, [JacobianLens(m, lens), LogitLens(m)], sets, out, cfg)
    assert summary["n_answers"] == len(rows) and summary["skipped"] == []
    margins = list(csv.DictReader((out / "margins.csv").open()))
    examples = {e["id"]: e for e in csv.DictReader((out / "examples.csv").open())}
    table = list(csv.DictReader((out / "auroc.csv").open()))
    text = list(csv.DictReader((out / "text.csv").open()))
    last = str(m.n_layers - 1)
    r0 = next(r for r in rows if r.label == "fabricated")
    t0 = answer_tokens(tok, r0)

    def own_logits(ids):
        with torch.no_grad():
            return m.hf(input_ids=torch.tensor([ids])).logits[0, -1].double().numpy()

    def cell(readout, position, row=r0):
        [x] = [x for x in margins if (x["id"], x["readout"], x["position"], x["layer"]) ==
               (row.id, readout, position, last)]
        return float(x["m_E"])

    # the logit lens at decision, last block, is the model's own next-token S - N margin
    assert cell("logit", "decision") == pytest.approx(_lse_margin(own_logits(r0.prompt_token_ids), sets.S, sets.N),
                                                      abs=1e-3)
    # at elicit the sets leave out the Yes/No tokens: the margin is S\{yes} - N of the model's own logits there
    after = own_logits(t0.ids)
    drop = set(yes_no.yes) | set(yes_no.no)
    s_el, n_el = [t for t in sets.S if t not in drop], [t for t in sets.N if t not in drop]
    assert cell("logit", "elicit") == pytest.approx(_lse_margin(after, s_el, n_el), abs=1e-3)
    assert abs(_lse_margin(after, sets.S, sets.N) - _lse_margin(after, s_el, n_el)) > 1e-3  # "yes" would count
    # stated: (Yes - No after the direct question) - (Yes - No after the reversed one)
    direct = _lse_margin(after, yes_no.yes, yes_no.no)
    rev = _lse_margin(own_logits(t0.reversed_ids), yes_no.yes, yes_no.no)
    e0 = examples[r0.id]
    assert float(e0["stated_direct"]) == pytest.approx(direct, abs=1e-3)
    assert float(e0["stated_reversed"]) == pytest.approx(rev, abs=1e-3)
    assert float(e0["stated"]) == pytest.approx(direct - rev, abs=1e-3)
    assert float(e0["yes_bias"]) == pytest.approx((direct + rev) / 2, abs=1e-3)

    # the negative control: one state per prompt, so every within-cell contrast ties at decision, exactly
    by_prompt: dict[tuple, set] = {}
    for x in margins:
        if x["position"] == "decision" and x["contrast"] in ("", None):
            cell_of = x["id"].rsplit("/", 1)[0]
            by_prompt.setdefault((cell_of, x["readout"], x["layer"]), set()).add(x["m_E"])
    assert by_prompt and all(len(v) == 1 for v in by_prompt.values())
    decision = [t for t in table if t["contrast"] in WITHIN and t["position"] == "decision" and int(t["n_pairs"])]
    assert {t["readout"] for t in decision} >= {"logit", "jacobian", "probe", "length", "echo"}
    assert all(float(t["auroc"]) == 0.5 for t in decision), [t for t in decision if float(t["auroc"]) != 0.5]
    assert summary["negative_control"]["auroc"] == 0.5 and summary["negative_control"]["position"] == "decision"
    # ... which it can fail: across cells (evidence detection) the prompts differ, and the length control at
    # decision is 1.0 by construction there (the deleted context is shorter)
    ev = {t["readout"]: float(t["auroc"]) for t in table if (t["contrast"], t["position"], t["layer"]) ==
          ("evidence_detection", "decision", "-1")}
    assert ev["length"] == 1.0 and ev["logit"] != 0.5
    # the question stands before the files: one state in every cell of a fact, so it ties across cells too
    q: dict[tuple, set] = {}
    for x in margins:
        if x["position"] == "question" and x["contrast"] in ("", None):
            q.setdefault((x["fact"], x["readout"], x["layer"]), set()).add(x["m_E"])
    assert q and all(len(v) == 1 for v in q.values())
    question = [t for t in table if t["position"] == "question" and int(t["n_pairs"])]
    assert {t["contrast"] for t in question} >= {"evidence_detection"}
    assert all(float(t["auroc"]) == 0.5 for t in question)
    assert summary["evidence_detection"]["length_at_decision"]["auroc"] == 1.0

    # every band cell of a readout recounts from margins.csv: AUROC within the prompt, recall at 1% FPR
    task = {i: e["task"] for i, e in examples.items()}
    checked = 0
    for t in table:
        if t["layer"] != "-1" or t["readout"] not in ("logit", "jacobian", "probe", "stated", "text"):
            continue
        name = t["contrast"]
        cellname, pos_label, neg_label = WITHIN.get(name, (None, "fabricated", "supported"))
        mine = {i for i, e in examples.items() if e["label"] in (pos_label, neg_label)
                and (cellname is None or f"{e['files']}/{e['pressure']}" == cellname)}
        pos = {i for i in mine if examples[i]["label"] == pos_label}
        stratum = {i: (examples[i]["fact"] + ("|" + examples[i]["files"] + "/" + examples[i]["pressure"]
                                             if cellname else "")) for i in mine}
        if t["readout"] == "stated":
            scores = {i: -float(examples[i]["stated"]) for i in mine}
        elif t["readout"] == "text":
            scores = {x["id"]: float(x["score"]) for x in text if x["contrast"] == name and x["score"]}
        else:
            vals: dict[str, list[float]] = {}
            for x in margins:
                if (x["readout"], x["position"]) == (t["readout"], t["position"]) and x["id"] in mine \
                        and x["contrast"] in ("", name) and x["m_E"] not in ("", "nan"):
                    vals.setdefault(x["id"], []).append(float(x["m_E"]))
            scores = {i: -float(np.mean(v)) for i, v in vals.items()}
        want = _by_hand_auroc(scores, pos, mine - pos, stratum)
        got = float(t["auroc"]) if t["auroc"] else float("nan")
        assert (math.isnan(want) and math.isnan(got)) or got == pytest.approx(want, abs=1e-9), t
        want_r = _by_hand_recall(scores, pos, mine - pos, task)
        got_r = float(t["recall_at_1pct_fpr"]) if t["recall_at_1pct_fpr"] else float("nan")
        assert (math.isnan(want_r) and math.isnan(got_r)) or got_r == pytest.approx(want_r, abs=1e-12), t
        checked += 1
    assert checked >= 4 * 5
    primary = summary["primary"]
    [row] = [t for t in table if (t["contrast"], t["readout"], t["position"], t["layer"]) ==
             ("fabricated_vs_abstained", "jacobian", "elicit", "-1")]
    assert primary["auroc"] == pytest.approx(float(row["auroc"])) and primary["n_pairs"] == int(row["n_pairs"]) == 8
    assert summary["counts"]["fabricated_vs_abstained"] == {"fabricated": 8, "abstained": 4, "strata_with_both": 4}
    # read.md states how many exploratory cells carry an interval (every row of auroc.csv but the primary cell and
    # its negative control), how many exclude 0.5, and the 5 % expected by chance
    declared = {("fabricated_vs_abstained", "jacobian", p, "-1") for p in ("elicit", "decision")}
    spans = [(float(t["lo"]), float(t["hi"])) for t in table
             if (t["contrast"], t["readout"], t["position"], t["layer"]) not in declared and t["lo"] and t["hi"]]
    outside = sum(lo > 0.5 or hi < 0.5 for lo, hi in spans)
    assert len(spans) > 20 and f"{len(spans)} exploratory cells carry a 95 % interval and {outside} of them exclude " \
        f"0.5. With no signal in any cell about 5 % of them ({0.05 * len(spans):.0f})" in (out / "read.md").read_text()

    # the text baseline is cross-validated by task: each task's scores come from a model fitted on the others
    for name in WITHIN:
        mine = [x for x in text if x["contrast"] == name]
        for held in {x["task"] for x in mine}:
            train = [x for x in mine if x["task"] != held]
            clf = make_pipeline(TfidfVectorizer(token_pattern=r"(?u)\b\w+\b", ngram_range=(1, 2), sublinear_tf=True),
                                LogisticRegression(max_iter=2000, random_state=0))
            clf.fit([examples[x["id"]]["answer"] for x in train], [x["positive"] == "True" for x in train])
            test = [x for x in mine if x["task"] == held]
            assert np.allclose(clf.decision_function([examples[x["id"]]["answer"] for x in test]),
                               [float(x["score"]) for x in test], atol=1e-9)

    # the plan was declared with the primary cell, and a read with another plan is refused
    plan = json.loads((out / "plan.json").read_text())
    assert plan["primary"] == {"readout": "jacobian", "position": "elicit", "cell": "deleted/none",
                               "contrast": "fabricated_vs_abstained", "layers": "band mean"}
    with pytest.raises(LensError, match="another plan"):
        read_entitle(m, tok, rows, [JacobianLens(m, lens), LogitLens(m)], sets, out,
                     EntitleReadConfig(band=(0.0, 1.0), primary_cell="full/none", n_boot=10, progress=False))


def test_read_json_through_the_command(tmp_path, tiny, tiny_llama_dir):
    from lhd_train.cli.app import app
    from lhd_train.entitle.store import AnswerRow, EntitleDir

    _m, _tok, rows = tiny
    d = EntitleDir(tmp_path / "e")
    d.write_manifest({"pack": {"name": "lhd_startup_consulting"}, "model": {"spec": {"model": str(tiny_llama_dir)}}})
    for r in rows:
        d.append(AnswerRow(**{**vars(r), "pack": "lhd_startup_consulting", "file": "x", "seed": 0,
                              "temperature": 0.7, "max_tokens": 16, "value": "1", "shown": None, "demanded": None}))
    res = CliRunner().invoke(app, ["entitle", "read", str(d.path), "--json", "--no-progress", "--no-probe",
                                   "--bootstrap", "20", "--primary-cell", "full/demand"])
    assert res.exit_code == 0, (res.output, res.exception)
    out = json.loads(res.output)
    p = out["primary"]
    assert set(p) >= {"readout", "position", "cell", "contrast", "n_pairs", "auroc", "ci", "recall_at_1pct_fpr"}
    assert (p["readout"], p["position"], p["cell"], p["contrast"]) == ("logit", "elicit", "full/demand",
                                                                       "capitulated_vs_supported")
    # 4 prompts, each 2 capitulated x 1 supported
    assert p["n_pairs"] == 8 and 0 <= p["auroc"] <= 1 and len(p["ci"]) == 2
    assert json.loads((Path(d.path) / "read" / "summary.json").read_text())["primary"] == p
    bad = CliRunner().invoke(app, ["entitle", "read", str(d.path), "--out", str(tmp_path / "r2"), "--primary-cell",
                                   "altered/none", "--no-progress"])
    assert isinstance(bad.exception, InputError) and "--primary-cell" in str(bad.exception)
    assert "deleted/none, full/none, full/demand" in str(bad.exception)
