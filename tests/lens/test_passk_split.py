"""Issue 36 item 11 (science-5 §3.1): pass@k split by intermediate kind (result vs operation), with
the intermediates whose scored forms are in the prompt left out, and the `prompt_echo` baseline.
Kinds and prompt presence are recounted from the prompt text and the tokenizer; the split's
pass@k, the echo ranks and passk_split.csv are recounted from passk_ranks.jsonl on a tiny model."""
from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from lens.eval_report import passk_markdown, split_rows
from lens.passk import KS, ItemRanks, echo_ranks, summarise_set
from lens.promptsets import OPERATION_SYNONYMS, TokenForms, intermediate_kind, load_prompt_set
from lhd_train.cli.lens import app

runner = CliRunner()


def test_kinds_and_the_operation_symbols_in_the_prompt():
    """science-5 §3.1 counts 45 of the 55 operation intermediates with their symbol in the prompt; with the
    word forms (`plus`, `times`, ...) 53 of 55 are there as text."""
    ps = load_prompt_set("order-ops")
    pairs = [(it.prompt, w) for it in ps.items for w in it.intermediates]
    kinds = [intermediate_kind(w, "order-ops") for _, w in pairs]
    assert kinds.count("result") == 55 and kinds.count("operation") == 55
    assert all(kind == "result" for (_, w), kind in zip(pairs, kinds, strict=True) if re.fullmatch(r"-?\d+", w))
    ops = [(p, w) for p, w in pairs if w in OPERATION_SYNONYMS]
    symbol = sum(any(s in p for s in OPERATION_SYNONYMS[w] if len(s) == 1 and not s.isalpha()) for p, w in ops)
    text = sum(any(s in p.lower() for s in (w, *OPERATION_SYNONYMS[w])) for p, w in ops)
    assert (len(ops), symbol, text) == (55, 45, 53)
    assert intermediate_kind("twelve", "order-ops") == "result" and intermediate_kind("Paris", "multihop") == "word"
    assert intermediate_kind("12", "multihop") == "word"  # kinds are an order-ops notion


def test_echo_ranks_by_recency():
    assert echo_ranks([5, 7, 5, 9, 2], [2, 5, 9, 7, 3], vocab=100) == [1, 3, 2, 4, 100]


