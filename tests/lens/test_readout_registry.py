"""Issue 32 item 3: a new readout is one class plus one registry entry. A toy readout (the residual's
dimensions reversed, a linear map that is its own adjoint) is registered, and with no other change
it is read by `lhd lens read`'s library path, scored by pass@k and next-token KL, and edited along by
the causal check; each of its numbers is checked against the model's own norm and lm_head by hand.
Issue 37 item 3: a readout with a fitted artifact of its own is one class (declaring `artifact`, with
`load`) and one registry entry, read through `lhd lens read --readout NAME=PATH`."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from lens_data import make_pack

from lens.causal import item_edits
from lens.fidelity import EvalConfig, evaluate
from lens.margins import margins, resolve_token_sets
from lens.model import block_outputs
from lens.passk import rank_items, token_ranks
from lens.positions import tag_chat_prompt
from lens.promptsets import PromptItem, PromptSet, encode_item, token_forms
from lens.readout import READOUTS, Lenses, Readout, build_readouts, fitted_readouts
from lhd_train.config.lens import ReadSettings
from lhd_train.reading.probes import build_probe_set, render_probe, write_probes
from lhd_train.reading.read import read_probe_set


class FlippedLens(Readout):
    """`W_U · norm(reverse(h))`: read whenever asked, at every layer."""

    name = "flipped"

    @classmethod
    def build(cls, model, lenses):
        return cls(model)

    def has_layer(self, layer):
        return True

    def transform(self, layer, h):
        return h.flip(-1)


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(READOUTS, FlippedLens.name, FlippedLens)


def _hand_logits(model, h):
    hf = model.hf
    with torch.no_grad():
        return hf.lm_head(hf.model.norm(h.flip(-1))).float()


def test_a_registered_readout_is_read_everywhere(registered, llama, tmp_path):
    model, tok = llama
    readouts = build_readouts(model, Lenses())
    assert list(readouts) == ["logit", "flipped"]

    # the margins read (probe-set mode): its rows are in margins.parquet, each margin recomputed by hand
    probes = build_probe_set(make_pack(), max_facts_per_task=1, seed=0)[:4]
    sets = resolve_token_sets(tok, fallback="first-token")
    summary = read_probe_set(model, tok, None, probes, sets, tmp_path / "read",
                             ReadSettings(progress=False, probe=False, bootstrap=20))
    m = pd.read_parquet(summary["files"]["margins"])
    assert set(m["readout"]) == {"logit", "flipped"}
    messages, spans, prefill = render_probe(probes[0])
    tag = tag_chat_prompt(tok, messages, spans, prefill=prefill, judged="claim")
    acts = block_outputs(model, torch.tensor(tag.input_ids)[None])
    union = torch.tensor(sets.union())
    for layer in range(model.n_layers):
        row = m[(m["example_id"] == probes[0]["id"]) & (m["readout"] == "flipped") & (m["layer"] == layer)
                & (m["position"] == "decision")].iloc[0]
        z = _hand_logits(model, acts[layer][0, tag.positions["decision"]])[union]
        assert row["m_E"] == pytest.approx(float(margins(z[None], sets.index_sets())["m_E"][0]), abs=1e-4)
    table = pd.read_csv(tmp_path / "read" / "auroc.csv")
    assert set(table["readout"]) == {"logit", "flipped"}  # its AUROC rows, per layer and over the band
    assert "flipped · decision" in (tmp_path / "read" / "auroc.md").read_text()

    # pass@k ranks: the intermediate's rank in the readout's logits at the read position
    pset = PromptSet("mine", "m.json", "0", [PromptItem("a", "The shop sold many boxes of", ["tea"])])
    ranks = rank_items(model, tok, pset, readouts, [0, 1])
    ids, pos = encode_item(tok, pset.items[0], "mine")
    acts = block_outputs(model, ids[None], layers=[0, 1])
    forms = token_forms(tok, "tea", "mine")
    for layer in (0, 1):
        assert ranks[0].ranks["flipped"][layer] == min(token_ranks(_hand_logits(model, acts[layer][0, pos]),
                                                                   forms.ids))

    # next-token KL on held-out text: the model's own distribution against the readout's, by hand
    text = "The shop in town sold many boxes of tea last month, and the owner plans to order more crates soon."
    res = evaluate(model, tok, readouts, [text], EvalConfig(skip_first=4, max_length=32, n_boot=0))
    assert res["readouts"] == ["logit", "flipped"]
    ids = torch.tensor([tok.bos_token_id, *tok(text, add_special_tokens=False)["input_ids"]][:32])
    with torch.no_grad():
        out = model.hf(input_ids=ids[None], output_hidden_states=True, use_cache=False)
    logp = torch.log_softmax(out.logits[0, 4:].float(), -1)
    logq = torch.log_softmax(_hand_logits(model, out.hidden_states[1][0, 4:]), -1)  # block 0's output
    kl = torch.nn.functional.kl_div(logq, logp, log_target=True, reduction="none").sum(-1).mean()
    assert res["layers"][0]["kl_flipped"] == pytest.approx(float(kl), rel=1e-4)

    # the causal check edits along its direction: the adjoint of reversing is reversing
    h = acts[0][0, pos]
    edits = item_edits(model, readouts, 0, h, [forms.ids], None, torch.Generator().manual_seed(0), n_random=0)
    assert [e["kind"] for e in edits] == ["logit", "flipped"]
    g = model.hf.model.norm.weight
    v = (g * model.hf.lm_head.weight[forms.ids].mean(0)).flip(-1)
    v = v / v.norm()
    assert torch.allclose(edits[1]["delta"], (h @ v) * v, atol=1e-5)


class Shift:
    """A fitted artifact of its own: one vector added to the residual, stored as JSON."""

    def __init__(self, b: list[float], sha256: str):
        self.b, self.meta = torch.tensor(b), SimpleNamespace(sha256=sha256)


class ShiftedLens(Readout):
    """`W_U · norm(h + b)`, with `b` from its own file: a readout with an artifact is this class and one
    registry entry; `--readout shifted=PATH` reaches its `load` with no other change."""

    name = "shifted"
    artifact = "a JSON list of d_model numbers"

    @classmethod
    def load(cls, path, *, model=None, target_layer=None):
        text = Path(path).read_text()
        return Shift(json.loads(text), hashlib.sha256(text.encode()).hexdigest())

    @classmethod
    def build(cls, model, lenses):
        shift = lenses.fitted.get(cls.name)
        return None if shift is None else cls(model, shift)

    def __init__(self, model, shift):
        super().__init__(model)
        self.shift = shift

    @property
    def fitted(self):
        return self.shift

    def has_layer(self, layer):
        return True

    def transform(self, layer, h):
        return h + self.shift.b.to(h.dtype)


def test_a_readout_with_its_own_artifact_is_one_class_and_one_registry_line(monkeypatch, llama, tiny_dirs, tmp_path):
    from typer.testing import CliRunner

    from lhd_train.cli.lens import app

    model, tok = llama
    monkeypatch.setitem(READOUTS, ShiftedLens.name, ShiftedLens)  # the one registry line
    assert "shifted" in fitted_readouts()
    b = [0.05 * ((i % 7) - 3) for i in range(model.d_model)]
    (tmp_path / "shift.json").write_text(json.dumps(b))
    probes = build_probe_set(make_pack(), max_facts_per_task=1, seed=0)[:4]
    write_probes(probes, tmp_path / "probes.jsonl")
    out = tmp_path / "read"
    r = CliRunner().invoke(app, ["read", str(tiny_dirs["llama"]), "--readout", f"shifted={tmp_path / 'shift.json'}",
                                 "--probes", str(tmp_path / "probes.jsonl"), "--out", str(out), "--bootstrap", "0",
                                 "--no-probe", "--token-fallback", "first-token", "--no-progress", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    m = pd.read_parquet(out / "margins.parquet")
    assert set(m["readout"]) == {"logit", "shifted"}
    plan = json.loads((out / "plan.json").read_text())
    assert plan["fitted"] == {"shifted": {"sha256": hashlib.sha256((tmp_path / "shift.json").read_bytes()).hexdigest()}}
    # its margins by hand: the model's own norm and lm_head after adding b
    sets = resolve_token_sets(tok, fallback="first-token")
    messages, spans, prefill = render_probe(probes[0])
    tag = tag_chat_prompt(tok, messages, spans, prefill=prefill, judged="claim")
    acts = block_outputs(model, torch.tensor(tag.input_ids)[None])
    hf, union = model.hf, torch.tensor(sets.union())
    for layer in range(model.n_layers - 1):
        row = m[(m["example_id"] == probes[0]["id"]) & (m["readout"] == "shifted") & (m["layer"] == layer)
                & (m["position"] == "decision")].iloc[0]
        with torch.no_grad():
            z = hf.lm_head(hf.model.norm(acts[layer][0, tag.positions["decision"]] + torch.tensor(b))).float()[union]
        assert row["m_E"] == pytest.approx(float(margins(z[None], sets.index_sets())["m_E"][0]), abs=1e-4)
    # a readout that loads nothing, or an unknown name, is refused in one line naming the allowed ones
    for bad in ("logit=x", "nope=x"):
        r = CliRunner().invoke(app, ["read", str(tiny_dirs["llama"]), "--readout", bad, "--probes",
                                     str(tmp_path / "probes.jsonl"), "--out", str(tmp_path / "r2"), "--device", "cpu"])
        assert r.exit_code != 0 and "shifted" in r.output and "jacobian_self" in r.output, r.output
