"""Fitting: docs/lens-background.md §4 checks T1, T2, T3 (identity), T5, T6, T7, T9, T12, T13, T17
and a reference cross-check."""
from __future__ import annotations

import math

import pytest
import torch
from support.lens_baseline import autograd_prompt_jacobian
from support.lens_toy import ByteTokenizer

from lens.corpus import encode_prompt
from lens.directions import token_directions
from lens.errors import LensError
from lens.fit import FitOptions, FitSettings, fit_lens, prompt_jacobian, resolve_layers
from lens.model import capture, run
from lens.positions import valid_position_mask

PROMPT = "The report for region 3 lists 21 units sold at a price of 5.50 each, and demand was high."


def ids_for(tok, text=PROMPT, n=40):
    return encode_prompt(tok, text, max_length=n)


# T1 -------------------------------------------------------------------------------------------
def test_valid_position_mask():
    m = valid_position_mask(32, skip_first=4)
    assert m.sum() == 27 and not m[:4].any() and not m[31] and m[4:31].all()
    with pytest.raises(LensError, match="too short"):
        valid_position_mask(5, skip_first=4)
    assert valid_position_mask(6, skip_first=4).sum() == 1


# T2 -------------------------------------------------------------------------------------------
def test_toy_orientation_and_indexing(toy):
    tok = ByteTokenizer()
    ids = torch.tensor(tok("hello toy world, twenty bytes or more")["input_ids"])
    J = prompt_jacobian(toy, ids, source_layers=[0, 1, 2], target_layer=3, skip_first=4, dim_batch=3)
    W3 = toy.blocks[3]
    assert torch.allclose(J[2], torch.eye(8) + W3.scale * W3.W,
                          atol=1e-5)  # J_{L-2} = I + 0.1 W_{L-1}, not its transpose
    assert not torch.allclose(J[2], (torch.eye(8) + W3.scale * W3.W).T, atol=1e-3)
    for i, layer in enumerate([0, 1, 2]):
        assert torch.allclose(J[i], toy.exact_jacobian(layer, 3), atol=1e-5)
    eye = torch.eye(8)
    assert (J[0] - eye).norm() > (J[2] - eye).norm()


# T3 (identity at the target) ------------------------------------------------------------------
def test_identity_at_target(tiny):
    model, tok = tiny
    J = prompt_jacobian(model, ids_for(tok), source_layers=[2], target_layer=2, skip_first=4, dim_batch=64)
    assert torch.equal(J[0], torch.eye(model.d_model))


# reference cross-check: torch.autograd.functional.jacobian, one source position at a time -----


def test_matches_autograd_reference(llama):
    model, tok = llama
    ids = ids_for(tok, n=12)
    ours = prompt_jacobian(model, ids, source_layers=[0, 1], target_layer=2, skip_first=4, dim_batch=64)
    ref = autograd_prompt_jacobian(model, ids, 0, 2, 4, vectorize=True)
    assert torch.allclose(ours[0], ref, atol=1e-4, rtol=1e-4)


# T5 finite differences -------------------------------------------------------------------------
def fd_check(model, ids, J, layer, target, skip_first, eps=1e-2, seed=0):
    """rel. error of n_valid · J v against the central difference of sum_{t' in V} h_final[t']."""
    T = ids.shape[0]
    mask = valid_position_mask(T, skip_first)
    v = torch.randn(model.d_model, generator=torch.Generator().manual_seed(seed))
    v = v / v.norm()

    def final_sum(sign):
        def put(h):
            return h + sign * eps * v * mask[None, :, None].to(h.dtype)
        with torch.no_grad(), capture(model, [target], stop_after=target, edit={layer: put}) as a:
            run(model, ids[None])
        return a[target][0, mask].sum(0).double()

    fd = (final_sum(+1) - final_sum(-1)) / (2 * eps)
    pred = int(mask.sum()) * (J.double() @ v.double())
    return float((fd - pred).norm() / fd.norm())


def test_finite_difference(tiny):
    model, tok = tiny
    ids = ids_for(tok)
    J = prompt_jacobian(model, ids, source_layers=[0, 1], target_layer=2, skip_first=4, dim_batch=64)
    for i, layer in enumerate([0, 1]):
        assert fd_check(model, ids, J[i], layer, 2, 4) < 0.05
        assert fd_check(model, ids, J[i].T, layer, 2, 4) > 0.05  # the check can fail: transposed J
        assert fd_check(model, ids, torch.zeros_like(J[i]), layer, 2, 4) > 0.05  # ... and zero J


