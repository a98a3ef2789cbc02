"""Issue 28 item 2: pass@k on prompt sets in the J-lens release's format (science-4 review §2.5
item 1). Ranks are checked against a plain-torch recomputation (the HF model's hidden states, its
final norm and lm_head by hand), pass@k, its intervals and the AUC against hand-made ranks, token
forms against a tokenizer with a known vocabulary, and the command's files against each other."""
from __future__ import annotations

import hashlib
import itertools
import json
import math

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from lens.errors import LensError
from lens.eval_report import passk_markdown
from lens.fit import FitOptions, FitSettings, fit_lens
from lens.passk import KS, PROMPT_ECHO, ItemRanks, item_auc, rank_items, summarise_set, token_ranks
from lens.promptsets import (
    EVALSETS,
    PromptItem,
    PromptSet,
    TokenForms,
    encode_item,
    load_prompt_set,
    set_name,
    synonyms,
    token_forms,
)
from lens.readout import JacobianLens, LogitLens
from lhd_train.cli.lens import app

runner = CliRunner()
#: sha256 of the release's files at commit 581d398 (the copies must be unchanged)
RELEASE = {"multihop": ("50b7e4c9255291c0ca2a8e94615be9f44531fa57bb1a844e4f9616056d987416", 93),
           "order-ops": ("b203206d16ff628152cc86f3838604e06cb54776f3e14fa1c34f150db8bc7560", 55),
           "typo": ("9d05e16b7234a57d0773d120a4e1c4e94fd3bc2235a8125d4200a70e60ab17aa", 96)}


def test_shipped_sets_are_the_release_files_unchanged():
    for name, (digest, n) in RELEASE.items():
        path = EVALSETS / f"lens-eval-{name}.json"
        assert hashlib.sha256(path.read_bytes()).hexdigest() == digest
        ps = load_prompt_set(name)  # a shipped set by name
        assert ps.name == name and len(ps.items) == n and ps.sha256 == digest
    assert "Apache License" in (EVALSETS / "LICENSE").read_text()[:200]
    assert set_name("/x/lens-eval-poetry.json") == "poetry" and set_name("mine.json") == "mine"


@pytest.mark.parametrize("items, field", [
    ({"items": []}, "at least one item"),
    ({"items": [{"prompt": "x", "intermediates": []}]}, r"items\[0\]\.intermediates"),
    ({"items": [{"prompt": "x", "intermediates": ["a"]}, {"prompt": [{"role": "user"}], "intermediates": ["b"]}]},
     r"items\[1\]\.prompt"),
    ({"items": [{"prompt": "x", "intermediates": ["a"], "target": 3}]}, r"items\[0\]\.target"),
])
def test_bad_prompt_sets_name_the_file_item_and_field(tmp_path, items, field):
    path = tmp_path / "lens-eval-bad.json"
    path.write_text(json.dumps(items))
    with pytest.raises(LensError, match=field) as info:
        load_prompt_set(path)
    assert str(path) in str(info.value)
    with pytest.raises(LensError, match="not a shipped set"):
        load_prompt_set(tmp_path / "nowhere.json")


class VocabTok:
    """Strings in `vocab` are one token each; anything else is one token per character (ids 1000 + ord)."""

    def __init__(self, vocab: list[str]):
        self.vocab = {s: i for i, s in enumerate(vocab)}

    def __call__(self, text, add_special_tokens=False):
        ids = [self.vocab[text]] if text in self.vocab else [1000 + ord(c) for c in text]
        return {"input_ids": ids}


