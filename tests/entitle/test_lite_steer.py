"""Entitle lite steering: the hook against a plain forward pass with the same edit, the controls'
construction (norm matching, token matching) and the summary recounted from the rows on disk."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lhd_train.entitle.lite import run_lite
from lhd_train.entitle.lite_score import Suffix, score_suffixes
from lhd_train.entitle.lite_steer import (
    DENY,
    ENTITLEMENT,
    ROWS,
    TOKEN_MATCHED,
    UNSTEERED,
    LiteSteerSettings,
    _form_shape,
    build_directions,
    run_lite_steer,
    token_matched_ids,
)
from lhd_train.entitle.settings import EntitleRunCommand


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path):
    from lens.model import load_hf

    return load_hf(str(tiny_llama_dir))


def _plain_steered_logprobs(model, prompt: list[int], cont: list[int], layer: int, unit: torch.Tensor,
                            alpha: float) -> list[float]:
    """An independent computation: the whole sequence in one forward pass, with the block's output at
    the prompt's last position moved by alpha * |h| * unit."""
    at = len(prompt) - 1

    def hook(_m, _i, out):
        h = (out[0] if isinstance(out, tuple) else out).clone()
        h[:, at] = h[:, at] + alpha * h[:, at].norm(dim=-1, keepdim=True) * unit
        return (h, *out[1:]) if isinstance(out, tuple) else h

    handle = model.blocks[layer].register_forward_hook(hook)
    try:
        logp = torch.log_softmax(model.hf(input_ids=torch.tensor([prompt + cont])).logits.float(), -1)[0]
    finally:
        handle.remove()
    return [float(logp[at + j, t]) for j, t in enumerate(cont)]


def test_steering_hook_matches_a_plain_forward_with_the_same_edit(tiny) -> None:
    model, _ = tiny
    torch.manual_seed(0)
    units = torch.randn(2, model.d_model)
    units = units / units.norm(dim=-1, keepdim=True)
    prompts = [list(range(10, 40)), list(range(10, 30)) + [5, 6]]
    sufs = [Suffix(0, (3, 4, 5), 0, 1.0), Suffix(1, (7, 8), 1, 0.5), Suffix(0, (3, 4, 5)), Suffix(1, (7, 8), 0, 0.0)]
    got = score_suffixes(model, prompts, sufs, layer=1, units=units)
    for s, g in zip(sufs, got, strict=True):
        unit = units[s.direction or 0]
        want = _plain_steered_logprobs(model, prompts[s.prompt], list(s.tokens), 1, unit, s.alpha)
        assert g.token_logprobs == pytest.approx(want, abs=1e-4)
    assert got[0].token_logprobs != pytest.approx(got[2].token_logprobs, abs=1e-4)  # the edit changes something
    plain = score_suffixes(model, prompts, [Suffix(1, (7, 8))])
    assert got[3].token_logprobs == pytest.approx(plain[0].token_logprobs, abs=1e-5)  # alpha 0: unsteered


def test_directions_are_norm_matched_and_the_control_is_token_matched(tiny) -> None:
    from lens.margins import default_words, resolve_token_sets

    model, tok = tiny
    dirs, record = build_directions(model, tok, 1, None, 20, 0)
    names = [d.name for d in dirs]
    assert names[:2] == [ENTITLEMENT, TOKEN_MATCHED] and len([n for n in names if n.startswith("random")]) == 20
    v = dirs[0].vector
    for d in dirs[2:]:  # random: the entitlement direction's norm
        assert float(d.vector.norm()) == pytest.approx(float(v.norm()), rel=1e-5)
    # the hook adds alpha * |h| along each unit: the same displacement for every direction (read at the
    # next block's input, after the hook has run)
    seen: list[torch.Tensor] = []
    handle = model.blocks[1].register_forward_pre_hook(lambda _m, args: seen.append(args[0][:, 0].clone()))
    try:
        score_suffixes(model, [[11, 12, 13]], [Suffix(0, (4,))])
        for d in dirs[:3]:
            unit = (d.vector / d.vector.norm())[None, :]
            score_suffixes(model, [[11, 12, 13]], [Suffix(0, (4,), 0, 0.5)], layer=0, units=unit)
    finally:
        handle.remove()
    suffix_inputs = seen[1::2]  # each call runs the prefix, then the suffix
    base, steered = suffix_inputs[0], suffix_inputs[1:]
    moves = [float((h - base).norm()) for h in steered]
    assert moves == pytest.approx([0.5 * float(base.norm())] * 3, rel=1e-4)
    cos = [float(torch.nn.functional.cosine_similarity((h - base)[0], d.vector, dim=0))
           for h, d in zip(steered, dirs[:3], strict=True)]
    assert cos == pytest.approx([1.0] * 3, abs=1e-4)
    # token matching: one control per N token, same shape, nearest free id, none an S/N/R word
    sets = resolve_token_sets(tok, model_type=model.model_type)
    control = record["token_sets"]["control"]
    assert len(control) == len(sets.N) == len(set(control))
    assert not set(control) & set(sets.union())
    words = {w.lower() for ws in default_words().values() for w in ws}
    for c in record["control"]:
        assert c["form"].strip().lower() not in words | DENY
        assert _form_shape(c["form"]) == _form_shape(c["for"]) and tok.decode([c["id"]]) == c["form"]