# T6 / T7 ---------------------------------------------------------------------------------------
def test_dim_batch_and_vmap_invariance(llama, toy):
    model, tok = llama
    ids = ids_for(tok, n=16)
    kw = dict(source_layers=[0, 1], target_layer=2, skip_first=4)
    ref = prompt_jacobian(model, ids, dim_batch=64, **kw)
    assert torch.allclose(prompt_jacobian(model, ids, dim_batch=5, **kw), ref, atol=1e-6)  # ragged last chunk
    assert torch.allclose(prompt_jacobian(model, ids, dim_batch=32, method="vmap", **kw), ref, atol=1e-6)
    tids = torch.tensor(ByteTokenizer()("dim batch one on the toy")["input_ids"])
    tkw = dict(source_layers=[0, 2], target_layer=3, skip_first=4)
    tref = prompt_jacobian(toy, tids, dim_batch=8, **tkw)
    for db in (1, 3):
        assert torch.allclose(prompt_jacobian(toy, tids, dim_batch=db, **tkw), tref, atol=1e-7)


def test_replicated_rows_are_identical(llama):
    """The estimator assumes the replicated forward gives bitwise identical rows (T16)."""
    model, tok = llama
    ids = ids_for(tok, n=24)
    with torch.no_grad(), capture(model, [2], stop_after=2) as acts:
        run(model, ids[None].expand(3, -1))
    assert torch.equal(acts[2][0], acts[2][1]) and torch.equal(acts[2][0], acts[2][2])


# T9 --------------------------------------------------------------------------------------------
def test_layer_handling():
    assert resolve_layers(4, None, -1) == ([0, 1, 2], 3)
    assert resolve_layers(4, None, -2) == ([0, 1], 2)
    assert resolve_layers(4, [-3, 0], -1) == ([0, 1], 3)
    with pytest.raises(LensError, match="out of range"):
        resolve_layers(4, [5], -1)
    with pytest.raises(LensError, match="out of range"):
        resolve_layers(4, None, 4)
    with pytest.raises(LensError, match="not below"):
        resolve_layers(4, [2, 3], -1)
    with pytest.raises(LensError, match="not below"):
        resolve_layers(4, [3], 2)
    assert resolve_layers(4, [3], -1, allow_target=True) == ([3], 3)


def test_shard_slices_are_disjoint_and_cover():
    """`lhd lens fit --shard` splits prompts with the run's shard splitter (lhd_train.rundir.shard)."""
    from lhd_train.errors import InputError
    from lhd_train.rundir.shard import shard_bounds

    parts = [shard_bounds(10, i, 3) for i in range(3)]
    assert parts == [(0, 3), (3, 6), (6, 10)]
    with pytest.raises(InputError):
        shard_bounds(10, 3, 3)


# fit loop: mean over prompts, short prompts skipped, resume (T12), convergence (T17) -------------
SETTINGS = FitSettings(target_layer=-1, skip_first=4, max_length=32, dim_batch=64)


def test_fit_is_mean_of_prompt_jacobians(llama, fit_prompts):
    model, tok = llama
    prompts = fit_prompts[:3] + ["short"]  # the last one is too short and skipped
    res = fit_lens(model, tok, prompts, SETTINGS, options=FitOptions(progress=False))
    per = [prompt_jacobian(model, encode_prompt(tok, p, max_length=32), source_layers=[0, 1], target_layer=2,
                           skip_first=4) for p in prompts[:3]]
    mean = sum(per) / 3
    assert res.lens.n_prompts == 3 and res.report["n_skipped"] == 1 and res.report["skipped_indices"] == [3]
    for i, layer in enumerate([0, 1]):
        assert torch.allclose(res.lens.J[layer], mean[i], atol=1e-6)
    r = res.report
    assert set(r["identity_distance"]) == {"0", "1"} and set(r["split_half_rel_diff"]) == {"0", "1"}
    assert r["identity_distance"]["1"] < r["identity_distance"]["0"]  # deeper layer is closer to I
    assert all(math.isfinite(h["delta_mean"]) for h in res.history[1:])