def test_token_forms_and_synonyms():
    tok = VocabTok(["Paris", " paris", " Brazil", "twelve", " *", "×", " times"])
    f = token_forms(tok, "Paris", "multihop")
    assert f.forms == ["Paris", " paris"] and f.ids == [0, 1] and not f.fallback
    fb = token_forms(tok, "government", "typo")  # no single-token form: first token of " government"
    assert fb.fallback and fb.ids == [1000 + ord(" ")]
    assert synonyms("12", "order-ops") == ["12", "twelve"] and synonyms("12", "multihop") == ["12"]
    assert {"*", "×", "times", "multiplication"} <= set(synonyms("multiplication", "order-ops"))
    assert synonyms("24", "order-ops") == ["24", "twenty-four"]
    num = token_forms(tok, "12", "order-ops")  # "12" is two characters; "twelve" is one token
    assert num.ids == [3] and num.forms == ["twelve"]
    op = token_forms(tok, "multiplication", "order-ops")
    assert set(op.ids) == {4, 5, 6, 1000 + ord("*")}  # a one-character form is one token here


def test_token_ranks_break_ties_by_token_id():
    z = torch.tensor([0.5, 2.0, 2.0, -1.0, 2.0])
    # numpy: sort by (-score, id); the rank is the 1-based place
    order = sorted(range(len(z)), key=lambda i: (-float(z[i]), i))
    expected = [order.index(i) + 1 for i in range(len(z))]
    assert token_ranks(z, list(range(len(z)))) == expected == [4, 1, 2, 5, 3]


def _rows(table: dict[str, list[tuple[str, dict[int, int]]]]) -> list[ItemRanks]:
    out = []
    for item, inters in table.items():
        for word, by_layer in inters:
            out.append(ItemRanks("s", item, word, TokenForms(word, [0], [word]), {"logit": dict(by_layer)}))
    return out


def test_pass_at_k_interval_and_auc_by_hand():
    rows = _rows({"a": [("x", {3: 1, 5: 7})],                    # score 1
                  "b": [("y", {3: 60, 5: 8}), ("z", {3: 40, 5: 2000})],  # scores 8, 40
                  "c": [("w", {3: 900, 5: 51})]})                # score 51
    s = summarise_set(rows, ["logit"], [3, 5], n_boot=2000, seed=1)
    per_item = {1: [1, 0, 0], 5: [1, 0, 0], 10: [1, 0.5, 0], 50: [1, 1, 0]}
    for k in KS:
        assert s["logit"][str(k)] == pytest.approx(np.mean(per_item[k]))
        lo, hi = s["ci"]["logit"][str(k)]
        assert lo <= s["logit"][str(k)] <= hi
    assert s["n"] == 3 and s["n_intermediates"] == 4 and set(s) >= {"n", "logit"}
    # by layer: layer 3 alone has ranks 1, (60, 40), 900
    assert s["by_layer"]["logit"]["3"]["50"] == pytest.approx(np.mean([1, 0.5, 0]))
    auc = np.mean([1.0, np.mean([1 - math.log(8) / math.log(1000), 1 - math.log(40) / math.log(1000)]),
                   1 - math.log(51) / math.log(1000)])
    assert s["auc"]["logit"]["value"] == pytest.approx(auc)
    assert item_auc(_rows({"d": [("v", {1: 5000})]}), "logit")[0] == 0.0
    # the interval is a bootstrap over items, checked against the exact bootstrap distribution: every one of
    # the n^n equally likely resamples of the items' shares enumerated (quantiles chosen away from its jumps)
    assert s["ci"]["logit"]["10"] == pytest.approx(_exact_interval([1, 0.5, 0]))  # [0, 1]
    five = _rows({"a": [("x", {3: 1})], "b": [("y", {3: 1}), ("z", {3: 100})], "c": [("y", {3: 1}), ("z", {3: 100})],
                  "d": [("x", {3: 100})], "e": [("x", {3: 100})]})
    ci = summarise_set(five, ["logit"], [3], n_boot=20_000, seed=0)["ci"]["logit"]["1"]
    assert ci == pytest.approx(_exact_interval([1, 0.5, 0.5, 0, 0])) and ci == pytest.approx([0.1, 0.7])