def _row(item: str, word: str, kind: str, rank: int, in_prompt: bool) -> ItemRanks:
    ranks = {"logit": {3: rank}, "jacobian": {3: max(1, rank // 10)}}
    return ItemRanks("s", item, word, TokenForms(word, [0], [word]), ranks, kind=kind,
                     prompt_forms=[word] if in_prompt else [])


def test_split_by_hand():
    rows = [_row("a", "5", "result", 1, False), _row("a", "addition", "operation", 30, True),
            _row("b", "7", "result", 40, False), _row("b", "mod", "operation", 2000, False),
            _row("c", "3", "result", 8, True), _row("c", "squared", "operation", 3, True)]
    s = summarise_set(rows, ["logit", "jacobian"], [3], n_boot=200, seed=0)
    split = {(x["kind"], x["prompt"]): x for x in s["split"]}
    assert set(split) == {(k, p) for k in ("result", "operation", "all") for p in ("any", "absent")}
    assert s["in_prompt"]["by_kind"] == {"result": [1, 3], "operation": [2, 3]}
    assert s["in_prompt"]["intermediates"] == ["a:addition", "c:3", "c:squared"]
    assert split[("operation", "absent")]["n"] == 1 and split[("operation", "absent")]["passk"]["logit"]["50"] == 0
    assert split[("result", "absent")]["passk"]["logit"]["10"] == pytest.approx(0.5)  # a: rank 1; b: rank 40
    assert split[("result", "absent")]["passk"]["jacobian"]["10"] == pytest.approx(1.0)  # ranks 1 and 4
    assert split[("all", "absent")]["n"] == 2 and split[("all", "absent")]["n_intermediates"] == 3
    # item b has two absent intermediates: 40 and 2000 under logit, so its share at 50 is 1/2
    assert split[("all", "absent")]["passk"]["logit"]["50"] == pytest.approx(np.mean([1.0, 0.5]))
    assert split[("all", "any")]["passk"] == {r: s[r] for r in ("logit", "jacobian")}
    csv = pd.DataFrame(split_rows({"s": s}))
    assert len(csv) == 6 * 2
    one = csv[(csv["kind"] == "result") & (csv["prompt"] == "absent") & (csv["readout"] == "jacobian")].iloc[0]
    assert one["pass@10"] == pytest.approx(1.0) and one["auc_minus_logit"] == pytest.approx(
        split[("result", "absent")]["auc_diff"]["jacobian - logit"]["value"])
    md = "\n".join(passk_markdown({"s": s}))
    assert "(in the prompt: result 1 of 3, operation 2 of 3)" in md
    assert "| operation | absent | 1 | 1 | logit | 0.000" in md


@pytest.fixture(scope="module")
def order_ops_eval(tiny_dirs, tmp_path_factory):
    model = tiny_dirs["llama"]
    tmp = tmp_path_factory.mktemp("ops")
    corpus = tmp / "c.txt"
    corpus.write_text("\n\n".join(f"Fit paragraph {i}: (2 + {i}) * 4 = {4 * (2 + i)} and {i} minus one is {i - 1}, "
                                  "as the table of sums shows twice." for i in range(2)))
    r = runner.invoke(app, ["fit", str(model), "--corpus", str(corpus), "--out", str(tmp / "L"), "--device", "cpu",
                            "--max-length", "32", "--skip-first", "4", "--source-layers", "0,1", "--no-progress",
                            "--threads", "1", "--save-dtype", "float32", "--dim-batch", "64"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["eval", str(model), "--readout", f"jacobian={tmp / 'L'}", "--prompt-set", "order-ops",
                            "--out", str(tmp / "ev"), "--device", "cpu", "--threads", "1", "--no-progress",
                            "--bootstrap", "50", "--no-causal"])
    assert r.exit_code == 0, r.output
    return model, tmp / "ev"


def test_split_recounts_from_the_written_files(order_ops_eval):
    from transformers import AutoTokenizer

    model, out = order_ops_eval
    tok = AutoTokenizer.from_pretrained(model)
    entry = json.loads((out / "passk.json").read_text())["order-ops"]
    ranks = [json.loads(x) for x in (out / "passk_ranks.jsonl").read_text().splitlines()]
    items = {it.name: it for it in load_prompt_set("order-ops").items}
    readouts = ["logit", "jacobian", "jacobian_random", "prompt_echo"]
    # prompt presence and the echo rank, from the prompt's own tokens (order-ops prompts are plain strings)
    for x in ranks:
        prompt_ids = [tok.bos_token_id, *tok(items[x["item"]].prompt, add_special_tokens=False)["input_ids"]]
        present = [f for t, f in zip(x["token_ids"], x["forms"], strict=True) if t in prompt_ids]
        assert x["prompt_forms"] == present and x["in_prompt"] == bool(present)
        assert x["kind"] == ("result" if re.fullmatch(r"-?\d+", x["intermediate"]) else "operation")
        if x["readout"] == "prompt_echo":
            recency = list(dict.fromkeys(reversed(prompt_ids)))
            assert x["score"] == min(recency.index(t) + 1 if t in recency else len(tok) for t in x["token_ids"])
    echo = [x for x in ranks if x["readout"] == "prompt_echo"]
    by_kind = {k: [sum(x["in_prompt"] for x in echo if x["kind"] == k), sum(x["kind"] == k for x in echo)]
               for k in ("result", "operation")}
    assert entry["in_prompt"]["by_kind"] == by_kind and by_kind["operation"][0] > 40  # the symbols are one token
    # every split cell recounts from the per-intermediate ranks, and passk_split.csv holds the same numbers
    csv = pd.read_csv(out / "passk_split.csv")
    assert len(csv) == len(entry["split"]) * len(readouts) == 6 * 4
    for sub in entry["split"]:
        keep = [x for x in ranks if (sub["kind"] == "all" or x["kind"] == sub["kind"])
                and (sub["prompt"] == "any" or not x["in_prompt"])]
        for readout in readouts:
            rows = [x for x in keep if x["readout"] == readout]
            assert sub["n_intermediates"] == len(rows) and sub["n"] == len({x["item"] for x in rows})
            line = csv[(csv["kind"] == sub["kind"]) & (csv["prompt"] == sub["prompt"]) & (csv["readout"] == readout)]
            for k in KS:
                per: dict[str, list[bool]] = {}
                for x in rows:
                    per.setdefault(x["item"], []).append(x["score"] <= k)
                expected = np.mean([np.mean(v) for v in per.values()])
                assert sub["passk"][readout][str(k)] == pytest.approx(expected)
                assert line[f"pass@{k}"].iloc[0] == pytest.approx(expected)
    # the echo baseline finds the operation symbols that are in the prompt, and none that are not
    ops = {(x["kind"], x["prompt"]): x for x in entry["split"]}
    assert ops[("operation", "absent")]["passk"]["prompt_echo"]["50"] == 0.0
    assert ops[("operation", "any")]["passk"]["prompt_echo"]["50"] > 0.7
    assert "| operation | absent |" in (out / "quality.md").read_text()