def test_resume_equals_uninterrupted(llama, fit_prompts, tmp_path):
    model, tok = llama
    prompts = fit_prompts[:2] + ["tiny"] + fit_prompts[2:4]
    full = fit_lens(model, tok, prompts, SETTINGS, options=FitOptions(progress=False))
    out = tmp_path / "ckpt"
    part = fit_lens(model, tok, prompts, SETTINGS, out_dir=out,
                    options=FitOptions(progress=False, checkpoint_every=1, stop_after=2))
    assert part.lens.n_prompts == 2 and (out / "checkpoint.pt").exists()
    resumed = fit_lens(model, tok, prompts, SETTINGS, out_dir=out, options=FitOptions(progress=False))
    assert resumed.lens.n_prompts == 4 == full.lens.n_prompts  # the skipped prompt is not double counted
    assert resumed.report["skipped_indices"] == [2]
    for layer in full.lens.J:
        assert torch.allclose(resumed.lens.J[layer], full.lens.J[layer], atol=1e-6)
    assert [h["prompt_index"] for h in resumed.history] == [0, 1, 3, 4]
    for bad in (FitSettings(target_layer=-2, skip_first=4, max_length=32),
                FitSettings(target_layer=-1, skip_first=3, max_length=32),
                FitSettings(target_layer=-1, source_layers=[1], skip_first=4, max_length=32)):
        with pytest.raises(LensError, match="cannot resume"):
            fit_lens(model, tok, prompts, bad, out_dir=out, options=FitOptions(progress=False))
    with pytest.raises(LensError, match="cannot resume"):
        fit_lens(model, tok, prompts[:-1], SETTINGS, out_dir=out, options=FitOptions(progress=False))
    # dim_batch is a speed knob only: resuming with another value is allowed
    fit_lens(model, tok, prompts, FitSettings(target_layer=-1, skip_first=4, max_length=32, dim_batch=8), out_dir=out,
             options=FitOptions(progress=False))


def test_convergence_bookkeeping(llama, fit_prompts, toy):
    """Δmean falls as prompts accumulate (T17); on the toy (input-independent J) every estimate is exact."""
    model, tok = llama
    res = fit_lens(model, tok, fit_prompts, FitSettings(skip_first=4, max_length=24, source_layers=[1]),
                   options=FitOptions(progress=False))
    d = [h["delta_mean"] for h in res.history[1:]]
    assert len(d) == 5 and d[-1] < d[0]
    assert res.report["n_half"] == [3, 3] and res.report["split_half_rel_diff"]["1"] > 0
    toy_res = fit_lens(toy, ByteTokenizer(), ["abcdefgh " * 3, "hgfedcba " * 3],
                       FitSettings(skip_first=4, max_length=40, force_bos=False), options=FitOptions(progress=False))
    for layer in (0, 1, 2):
        assert torch.allclose(toy_res.lens.J[layer], toy.exact_jacobian(layer, 3), atol=1e-5)
    assert toy_res.report["split_half_rel_diff"]["0"] < 1e-5


# T13 targeted directions ------------------------------------------------------------------------
def test_targeted_directions_equal_projected_full_J(llama, fit_prompts):
    model, tok = llama
    token_ids = [5, 17, 300]
    C = token_directions(model, token_ids)
    full = fit_lens(model, tok, fit_prompts[:2], SETTINGS, options=FitOptions(progress=False))
    targeted = fit_lens(model, tok, fit_prompts[:2],
                        FitSettings(target_layer=-1, skip_first=4, max_length=32, dim_batch=2),
                        options=FitOptions(progress=False), directions=C)
    for layer in (0, 1):
        assert targeted.lens.J[layer].shape == (3, model.d_model)
        assert torch.allclose(targeted.lens.J[layer], C @ full.lens.J[layer], rtol=1e-5, atol=1e-5)


def test_early_stop(toy):
    """With an input-independent Jacobian Δmean is ~0, so the fit stops once min_prompts are done."""
    prompts = [f"prompt number {i} for the toy" for i in range(30)]
    res = fit_lens(toy, ByteTokenizer(), prompts, FitSettings(skip_first=4, max_length=40),
                   options=FitOptions(progress=False, stop_at_delta=1e-3, min_prompts=12))
    assert res.report["stopped_early"] and res.lens.n_prompts == 12 and res.lens.meta.fit["complete"]


def test_checkpoint_names_the_prompts_by_their_digest(toy, tmp_path):
    """The checkpoint's `prompts_sha256` is sha256 over each prompt's UTF-8 bytes then a NUL (hashlib here): a
    checkpoint written by an earlier version resumes only if this stays the same."""
    import hashlib
    import json

    from lens.fit import CHECKPOINT

    prompts = [f"prompt number {i} for the toy, é" for i in range(3)]
    fit_lens(toy, ByteTokenizer(), prompts, FitSettings(skip_first=4, max_length=40), out_dir=tmp_path,
             options=FitOptions(progress=False, checkpoint_every=1))
    saved = json.loads(torch.load(tmp_path / CHECKPOINT, weights_only=True)["settings"])
    h = hashlib.sha256()
    for p in prompts:
        h.update(p.encode("utf-8") + b"\0")
    assert saved["prompts_sha256"] == h.hexdigest()