def test_auc_differences_are_paired_by_item():
    """The J-lens ranks every intermediate 10x better than the logit lens on items of very different
    difficulty: each item's AUC gains exactly log 10 / log 1000 = 1/3, so the paired interval is that
    point, while each readout's own interval spans the spread of difficulty."""
    logit = {"a": 20, "b": 100, "c": 1000, "d": 50}
    rows = [ItemRanks("s", item, "x", TokenForms("x", [0], ["x"]),
                      {"logit": {3: r}, "jacobian": {3: r // 10}, "jacobian_future": {3: r}})
            for item, r in logit.items()]
    s = summarise_set(rows, ["logit", "jacobian", "jacobian_future"], [3], n_boot=2000, seed=0)
    assert set(s["auc_diff"]) == {"jacobian - logit", "jacobian_future - logit", "jacobian_future - jacobian"}
    gain = s["auc_diff"]["jacobian - logit"]
    assert gain["value"] == pytest.approx(1 / 3) and gain["ci"] == pytest.approx([1 / 3, 1 / 3])
    assert s["auc_diff"]["jacobian_future - jacobian"]["value"] == pytest.approx(-1 / 3)
    assert s["auc_diff"]["jacobian_future - logit"]["ci"] == pytest.approx([0, 0])
    lo, hi = s["auc"]["jacobian"]["ci"]
    assert hi - lo > 0.2  # unpaired, the items' difficulty dominates the interval
    md = "\n".join(passk_markdown({"s": s}))
    assert "jacobian - logit +0.333 [+0.333, +0.333]" in md


def _exact_interval(shares: list[float]) -> list[float]:
    """The 2.5 % and 97.5 % quantiles of the mean over all n^n resamples of `shares` (the exact bootstrap)."""
    means = np.sort([np.mean(c) for c in itertools.product(shares, repeat=len(shares))])
    return [float(means[int(np.ceil(q * len(means))) - 1]) for q in (0.025, 0.975)]

def _hand_ranks(model, ids, pos, J, token_ids):
    """Per layer, the best rank of `token_ids` under the logit lens and `W_U norm(J h)`, by plain torch."""
    hf = model.hf
    with torch.no_grad():
        out = hf(input_ids=ids[None], output_hidden_states=True, use_cache=False)
    res = {"logit": {}, "jacobian": {}}
    for layer, M in J.items():
        h = out.hidden_states[layer + 1][0, pos]
        for name, x in (("logit", h), ("jacobian", M @ h)):
            z = hf.model.norm(x) @ hf.lm_head.weight.T
            res[name][layer] = min(int((z > z[t]).sum()) + int(((z == z[t]) & (torch.arange(len(z)) < t)).sum()) + 1
                                   for t in token_ids)
    return res


def test_ranks_match_a_plain_torch_recomputation(llama, fit_prompts):
    model, tok = llama
    lens = fit_lens(model, tok, fit_prompts[:2], FitSettings(skip_first=4, max_length=32, dim_batch=64,
                                                              source_layers=[0, 1]),
                    options=FitOptions(progress=False)).lens
    chat = [{"role": "user", "content": "Name the capital of France."}]
    pset = PromptSet("mine", "mine.json", "0", [
        PromptItem("plain", "The report lists the units sold in the north region", ["units", "north"]),
        PromptItem("chat", chat, ["capital"])])
    rows = rank_items(model, tok, pset, {"logit": LogitLens(model), "jacobian": JacobianLens(model, lens)}, [0, 1])
    assert [(r.item, r.intermediate) for r in rows] == [("plain", "units"), ("plain", "north"), ("chat", "capital")]
    # the chat item is read at the last token of the template's generation prompt
    ids, pos = encode_item(tok, pset.items[1], "mine")
    rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    expected = tok(rendered, add_special_tokens=False)["input_ids"]
    expected = expected if expected[0] == tok.bos_token_id else [tok.bos_token_id, *expected]
    assert ids.tolist() == expected and pos == len(expected) - 1
    for r, item in zip(rows, [pset.items[0], pset.items[0], pset.items[1]], strict=True):
        ids, pos = encode_item(tok, item, "mine")
        hand = _hand_ranks(model, ids, pos, lens.J, r.forms.ids)
        # the echo baseline: the prompt's distinct tokens up to the read position, latest first; absent: last
        recency = list(dict.fromkeys(reversed(ids[: pos + 1].tolist())))
        echo = min(recency.index(t) + 1 if t in recency else len(tok) for t in r.forms.ids)
        assert r.ranks == {**hand, PROMPT_ECHO: {0: echo, 1: echo}}


def test_poetry_reads_the_last_newline(llama):
    _, tok = llama
    ids, pos = encode_item(tok, PromptItem("p", "Roses are red and the sky is blue\nI wrote a line", ["true"]),
                           "poetry")
    assert "\n" in tok.decode([int(ids[pos])]) and all("\n" not in tok.decode([int(t)]) for t in ids[pos + 1:])


def test_cli_prompt_sets_end_to_end(tiny_dirs, tmp_path):
    model = tiny_dirs["llama"]
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(f"Fit paragraph {i}: the quarterly report lists {i * 11} units sold in region {i} "
                                  "and notes that the numbers were checked twice." for i in range(2)))
    r = runner.invoke(app, ["fit", str(model), "--corpus", str(corpus), "--out", str(tmp_path / "L"), "--device",
                            "cpu", "--max-length", "32", "--skip-first", "4", "--source-layers", "0,1",
                            "--no-progress", "--threads", "1", "--save-dtype", "float32", "--dim-batch", "64"])
    assert r.exit_code == 0, r.output
    mine = tmp_path / "lens-eval-mine.json"
    mine.write_text(json.dumps({"items": [
        {"name": "a", "prompt": "The shop sold many boxes of", "intermediates": ["tea", "coffee"], "target": "tea"},
        {"name": "b", "prompt": [{"role": "user", "content": "Which colour is the sky?"}],
         "intermediates": ["blue"]}]}))
    out = tmp_path / "ev"
    r = runner.invoke(app, ["eval", str(model), "--readout", f"jacobian={tmp_path / 'L'}", "--prompt-set", "typo",
                            "--prompt-set", str(mine), "--out", str(out), "--device", "cpu", "--threads", "1",
                            "--no-progress", "--bootstrap", "50", "--causal-random", "1"])
    assert r.exit_code == 0, r.output
    passk = json.loads((out / "passk.json").read_text())
    assert set(passk) == {"typo", "mine"} and passk["typo"]["n"] == 96 and passk["mine"]["n"] == 2
    for entry in passk.values():
        for readout in ("logit", "jacobian", "jacobian_random"):
            assert set(entry[readout]) == {"1", "5", "10", "50"}
    ranks = [json.loads(x) for x in (out / "passk_ranks.jsonl").read_text().splitlines()]
    for name, entry in passk.items():  # recount every pass@k from the per-item ranks
        for readout in ("logit", "jacobian", "jacobian_random"):
            rows = [x for x in ranks if x["set"] == name and x["readout"] == readout]
            assert all(x["score"] == min(x["ranks"].values()) for x in rows)
            for k in KS:
                per = {}
                for x in rows:
                    per.setdefault(x["item"], []).append(x["score"] <= k)
                assert entry[readout][str(k)] == pytest.approx(np.mean([np.mean(v) for v in per.values()]))
    causal = json.loads((out / "causal.json").read_text())
    assert set(causal["summary"]) == {"typo", "mine"} and causal["meta"]["causal_layers"] == [0]
    assert (out / "quality.md").read_text().count("\n| jacobian |") == 2  # one pass@k row per set
    # bad input: neither a prompt set nor a corpus; a prompt set that does not exist (before the model loads)
    base = ["eval", str(model), "--readout", f"jacobian={tmp_path / 'L'}",
            "--out", str(tmp_path / "ev2"), "--device", "cpu"]
    r = runner.invoke(app, base)
    assert r.exit_code == 2 and "--prompt-set" in r.output
    r = runner.invoke(app, [*base, "--prompt-set", str(tmp_path / "missing.json")])
    assert r.exit_code != 0 and "missing.json" in r.output


@pytest.mark.slow
@pytest.mark.timeout(2400)  # about 3 CPU minutes; a loaded shared machine stretches that
def test_smollm2_passk_on_the_three_shipped_sets(smollm2_dir, tmp_path):
    """SmolLM2-135M-Instruct: a small lens (2 Python-docs prompts, 32 tokens, blocks 25-28), then `lhd lens eval
    --prompt-set` on the three shipped sets; passk.json has the release's keys and recounts from the ranks."""
    from lhd_train.reading.general_corpus import python_docs_texts, write_texts_jsonl

    corpus = tmp_path / "docs.jsonl"
    write_texts_jsonl(python_docs_texts()[:4], corpus)
    r = runner.invoke(app, ["fit", str(smollm2_dir), "--corpus", str(corpus), "--out", str(tmp_path / "L"),
                            "--n-prompts", "2", "--max-length", "32", "--skip-first", "8", "--source-layers", "25-28",
                            "--dim-batch", "64", "--threads", "1", "--device", "cpu", "--no-progress",
                            "--save-dtype", "float32"])
    assert r.exit_code == 0, r.output
    out = tmp_path / "ev"
    r = runner.invoke(app, ["eval", str(smollm2_dir), "--readout", f"jacobian={tmp_path / 'L'}",
                            "--prompt-set", "multihop",
                            "--prompt-set", "order-ops", "--prompt-set", "typo", "--out", str(out), "--threads", "1",
                            "--device", "cpu", "--no-progress", "--bootstrap", "200", "--causal-random", "1"])
    assert r.exit_code == 0, r.output
    passk = json.loads((out / "passk.json").read_text())
    assert {k: v["n"] for k, v in passk.items()} == {"multihop": 93, "order-ops": 55, "typo": 96}
    ranks = [json.loads(x) for x in (out / "passk_ranks.jsonl").read_text().splitlines()]
    for name, entry in passk.items():
        assert entry["layers"] == [25, 26, 27, 28]
        for readout in ("logit", "jacobian", "jacobian_random"):
            assert set(entry[readout]) == {"1", "5", "10", "50"}
            rows = [x for x in ranks if x["set"] == name and x["readout"] == readout]
            assert all(x["score"] == min(x["ranks"].values()) and set(x["ranks"]) == {"25", "26", "27", "28"}
                       for x in rows)
            for k in KS:
                per: dict[str, list[bool]] = {}
                for x in rows:
                    per.setdefault(x["item"], []).append(x["score"] <= k)
                assert len(per) == entry["n"]
                assert entry[readout][str(k)] == pytest.approx(np.mean([np.mean(v) for v in per.values()]))
                lo, hi = entry["ci"][readout][str(k)]
                assert lo <= entry[readout][str(k)] <= hi
    # order-ops numbers above 9 are several digit tokens in SmolLM2: their word forms are single tokens
    twelve = next(x for x in ranks if x["set"] == "order-ops" and x["intermediate"] == "12")
    assert not twelve["fallback"] and " twelve" in twelve["forms"]
    causal = json.loads((out / "causal.json").read_text())
    assert set(causal["summary"]) == {"multihop", "order-ops", "typo"}
    assert causal["summary"]["typo"]["26"]["jacobian"]["n"] == 96  # the middle fitted layer of 25-28


def test_removing_the_mean_unembedding_row_changes_no_rank(llama):
    """The review (science-4 §2.5 item 1) lists "the logit lens with the unembedding mean removed" as a further
    readout. Subtracting the mean row `w̄` from every row of `W_U` shifts every logit at a position by the same
    `w̄·norm(h)`, so ranks and the softmax are those of the logit lens: it is not a separate control."""
    model, tok = llama
    ids = torch.tensor([tok.bos_token_id, *tok("The shop sold many boxes of", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        x = model.hf.model.norm(model.hf(input_ids=ids[None], output_hidden_states=True).hidden_states[1][0])
        W = model.hf.lm_head.weight
        z, z0 = x @ W.T, x @ (W - W.mean(0, keepdim=True)).T
    assert torch.allclose(torch.log_softmax(z, -1), torch.log_softmax(z0, -1), atol=1e-5)
    for t in (0, 5, 17):
        assert token_ranks(z[-1], [t]) == token_ranks(z0[-1], [t])
