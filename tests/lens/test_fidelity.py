"""Issue 24 item 4: `lhd lens eval` — per-layer KL to the model's own next-token distribution and
top-1 agreement, Jacobian lens vs logit lens, and split-half agreement, each checked against a
computation in plain torch (the HF model's `output_hidden_states`, its final norm and lm_head by
hand, KL with torch), not with the functions under test."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from scipy.stats import pearsonr
from typer.testing import CliRunner

from lens.errors import LensError
from lens.fidelity import EvalConfig, evaluate, select_held_out
from lens.fit import FitOptions, FitSettings, fit_lens
from lens.readout import PRIMARY, Lenses, build_readouts
from lens.store import Lens
from lhd_train.cli.lens import app

runner = CliRunner()
SKIP, MAXLEN = 4, 32
SETTINGS = FitSettings(skip_first=SKIP, max_length=MAXLEN, dim_batch=16)
HELD_OUT = [f"Held-out note {i}: the shop in town {i} sold {i * 13} boxes of tea last month, and the owner plans "
            f"to order {i + 4} more crates before the holidays start." for i in range(4)]


def _hand(model, tok, texts, J: dict[int, torch.Tensor], skip: int = SKIP, maxlen: int = MAXLEN):
    """Pooled KL(p_final || q) and top-1 agreement per layer, for the logit lens and `W_U norm(J h)`."""
    hf = model.hf
    norm, W = hf.model.norm, hf.lm_head.weight
    L = model.n_layers
    acc = {}
    for text in texts:
        ids = [tok.bos_token_id] if tok.bos_token_id is not None else []
        ids = torch.tensor((ids + tok(text, add_special_tokens=False)["input_ids"])[:maxlen])
        with torch.no_grad():
            out = hf(input_ids=ids[None], output_hidden_states=True, use_cache=False)
            logp = torch.log_softmax(out.logits[0, skip:].float(), -1)
            for layer in range(L):
                # hidden_states[l + 1] is block l's output, except the last entry, which is already final-normed
                h = out.hidden_states[layer + 1][0, skip:] if layer < L - 1 else None
                for name in ("logit", "jacobian"):
                    if h is None:
                        logq = logp
                    else:
                        x = h @ J[layer].T if name == "jacobian" and layer in J else h
                        logq = torch.log_softmax((norm(x) @ W.T).float(), -1)
                    kl = torch.nn.functional.kl_div(logq, logp, log_target=True, reduction="none").sum(-1)
                    hit = (logq.argmax(-1) == logp.argmax(-1)).float()
                    entropy = -(logq.exp() * logq).sum(-1)
                    current = (logq.argmax(-1) == ids[skip:]).float()
                    s = acc.setdefault((name, layer), [0.0, 0.0, 0.0, 0.0, 0])
                    for i, v in enumerate((kl, hit, entropy, current)):
                        s[i] += float(v.sum())
                    s[4] += len(kl)
    return {k: tuple(x / v[4] for x in v[:4]) for k, v in acc.items()}


def _readouts(model, lens):
    """The logit lens and the J-lens (the registry's readouts without the control)."""
    return build_readouts(model, Lenses({PRIMARY: lens}, control=False))


def test_eval_matches_hand_computation(tiny, fit_prompts):
    model, tok = tiny
    lens = fit_lens(model, tok, fit_prompts[:3], SETTINGS, options=FitOptions(progress=False)).lens
    res = evaluate(model, tok, _readouts(model, lens), HELD_OUT, EvalConfig(skip_first=SKIP, max_length=MAXLEN,
                                                                             n_boot=50))
    hand = _hand(model, tok, HELD_OUT, lens.J)
    assert res["n_texts"] == len(HELD_OUT)
    L = model.n_layers
    for row in res["layers"]:
        layer = row["layer"]
        for name in ("logit", "jacobian"):
            kl, top1, entropy, current = hand[(name, layer)]
            assert row[f"kl_{name}"] == pytest.approx(kl, rel=1e-4, abs=1e-6), (name, layer)
            assert row[f"top1_{name}"] == pytest.approx(top1, abs=1e-9), (name, layer)
            assert row[f"entropy_{name}"] == pytest.approx(entropy, rel=1e-4, abs=1e-6), (name, layer)
            assert row[f"current_token_{name}"] == pytest.approx(current, abs=1e-9), (name, layer)
        assert row["kl_diff"] == pytest.approx(row["kl_jacobian"] - row["kl_logit"])
        assert row["kl_diff_lo"] <= row["kl_diff_hi"]
    last = res["layers"][L - 1]
    assert last["kl_logit"] == pytest.approx(0.0, abs=1e-6) and last["top1_logit"] == 1.0
    assert res["model"]["entropy"] == pytest.approx(hand[("logit", L - 1)][2], rel=1e-4)
    # the fitted lens is not the identity: on the first block the two readouts differ
    assert abs(res["layers"][0]["kl_jacobian"] - res["layers"][0]["kl_logit"]) > 1e-4


def test_split_half_agreement(llama, fit_prompts):
    model, tok = llama
    a = fit_lens(model, tok, fit_prompts[:3], SETTINGS, options=FitOptions(progress=False)).lens
    b = fit_lens(model, tok, fit_prompts[3:], SETTINGS, options=FitOptions(progress=False)).lens
    full = fit_lens(model, tok, fit_prompts, SETTINGS, options=FitOptions(progress=False)).lens
    res = evaluate(model, tok, _readouts(model, full), HELD_OUT,
                   EvalConfig(skip_first=SKIP, max_length=MAXLEN, n_boot=20), halves=(a, b))
    hand_a, hand_b = _hand(model, tok, HELD_OUT, a.J), _hand(model, tok, HELD_OUT, b.J)
    for row in res["layers"]:
        layer = row["layer"]
        assert row["kl_half_a"] == pytest.approx(hand_a[("jacobian", layer)][0], rel=1e-4, abs=1e-6)
        assert row["kl_half_b"] == pytest.approx(hand_b[("jacobian", layer)][0], rel=1e-4, abs=1e-6)
        if layer in a.J:
            A, B = a.J[layer].double(), b.J[layer].double()
            rel = torch.linalg.norm(A - B) / torch.linalg.norm((A + B) / 2)
            assert row["halves_rel_frob"] == pytest.approx(float(rel), rel=1e-6)
            assert row["halves_corr"] == pytest.approx(pearsonr(A.flatten().numpy(), B.flatten().numpy())[0], 1e-6)
            assert 0 < row["halves_rel_frob"] and row["halves_corr"] < 1
        else:  # at the target the halves are both the identity
            assert row["halves_top1_agreement"] == 1.0
    # a half fitted with other layers is refused, with the layers named
    other = Lens(J={0: a.J[0]}, meta=dict(a.meta))
    with pytest.raises(LensError, match=r"split-half lenses have layers \[0, 1\] -> \d+ and \[0\] -> \d+"):
        evaluate(model, tok, _readouts(model, full), HELD_OUT[:1], EvalConfig(skip_first=SKIP, max_length=MAXLEN),
                 halves=(a, other))


def test_select_held_out_without_a_recipe_keeps_every_text():
    lens = Lens(J={0: torch.eye(2)}, meta={})  # a published .pt lens: its corpus is unknown here
    assert select_held_out(["a", "b", "c"], [lens], 2) == (["a", "b"], 0)


def _fit_cli(model, corpus, out, *extra):
    return runner.invoke(app, ["fit", str(model), "--corpus", str(corpus), "--out", str(out), "--device", "cpu",
                               "--max-length", str(MAXLEN), "--skip-first", str(SKIP), "--source-layers", "0,1",
                               "--no-progress", "--threads", "1", "--save-dtype", "float32", "--dim-batch", "16",
                               *extra])


def test_cli_eval_end_to_end(tiny_dirs, tmp_path):
    model = tiny_dirs["llama"]
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join([f"Fit paragraph {i}: the quarterly report lists {i * 11} units sold in region {i} "
                                   "and notes that the numbers were checked twice." for i in range(2)] + HELD_OUT))
    for s in (0, 1):
        r = _fit_cli(model, corpus, tmp_path / f"h{s}", "--n-prompts", "2", "--shard", f"{s}/2")
        assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["merge", str(tmp_path / "full"), str(tmp_path / "h0"), str(tmp_path / "h1")])
    assert r.exit_code == 0, r.output
    out = tmp_path / "ev"
    args = ["eval", str(model), "--readout", f"jacobian={tmp_path / 'full'}",
            "--corpus", str(corpus), "--out", str(out),
            "--device", "cpu", "--threads", "1", "--no-progress", "--bootstrap", "50", "--eval-layers", "all"]
    r = runner.invoke(app, [*args, "--half-a", str(tmp_path / "h0"), "--half-b", str(tmp_path / "h1")])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "eval.json").read_text())
    assert res["fit_texts_excluded"] == 2 and res["n_texts"] == len(HELD_OUT)  # the two fit paragraphs left out
    assert res["settings"]["skip_first"] == SKIP and res["settings"]["max_length"] == MAXLEN  # taken from the lens
    assert (out / "fidelity.png").stat().st_size > 0
    md = (out / "eval.md").read_text()
    assert "| layer | KL logit | KL J |" in md and "halves top-1 agree" in md
    assert res["layers"][0]["halves_rel_frob"] > 0
    # the numbers in eval.json are those of the library call on the same held-out texts
    from lens.model import load_hf
    from lens.store import load_lens

    m, tok = load_hf(str(model), dtype="float32", device="cpu", attn_implementation="sdpa")
    hand = _hand(m, tok, HELD_OUT, load_lens(tmp_path / "full").J)
    for row in res["layers"]:
        assert row["kl_jacobian"] == pytest.approx(hand[("jacobian", row["layer"])][0], rel=1e-4, abs=1e-6)
    # bad input: one half only; a corpus the lens saw entirely
    r = runner.invoke(app, [*args, "--half-a", str(tmp_path / "h0")])
    assert r.exit_code == 2 and "--half-b" in r.output
    all_fit = tmp_path / "all"
    assert _fit_cli(model, corpus, all_fit, "--n-prompts", "100").exit_code == 0
    r = runner.invoke(app, ["eval", str(model), "--readout", f"jacobian={all_fit}", "--corpus", str(corpus), "--out",
                            str(tmp_path / "ev2"), "--device", "cpu", "--no-progress"])
    assert r.exit_code == 2 and "no held-out text" in r.output


