"""Issue 28 item 2: self-only and future-only J-lenses from random signs (science-4 review §2.5),
checked against the exact per-position Jacobian computed by brute force on a tiny Llama.

With `A[i, j] = ∂h_final[t_j]/∂h_l[t_i]` over the valid positions (zero for j < i), the exact terms
are `J_all = mean_i Σ_j A[i, j]` and `J_self = mean_i A[i, i]`. For one sign vector `s` the
estimator is exactly `mean_i Σ_j s_i s_j A[i, j]` (checked per draw), so its error is
`(1/n) Σ_{i<j} s_i s_j (A[i, j] + A[j, i])` and its mean squared Frobenius error is
`σ² = (1/n²) Σ_{i<j} ‖A[i, j] + A[j, i]‖²` (products of distinct sign pairs are uncorrelated);
the mean of R independent draws has `E‖err‖² = σ²/R`."""
from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from support.lens_baseline import pairwise_jacobians
from support.lens_toy import ByteTokenizer

from lens.corpus import encode_prompt
from lens.errors import LensError
from lens.fit import FitOptions, FitSettings, fit_lens
from lens.jacobian import prompt_jacobian, random_signs
from lens.positions import valid_position_mask

PROMPT = "The shop sold 42 crates of tea in May, and"
SKIP = 2


@pytest.fixture(scope="module")
def exact(llama):
    model, tok = llama
    ids = encode_prompt(tok, PROMPT, max_length=14)
    A = pairwise_jacobians(model, ids, 0, 2, SKIP).double()
    n = A.shape[0]
    j_all = A.sum(1).mean(0)
    j_self = torch.stack([A[i, i] for i in range(n)]).mean(0)
    sigma2 = sum(float((A[i, j] + A[j, i]).pow(2).sum()) for i in range(n) for j in range(i + 1, n)) / n**2
    return ids, A, j_all, j_self, sigma2


def _signs(T: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2, (T,), generator=torch.Generator().manual_seed(seed)).float() * 2 - 1


def test_all_is_unchanged_and_equals_the_exact_sum(llama, exact):
    model, _ = llama
    ids, _, j_all, _, _ = exact
    ours = prompt_jacobian(model, ids, source_layers=[0], target_layer=2, skip_first=SKIP, dim_batch=64)[0]
    assert torch.allclose(ours.double(), j_all, atol=1e-4, rtol=1e-4)


def test_one_draw_is_the_signed_double_sum(llama, exact):
    """Per draw, exactly `mean_i Σ_j s_i s_j A[i, j]`; `future` is `all − self` for the same signs."""
    model, _ = llama
    ids, A, j_all, _, _ = exact
    mask = valid_position_mask(len(ids), SKIP)
    for seed in range(3):
        s = _signs(len(ids), seed)
        sv = s[mask].double()
        expected = torch.einsum("i,j,ijab->ab", sv, sv, A) / A.shape[0]
        for method in ("replicate", "vmap"):
            got = prompt_jacobian(model, ids, source_layers=[0], target_layer=2, skip_first=SKIP, dim_batch=24,
                                  method=method, estimator="self", signs=s)[0]
            assert torch.allclose(got.double(), expected, atol=1e-4, rtol=1e-4), (seed, method)
        fut = prompt_jacobian(model, ids, source_layers=[0], target_layer=2, skip_first=SKIP, dim_batch=64,
                              estimator="future", signs=s)[0]
        assert torch.allclose(fut.double(), j_all - expected, atol=1e-4, rtol=1e-4)


