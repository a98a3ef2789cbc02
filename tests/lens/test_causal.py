"""Issue 28 item 2: the causal check (science-4 review §2.5 item 2). The lens direction is checked
against the readout it stands for (an RMSNorm model's J-lens logit is `<v, h> / rms(J h)`), the
projection against its definition, and the output KL against an HF forward with a hook of the
test's own and `torch.nn.functional.kl_div`."""
from __future__ import annotations

import pytest
import torch

from lens.causal import CausalConfig, causal_rows, item_edits, run_edits, summarise_causal
from lens.directions import token_directions
from lens.errors import LensError
from lens.fit import FitOptions, FitSettings, fit_lens
from lens.margins import TokenSets
from lens.model import block_outputs
from lens.promptsets import PromptItem, PromptSet, encode_item, token_forms
from lens.readout import JacobianLens, LogitLens
from lens.store import Lens

LAYER = 1


@pytest.fixture(scope="module")
def lens(llama, fit_prompts):
    model, tok = llama
    return fit_lens(model, tok, fit_prompts[:2], FitSettings(skip_first=4, max_length=32, dim_batch=64,
                                                              source_layers=[0, 1]),
                    options=FitOptions(progress=False)).lens


def _h(model, tok, text="The shop sold many boxes of"):
    ids = torch.tensor([tok.bos_token_id, *tok(text, add_special_tokens=False)["input_ids"]])
    return ids, block_outputs(model, ids[None], layers=[LAYER])[LAYER][0, -1]


def test_direction_is_the_lens_logit_and_projection_removes_it(llama, lens):
    model, tok = llama
    _, h = _h(model, tok)
    J = lens.J[LAYER]
    token = 7
    v = JacobianLens(model, lens).direction(LAYER, token_directions(model, [token])[0])
    x = J @ h
    norm = model.hf.model.norm
    rms = torch.sqrt(x.pow(2).mean() + norm.variance_epsilon)
    z = model.unembed(x[None])[0, token]
    assert float(z) == pytest.approx(float(v @ h / rms), rel=1e-4, abs=1e-5)  # the token's J-lens logit
    g, w = model.hf.model.norm.weight, model.hf.lm_head.weight[token]
    assert torch.allclose(v, J.T @ (g * w), rtol=1e-5, atol=1e-6)  # the adjoint, by autograd, is Jᵀ (g ⊙ w)
    assert torch.allclose(LogitLens(model).direction(LAYER, g * w), g * w)
    jl = {"jacobian": JacobianLens(model, lens)}
    edit = item_edits(model, jl, LAYER, h, [[token]], None, torch.Generator().manual_seed(0), n_random=0)
    assert [e["kind"] for e in edit] == ["jacobian"]
    h2 = h - edit[0]["delta"]  # the edited residual: h without its component along v
    assert abs(float(h2 @ v)) < 1e-4 * float(v.norm() * h.norm())
    assert float(model.unembed((J @ h2)[None])[0, token]) == pytest.approx(0.0, abs=1e-4)  # its logit is now 0
    w = torch.randn(h.shape[0], generator=torch.Generator().manual_seed(0))
    w = w - (w @ v) / (v @ v) * v  # orthogonal to v: untouched
    assert float(h2 @ w) == pytest.approx(float(h @ w), rel=1e-4, abs=1e-4)
    zero = Lens({LAYER: torch.zeros_like(J)}, dict(lens.meta))
    with pytest.raises(LensError, match="zero"):
        item_edits(model, {"jacobian": JacobianLens(model, zero)}, LAYER, h, [[token]], None,
                   torch.Generator().manual_seed(0), n_random=0)