@pytest.mark.slow
def test_smollm2_eval_matches_recomputation(smollm2_dir, tmp_path):
    """SmolLM2-135M: a lens fitted as scripts/demo.py does (2 prompts, 32 tokens, blocks 25-28), then
    `lhd lens eval` on 4 held-out texts of the same corpus, every layer against the recomputation."""
    from lens.model import load_hf
    from lens.store import load_lens
    from lhd_train.bench.taskpack import load_pack

    texts = []
    for t in load_pack("startup_consulting").tasks:
        joined = " ".join(f"{t.title}. {t.prompt}".split())
        texts += [joined[i:i + 300] for i in range(0, min(len(joined), 900), 300)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": x}) + "\n" for x in texts))
    r = runner.invoke(app, ["fit", str(smollm2_dir), "--corpus", str(corpus), "--out", str(tmp_path / "L"),
                            "--n-prompts", "2", "--max-length", "32", "--skip-first", "8", "--source-layers", "25-28",
                            "--dim-batch", "16", "--threads", "1", "--device", "cpu", "--no-progress",
                            "--save-dtype", "float32"])
    assert r.exit_code == 0, r.output
    out = tmp_path / "ev"
    r = runner.invoke(app, ["eval", str(smollm2_dir), "--readout", f"jacobian={tmp_path / 'L'}",
                            "--corpus", str(corpus),
                            "--out", str(out), "--held-out", "4", "--threads", "1", "--device", "cpu",
                            "--no-progress", "--bootstrap", "200", "--eval-layers", "all"])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "eval.json").read_text())
    assert res["fit_texts_excluded"] == 2 and res["n_texts"] == 4 and res["n_positions"] == 4 * (32 - 8)
    m, tok = load_hf(str(smollm2_dir), dtype="float32", device="cpu", attn_implementation="eager")
    hand = _hand(m, tok, texts[2:6], load_lens(tmp_path / "L").J, skip=8, maxlen=32)
    for row in res["layers"]:
        layer = row["layer"]
        for name in ("logit", "jacobian"):
            if name == "jacobian" and layer < 25:
                assert row["kl_jacobian"] is None  # not fitted
                continue
            kl, top1, entropy, current = hand[(name, layer)]
            assert row[f"kl_{name}"] == pytest.approx(kl, rel=2e-3, abs=1e-4), (name, layer)
            assert row[f"entropy_{name}"] == pytest.approx(entropy, rel=2e-3, abs=1e-4), (name, layer)
            assert row[f"current_token_{name}"] == pytest.approx(current, abs=1.5 / res["n_positions"])
            assert row[f"top1_{name}"] == pytest.approx(top1, abs=1.5 / res["n_positions"]), (name, layer)
    assert res["layers"][-1]["kl_logit"] == pytest.approx(0.0, abs=1e-4)
    assert res["layers"][0]["kl_logit"] > 1.0  # the first block is far from the output (a real model)