def test_mean_over_draws_converges_to_the_exact_self_term(llama, exact):
    """The error of the mean of R draws shrinks like 1/√R: its square is checked against σ²/R.

    Tolerance: the mean over R = 96 draws of the per-draw squared error estimates σ². The per-draw
    squared error is heavy-tailed here (its sd is about 2.3× its mean on this model: a few adjacent
    position pairs dominate), so the mean of 96 has a relative standard error of about 0.23, and
    ±50 % is about two of them. The running mean's squared error must be within 3·σ²/R at R = 96
    (measured: 0.13·σ²/R) and below a quarter of the R = 6 error (expected ratio 1/16)."""
    model, _ = llama
    ids, _, _, j_self, sigma2 = exact
    draws = [prompt_jacobian(model, ids, source_layers=[0], target_layer=2, skip_first=SKIP, dim_batch=64,
                             estimator="self", signs=_signs(len(ids), 100 + r))[0].double() for r in range(96)]
    per_draw = torch.tensor([float((d - j_self).pow(2).sum()) for d in draws])
    assert 0.5 * sigma2 < float(per_draw.mean()) < 1.5 * sigma2
    err = {R: float((torch.stack(draws[:R]).mean(0) - j_self).pow(2).sum()) for R in (6, 96)}
    assert err[96] < 3 * sigma2 / 96
    assert err[96] < err[6] / 4
    # the self term is a real part of the whole: the exact future share is not small on this model
    assert sigma2 > 0 and float((j_self).norm()) > 0


def test_toy_without_cross_position_paths_has_no_future_term(toy):
    """A per-position model has A[i, j] = 0 for i != j: self = all for every sign draw, future = 0."""
    ids = torch.tensor(ByteTokenizer()("hello toy world, twenty bytes")["input_ids"])
    kw = dict(source_layers=[0, 2], target_layer=3, skip_first=4, dim_batch=3)
    j_all = prompt_jacobian(toy, ids, **kw)
    s = random_signs(len(ids), 0, "toy")
    assert torch.allclose(prompt_jacobian(toy, ids, estimator="self", signs=s, **kw), j_all, atol=1e-6)
    assert prompt_jacobian(toy, ids, estimator="future", signs=s, **kw).abs().max() < 1e-6


def test_signs_and_bad_input():
    a, b = random_signs(20, 0, "one prompt"), random_signs(20, 0, "another prompt")
    assert set(a.tolist()) <= {-1.0, 1.0} and torch.equal(a, random_signs(20, 0, "one prompt"))
    assert not torch.equal(a, b) and not torch.equal(a, random_signs(20, 1, "one prompt"))


def test_fit_records_the_estimator_and_refuses_another_on_resume(llama, fit_prompts, tmp_path):
    model, tok = llama
    st = FitSettings(skip_first=4, max_length=24, dim_batch=64, source_layers=[0, 1], estimator="self", sign_seed=3)
    res = fit_lens(model, tok, fit_prompts[:2], st, out_dir=tmp_path, options=FitOptions(progress=False))
    assert res.lens.meta.estimator == "self" and res.lens.meta.sign_seed == 3
    # the fit is the mean of the per-prompt signed estimates with each prompt's own signs
    per = []
    for p in fit_prompts[:2]:
        ids = encode_prompt(tok, p, max_length=24)
        per.append(prompt_jacobian(model, ids, source_layers=[0, 1], target_layer=2, skip_first=4,
                                   estimator="self", signs=random_signs(len(ids), 3, p)))
    assert torch.allclose(res.lens.J[0], (per[0][0] + per[1][0]) / 2, atol=1e-5)
    for other in (FitSettings(**{**st.__dict__, "estimator": "all"}), FitSettings(**{**st.__dict__, "sign_seed": 4})):
        with pytest.raises(LensError, match="cannot resume with different settings"):
            fit_lens(model, tok, fit_prompts[:2], other, out_dir=tmp_path, options=FitOptions(progress=False))
    with pytest.raises(LensError, match="needs signs"):
        prompt_jacobian(model, encode_prompt(tok, PROMPT, max_length=14), source_layers=[0], target_layer=2,
                        skip_first=SKIP, estimator="self")
    with pytest.raises(ValidationError, match="estimator"):  # refused by the settings, before any fit
        FitSettings(skip_first=4, max_length=24, estimator="both")  # type: ignore[arg-type]