def test_token_matching_picks_the_nearest_id_of_the_same_shape(smollm2_dir: Path) -> None:
    from lens.margins import resolve_token_sets
    from rollouts.tokenizer import load_tokenizer

    tok = load_tokenizer(str(smollm2_dir))
    sets = resolve_token_sets(tok)
    matched = token_matched_ids(tok, list(sets.N), set(sets.union()))
    assert len(matched) == len(sets.N)
    ref_ids = np.array([r for r, _, _ in matched])
    ctl_ids = np.array([c for _, c, _ in matched])
    # frequency proxy: the control ids sit near the N ids (a random word of the vocabulary would not)
    assert np.median(np.abs(np.log(ctl_ids / ref_ids))) < 0.5
    for r, c, form in matched:
        assert _form_shape(tok.decode([r])) == _form_shape(form) and tok(form, add_special_tokens=False)[
            "input_ids"] == [c]


def test_steer_summary_recounted_from_rows(tiny, tiny_llama_dir: Path, tmp_path: Path) -> None:
    model, tok = tiny
    out = tmp_path / "d"
    run_lite(EntitleRunCommand(model_or_config=str(tiny_llama_dir), out=out, mode="lite",
                               pack="lhd_startup_consulting", facts=3, progress=False), model, tok)
    summary = run_lite_steer(LiteSteerSettings(directory=out, random=4, alphas=[0.5, 1.0], progress=False), model, tok)
    rows = [json.loads(line) for line in (out / ROWS).read_text().splitlines()]
    assert len(rows) == 3 * (1 + 6 * 2)
    base = {r["fact"]: r["margin"] for r in rows if r["direction"] == UNSTEERED}
    for r in rows:
        assert r["margin"] == pytest.approx(r["logprob"]["abstain"] - r["logprob"]["X"])
    ent = np.array([r["margin"] - base[r["fact"]] for r in rows if r["direction"] == ENTITLEMENT and r["alpha"] == 1])
    row = next(t for t in summary["directions"] if t["direction"] == ENTITLEMENT and t["alpha"] == 1.0)
    assert row["margin"]["mean"] == pytest.approx(ent.mean()) and row["margin"]["n_facts"] == 3
    rand = [np.mean([r["margin"] - base[r["fact"]] for r in rows if r["direction"] == f"random{k:02d}"
                     and r["alpha"] == 1]) for k in range(1, 5)]
    null = summary["null"]["1"]
    assert null["random_avg"] == pytest.approx(np.mean(rand))
    assert null["entitlement_p_vs_random"] == pytest.approx((1 + sum(x >= ent.mean() for x in rand)) / 5)
    again = run_lite_steer(LiteSteerSettings(directory=out, random=4, alphas=[0.5, 1.0], progress=False), model, tok)
    assert len((out / ROWS).read_text().splitlines()) == len(rows) and again["directions"] == summary["directions"]


def test_rows_split_by_the_key_value_budget_score_the_same(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    from lhd_train.entitle import lite_score

    model, _ = tiny
    units = torch.nn.functional.normalize(torch.randn(3, model.d_model, generator=torch.Generator().manual_seed(1)),
                                          dim=-1)
    prompts = [list(range(10, 50)), list(range(10, 45)) + [7]]
    sufs = [Suffix(p, (3, 4 + k), k % 3, 0.5 * k) for p in (0, 1) for k in range(5)]
    whole = score_suffixes(model, prompts, sufs, layer=0, units=units)
    monkeypatch.setattr(lite_score, "KV_ROWS_TOKENS", 100)  # 2 rows of a 40-token prompt per pass
    split = score_suffixes(model, prompts, sufs, layer=0, units=units)
    for a, b in zip(split, whole, strict=True):
        assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-5)
    assert [s.top1 for s in split] == [s.top1 for s in whole]