def _positions(model, tok, texts, J, layer, skip=SKIP, maxlen=MAXLEN):
    """Per text: the model's log-probs and the logit / J readouts' logits at `layer`, by plain torch."""
    hf = model.hf
    out = []
    for text in texts:
        ids = torch.tensor(([tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"])[:maxlen])
        with torch.no_grad():
            o = hf(input_ids=ids[None], output_hidden_states=True, use_cache=False)
            h = o.hidden_states[layer + 1][0, skip:]
            z = {"logit": hf.model.norm(h) @ hf.lm_head.weight.T,
                 "jacobian": hf.model.norm(h @ J[layer].T) @ hf.lm_head.weight.T}
            out.append((torch.log_softmax(o.logits[0, skip:].double(), -1), {k: v.double() for k, v in z.items()}))
    return out


def test_baselines_topk_and_temperature_by_hand(llama, fit_prompts):
    """Uniform (log V − H), the marginal from the calibration half (texts 0, 2) scored on texts 1, 3, top-5/10,
    and the temperature: the fitted T is the minimum of the calibration KL (a grid by hand) and the evaluation
    half's KL at T is recomputed."""
    model, tok = llama
    lens = fit_lens(model, tok, fit_prompts[:3], SETTINGS, options=FitOptions(progress=False)).lens
    cfg = EvalConfig(skip_first=SKIP, max_length=MAXLEN, n_boot=20, temperature_positions=10_000)
    res = evaluate(model, tok, _readouts(model, lens), HELD_OUT, cfg)
    layer = 0
    per = _positions(model, tok, HELD_OUT, lens.J, layer)
    V = per[0][0].shape[-1]
    allp = torch.cat([lp for lp, _ in per])
    uniform = float((math.log(V) + (allp.exp() * allp).sum(-1)).mean())
    assert res["model"]["kl_uniform"] == pytest.approx(uniform, rel=1e-5)
    cal, ev = [per[0], per[2]], [per[1], per[3]]
    m = torch.cat([lp.exp() for lp, _ in cal]).mean(0)
    evp = torch.cat([lp for lp, _ in ev])
    marginal = float((evp.exp() * (evp - m.log())).sum(-1).mean())
    assert res["model"]["kl_marginal_eval"] == pytest.approx(marginal, rel=1e-4)
    assert res["n_calibration_texts"] == 2 and res["n_eval_texts"] == 2
    row = res["layers"][layer]
    for name in ("logit", "jacobian"):
        z_all = torch.cat([z[name] for _, z in per])
        top = allp.argmax(-1)
        rank = (z_all > z_all.gather(-1, top[:, None])).sum(-1) + 1
        assert row[f"top5_{name}"] == pytest.approx(float((rank <= 5).double().mean()))
        assert row[f"top10_{name}"] == pytest.approx(float((rank <= 10).double().mean()))
        zc, pc = torch.cat([z[name] for _, z in cal]), torch.cat([lp for lp, _ in cal])

        def kl_at(t, z=zc, lp=pc):
            return float((lp.exp() * (lp - torch.log_softmax(z / t, -1))).sum(-1).mean())

        grid = np.exp(np.linspace(math.log(0.02), math.log(50), 400))
        best = min(kl_at(t) for t in grid)
        T = row[f"temperature_{name}"]
        assert kl_at(T) <= best + 1e-4 and kl_at(T) <= kl_at(1.0) + 1e-9
        ze = torch.cat([z[name] for _, z in ev])
        assert row[f"kl_temp_{name}"] == pytest.approx(
            float((evp.exp() * (evp - torch.log_softmax(ze / T, -1))).sum(-1).mean()), rel=1e-4, abs=1e-6)
        assert row[f"kl_eval_{name}"] == pytest.approx(
            float((evp.exp() * (evp - torch.log_softmax(ze, -1))).sum(-1).mean()), rel=1e-4, abs=1e-6)


def test_cli_eval_on_chat_transcripts(tiny_dirs, tmp_path):
    """`--format messages`: KL on chat transcripts rendered with the template (the positions the margins are read
    from), counted from `encode_messages`; the random-transport control is read beside the lens."""
    from lens.corpus import encode_messages
    from lens.model import load_tokenizer

    model = tiny_dirs["llama"]
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(f"Fit paragraph {i}: the quarterly report lists {i * 11} units sold in region {i} "
                                  "and notes that the numbers were checked twice." for i in range(2)))
    assert _fit_cli(model, corpus, tmp_path / "L", "--n-prompts", "2").exit_code == 0
    chats = [[{"role": "user", "content": f"How many boxes did shop {i} sell?"},
              {"role": "assistant", "content": f"Shop {i} sold {i * 13} boxes of tea, as the ledger shows."}]
             for i in range(4)]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    out = tmp_path / "ev"
    r = runner.invoke(app, ["eval", str(model), "--readout", f"jacobian={tmp_path / 'L'}",
                            "--corpus", str(path), "--format",
                            "messages", "--out", str(out), "--device", "cpu", "--threads", "1", "--no-progress",
                            "--bootstrap", "20"])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "eval.json").read_text())
    tok = load_tokenizer(str(model))
    lengths = [len(encode_messages(tok, json.dumps(c), max_length=MAXLEN)) for c in chats]
    assert res["corpus_format"] == "messages" and res["n_positions"] == sum(n - SKIP for n in lengths)
    assert res["readouts"] == ["logit", "jacobian", "jacobian_random"]
    assert res["layers"][0]["kl_jacobian_random"] is not None
    assert "Calibration-free view" in (out / "eval.md").read_text()