def test_output_kl_matches_a_hooked_hf_forward(llama, lens):
    model, tok = llama
    ids, h = _h(model, tok)
    pos = len(ids) - 1
    gen = torch.Generator().manual_seed(0)
    sets = TokenSets(S=[5, 6], N=[8, 9], R=[])
    readouts = {"jacobian": JacobianLens(model, lens), "logit": LogitLens(model)}
    edits = item_edits(model, readouts, LAYER, h, [[7], [11, 12]], sets, gen, n_random=2)
    assert [e["kind"] for e in edits][:3] == ["jacobian", "random:jacobian", "random:jacobian"]
    assert len(edits) == (2 * 2 + 1) * 3
    for e in edits[:3]:  # the random edits are norm-matched to the lens edit
        assert float(e["delta"].norm()) == pytest.approx(float(edits[0]["delta"].norm()), rel=1e-5)
    deltas = torch.stack([e["delta"] for e in edits])
    logp = run_edits(model, ids, pos, LAYER, deltas)

    hf = model.hf
    with torch.no_grad():
        base = torch.log_softmax(hf(input_ids=ids[None]).logits[0, -1].float(), -1)
    assert torch.allclose(logp[0], base, atol=1e-4)
    for b in (0, 1, 6, len(edits) - 1):
        def hook(_m, _i, out, d=deltas[b]):
            t = out[0] if isinstance(out, tuple) else out
            t = t.clone()
            t[0, pos] -= d
            return (t, *out[1:]) if isinstance(out, tuple) else t

        handle = hf.model.layers[LAYER].register_forward_hook(hook)
        try:
            with torch.no_grad():
                after = torch.log_softmax(hf(input_ids=ids[None]).logits[0, -1].float(), -1)
        finally:
            handle.remove()
        assert torch.allclose(logp[b + 1], after, atol=1e-4)
        kl = torch.nn.functional.kl_div(after, base, log_target=True, reduction="sum")
        got = float((logp[0].exp() * (logp[0] - logp[b + 1])).sum())
        assert got == pytest.approx(float(kl), rel=1e-4, abs=1e-6)


def test_causal_rows_and_summary(llama, lens):
    model, tok = llama
    pset = PromptSet("mine", "m.json", "0", [
        PromptItem("a", "The shop sold many boxes of", ["tea", "coffee"], target="tea"),
        PromptItem("b", "The report lists the units sold in the", ["north"])])
    readouts = {"logit": LogitLens(model), "jacobian": JacobianLens(model, lens)}
    rows = causal_rows(model, tok, readouts, pset, TokenSets(S=[5, 6], N=[8, 9], R=[]),
                       CausalConfig(layers=[0, 1], n_random=2))
    # per item and layer: (2 lens kinds x intermediates + entitlement) x (1 + 2 random)
    assert len(rows) == 2 * ((2 * 2 + 1) * 3 + (2 * 1 + 1) * 3)
    ids, pos = encode_item(tok, pset.items[1], "mine")
    h = block_outputs(model, ids[None], layers=[1])[1][0, pos]
    row = next(r for r in rows if r["item"] == "b" and r["layer"] == 1 and r["kind"] == "jacobian")
    forms = token_forms(tok, "north", "mine")
    g = model.hf.model.norm.weight
    v = lens.J[1].T @ (g * model.hf.lm_head.weight[forms.ids].mean(0))  # Jᵀ (g ⊙ w̄), by hand
    assert row["removed_norm"] == pytest.approx(abs(float(h @ v / v.norm())), rel=1e-4)
    assert row["answer"] == "model_top1" and row["answer_rank_before"] == 1
    s = summarise_causal(rows, n_boot=100)
    for layer in ("0", "1"):
        for kind in ("jacobian", "logit", "entitlement"):
            sel = [r for r in rows if r["layer"] == int(layer) and r["kind"] == kind]
            assert s[layer][kind]["kl"] == pytest.approx(sum(r["kl"] for r in sel) / len(sel))
            rnd = [r for r in rows if r["layer"] == int(layer) and r["kind"] == f"random:{kind}"]
            # two draws per key, so the mean of the per-key means is the plain mean
            assert s[layer][kind]["kl_random"] == pytest.approx(sum(r["kl"] for r in rnd) / len(rnd))
            lo, hi = s[layer][kind].get("kl_diff_ci", [None, None])
            assert lo is None or lo <= s[layer][kind]["kl"] - s[layer][kind]["kl_random"] <= hi + 1e-12
