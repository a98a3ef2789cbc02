"""Storage (T10, T11, jlens .pt) and readouts (T3 lens = model logits, T4 J = I is the logit lens; the
registry builds what the given lenses allow, each readout's transform and adjoint)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from support.lens_baseline import j_lens_logits

from lens.controls import random_transport
from lens.corpus import encode_prompt
from lens.errors import LensError
from lens.fit import FitOptions, FitSettings, fit_lens
from lens.model import block_outputs
from lens.readout import (
    READOUTS,
    FutureLens,
    JacobianLens,
    Lenses,
    LogitLens,
    RandomTransportLens,
    SelfLens,
    TunedLensReadout,
    build_readouts,
)
from lens.readout_probe import out_of_fold_logits
from lens.store import Lens, load_lens, merge_lenses, save_lens
from lens.tuned import TunedLens
from lhd_train.io.files import sha256_file


def test_save_load_roundtrip(llama, fit_prompts, tmp_path):
    model, tok = llama
    res = fit_lens(model, tok, fit_prompts[:2], FitSettings(skip_first=4, max_length=24),
                   options=FitOptions(progress=False), meta={"model_id": "tiny-llama", "revision": "abc",
                                                             "corpus": {"path": "x.txt"}})
    save_lens(res.lens, tmp_path / "L")
    side = json.loads((tmp_path / "L" / "lens.json").read_text())
    for key in ("model_id", "revision", "source_layers", "target_layer", "skip_first", "max_length", "corpus",
                "n_prompts", "dtype", "sha256", "d_model", "n_layers"):
        assert key in side, key
    assert side["dtype"] == "float16" and side["sha256"] == sha256_file(tmp_path / "L" / "lens.safetensors")
    back = load_lens(tmp_path / "L", model=model)
    assert back.source_layers == [0, 1] and back.target_layer == 2 and back.n_prompts == 2
    for layer in (0, 1):
        assert back.J[layer].dtype == torch.float32
        assert torch.allclose(back.J[layer], res.lens.J[layer], atol=2e-3)
    # a tampered file is refused
    data = bytearray((tmp_path / "L" / "lens.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (tmp_path / "L" / "lens.safetensors").write_bytes(bytes(data))
    with pytest.raises(LensError, match="sha256"):
        load_lens(tmp_path / "L")


def _const_lens(value, n, layers=(0, 1), d=4, **meta):
    return Lens(J={layer: torch.full((d, d), float(value)) for layer in layers}, meta={"n_prompts": n, **meta})


def test_merge_is_n_weighted():
    merged = merge_lenses([_const_lens(1.0, 2), _const_lens(4.0, 6)])
    assert merged.n_prompts == 8
    assert torch.allclose(merged.J[0], torch.full((4, 4), 3.25))
    with pytest.raises(LensError, match="layers"):
        merge_lenses([_const_lens(1.0, 2), _const_lens(4.0, 6, layers=(0,))])
    with pytest.raises(LensError, match="target_layer"):
        merge_lenses([_const_lens(1.0, 2, target_layer=2), _const_lens(4.0, 6, target_layer=1)])


def test_shards_merge_to_the_full_fit(llama, fit_prompts, tmp_path):
    model, tok = llama
    s = FitSettings(skip_first=4, max_length=24)
    full = fit_lens(model, tok, fit_prompts[:5], s, options=FitOptions(progress=False))
    a = fit_lens(model, tok, fit_prompts[:2], s, options=FitOptions(progress=False))
    b = fit_lens(model, tok, fit_prompts[2:5], s, options=FitOptions(progress=False))
    save_lens(a.lens, tmp_path / "a", dtype="float32")
    save_lens(b.lens, tmp_path / "b", dtype="float32")
    merged = merge_lenses([load_lens(tmp_path / "a"), load_lens(tmp_path / "b")])
    for layer in full.lens.J:
        assert torch.allclose(merged.J[layer], full.lens.J[layer], atol=1e-6)


def test_load_published_jlens_pt(llama, tmp_path):
    model, _ = llama
    d = model.d_model
    J = {0: torch.eye(d).half(), 1: (2 * torch.eye(d)).half()}
    torch.save({"J": J, "n_prompts": 7, "source_layers": [0, 1], "d_model": d}, tmp_path / "x_jacobian_lens.pt")
    lens = load_lens(tmp_path / "x_jacobian_lens.pt", model=model)
    assert lens.target_layer == model.n_layers - 1 and lens.n_prompts == 7 and lens.J[1][0, 0] == 2
    torch.save({"J": {0: torch.eye(8)}, "n_prompts": 1, "source_layers": [0], "d_model": 8}, tmp_path / "wrong_d.pt")
    with pytest.raises(LensError, match="d_model 8 != model d_model"):
        load_lens(tmp_path / "wrong_d.pt", model=model)
    many = {layer: torch.eye(d) for layer in range(6)}
    torch.save({"J": many, "n_prompts": 1, "source_layers": list(range(6)), "d_model": d}, tmp_path / "deep.pt")
    with pytest.raises(LensError, match="blocks"):
        load_lens(tmp_path / "deep.pt", model=model)
    torch.save({"weights": 1}, tmp_path / "junk.pt")
    with pytest.raises(LensError, match="jlens save layout"):
        load_lens(tmp_path / "junk.pt", model=model)


def _hidden(model, tok, text="Verdict: the claim is supported by the files here."):
    ids = encode_prompt(tok, text, max_length=32)[None]
    return ids, block_outputs(model, ids)


def test_lens_at_final_layer_equals_model_logits(tiny):
    model, tok = tiny
    ids, acts = _hidden(model, tok)
    with torch.no_grad():
        true = model.hf(input_ids=ids).logits[0]
    lens = Lens(J={layer: torch.randn(model.d_model, model.d_model) for layer in range(model.n_layers - 1)},
                meta={"target_layer": model.n_layers - 1})
    last = model.n_layers - 1
    for ro in (LogitLens(model), JacobianLens(model, lens)):
        z = ro.logits(last, acts[last][0])
        assert (z - true).abs().max().item() == 0.0
    # the subset path (only some token columns) agrees with the full readout
    sub = torch.tensor([3, 10, 42])
    assert torch.allclose(LogitLens(model).logits(last, acts[last][0], token_ids=sub), true[:, sub], atol=1e-5)


def test_identity_J_is_the_logit_lens(tiny):
    model, tok = tiny
    _, acts = _hidden(model, tok)
    eye = torch.eye(model.d_model)
    lens = Lens(J={layer: eye.clone() for layer in range(model.n_layers - 1)},
                meta={"target_layer": model.n_layers - 1})
    for layer in range(model.n_layers):
        ll = LogitLens(model).logits(layer, acts[layer][0])
        assert (j_lens_logits(model, acts[layer][0], eye) - ll).abs().max().item() == 0.0
        assert (JacobianLens(model, lens).logits(layer, acts[layer][0]) - ll).abs().max().item() == 0.0
    # and a non-identity J changes the readout below the target
    lens2 = Lens(J={layer: 2 * eye + 0.1 for layer in range(model.n_layers - 1)},
                 meta={"target_layer": model.n_layers - 1})
    assert not torch.allclose(JacobianLens(model, lens2).logits(0, acts[0][0]), LogitLens(model).logits(0, acts[0][0]))


def test_probe_out_of_fold_is_grouped():
    rng = np.random.default_rng(0)
    n, d = 60, 5
    y = np.repeat([0, 1, 2], 20)
    X = rng.normal(size=(n, d)) + np.eye(3, d)[y] * 3
    groups = np.arange(n) // 3  # 20 records
    Z = out_of_fold_logits(X, y, groups, n_splits=5)
    assert Z.shape == (n, 3) and np.isfinite(Z).all()
    assert (Z.argmax(1) == y).mean() > 0.8
    with pytest.raises(LensError):
        out_of_fold_logits(X, y, np.zeros(n), n_splits=5)


def _lens(model, layers, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return Lens(J={layer: torch.eye(model.d_model) + scale * torch.randn(model.d_model, model.d_model, generator=g)
                   / model.d_model for layer in layers}, meta={"target_layer": model.n_layers - 1, "sha256": "s"})


def test_the_registry_builds_what_the_lenses_allow(tiny):
    model, _ = tiny
    assert list(build_readouts(model, Lenses())) == ["logit"]
    lens = _lens(model, range(model.n_layers - 1))
    assert list(build_readouts(model, Lenses({"jacobian": lens}, control=False))) == ["logit", "jacobian"]
    d, below = model.d_model, range(model.n_layers - 1)
    tuned = TunedLens({layer: torch.zeros(d, d) for layer in below}, {layer: torch.zeros(d) for layer in below})
    ros = build_readouts(model, Lenses({"jacobian": lens, "jacobian_self": _lens(model, below, seed=1),
                                        "jacobian_future": _lens(model, below, seed=2), "tuned": tuned},
                                       control_seed=3))
    assert list(ros) == list(READOUTS) == ["logit", "jacobian", "jacobian_random", "jacobian_self", "jacobian_future",
                                           "tuned"]
    assert {name: type(ro) for name, ro in ros.items()} == {
        "logit": LogitLens, "jacobian": JacobianLens, "jacobian_random": RandomTransportLens,
        "jacobian_self": SelfLens, "jacobian_future": FutureLens, "tuned": TunedLensReadout}
    assert all(ro.name == name for name, ro in ros.items())
    # the control is the lens's random transport with the given seed
    assert torch.allclose(ros["jacobian_random"].lens.J[0], random_transport(lens, 3).J[0])
    # a self-only lens without the lens's layers is refused, naming what it lacks
    with pytest.raises(LensError, match=r"the self-only lens lacks layers \[1\]"):
        build_readouts(model, Lenses({"jacobian": lens, "jacobian_self": _lens(model, [0])}))


def test_transform_and_direction_are_the_lens_and_its_transpose(tiny):
    model, tok = tiny
    _, acts = _hidden(model, tok)
    lens = _lens(model, range(model.n_layers - 1))
    jl, ll = JacobianLens(model, lens), LogitLens(model)
    h = acts[0][0]
    assert torch.allclose(jl.transform(0, h), h @ lens.J[0].T, atol=1e-6)
    assert torch.equal(ll.transform(0, h), h) and torch.equal(jl.transform(model.n_layers - 1, h), h)
    u = torch.randn(model.d_model, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(jl.direction(0, u), lens.J[0].T @ u, atol=1e-6)
    assert torch.allclose(ll.direction(0, u), u) and torch.allclose(jl.direction(model.n_layers - 1, u), u)
    # u · J h = (Jᵀ u) · h for any h: the direction is what the readout's logit along u is linear in
    assert float(u @ jl.transform(0, h[0])) == pytest.approx(float(jl.direction(0, u) @ h[0]), rel=1e-5)
    with pytest.raises(LensError, match="no matrix for layer 1"):
        JacobianLens(model, _lens(model, [0])).transform(1, h)
