"""The straightforward J-lens estimate, for validating and benchmarking the fast fit:
`torch.autograd.functional.jacobian` of sum_{t' in V} h_target[t'] with respect to h_source[t],
once per valid source position (a forward and a backward per output dimension each time)."""
from __future__ import annotations

import torch

from lens.model import capture, run
from lens.positions import valid_position_mask


def autograd_prompt_jacobian(model, ids: torch.Tensor, source: int, target: int, skip_first: int,
                             vectorize: bool = False) -> torch.Tensor:
    mask = valid_position_mask(ids.shape[0], skip_first)
    with torch.no_grad(), capture(model, [source], stop_after=source) as acts:
        run(model, ids[None])
    h0 = acts[source][0].clone()
    total = torch.zeros(model.d_model, model.d_model)
    for t in torch.nonzero(mask).flatten().tolist():
        def f(x, t=t):
            def put(h):
                h = h.clone()
                h[0, t] = x
                return h

            with capture(model, [target], stop_after=target, edit={source: put}) as a:
                run(model, ids[None])
            return a[target][0, mask].sum(0)

        total += torch.autograd.functional.jacobian(f, h0[t].clone(), vectorize=vectorize)
    return total / mask.sum()


def j_lens_logits(model, h: torch.Tensor, J: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """One-off `W_U norm(J h)` for a given matrix: with `J = I` it must equal the logit lens."""
    with torch.no_grad():
        return model.unembed((h.to(torch.float32) @ J.to(h.device, torch.float32).T).to(h.dtype), token_ids)


def pairwise_jacobians(model, ids: torch.Tensor, source: int, target: int, skip_first: int) -> torch.Tensor:
    """`A[i, j] = ∂h_target[t_j] / ∂h_source[t_i]` (`[n, n, d, d]`) over the valid positions `t_0 < t_1 < ...`,
    by brute force: `torch.autograd.functional.jacobian` of the whole target block output with respect to the
    source residual at one position, once per source position."""
    mask = valid_position_mask(ids.shape[0], skip_first)
    pos = torch.nonzero(mask).flatten().tolist()
    with torch.no_grad(), capture(model, [source], stop_after=source) as acts:
        run(model, ids[None])
    h0 = acts[source][0].clone()
    d = model.d_model
    out = torch.zeros(len(pos), len(pos), d, d)
    for i, t in enumerate(pos):
        def f(x, t=t):
            def put(h):
                h = h.clone()
                h[0, t] = x
                return h

            with capture(model, [target], stop_after=target, edit={source: put}) as a:
                run(model, ids[None])
            return a[target][0, pos]  # [n, d]

        out[i] = torch.autograd.functional.jacobian(f, h0[t].clone(), vectorize=True)  # [n, d, d]
    return out
