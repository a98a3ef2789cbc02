"""One prompt's Jacobian-lens estimate, `C · J_l^(p)` (the fit loop is `lens.fit`).

With `A[t, t'] = ∂h_final[t']/∂h_l[t]` over valid positions `[skip_first, T-1)`, three estimators:
`all` (`mean_t Σ_t' A[t, t']`, the reference's), `self` (random signs on targets make it unbiased
for `mean_t A[t, t]` at the same cost) and `future` (`all − self`). One forward and
`ceil(k / dim_batch)` backward passes per sweep, cotangents replicated along the batch
(`method="replicate"`) or batched over one forward (`method="vmap"`); gradients averaged over source
positions in fp32. docs/lens.md, "What is computed" (the estimator, self-only and future-only)."""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from lens.errors import LensError
from lens.model import LensModel, capture, run
from lens.positions import valid_position_mask

ESTIMATORS = ("all", "self", "future")


def random_signs(n: int, seed: int, prompt: str) -> torch.Tensor:
    """`n` signs ±1 for one prompt of a fit seeded `seed`: drawn from the prompt's text, so a prompt has the
    same signs in any shard, on resume and on every machine (CPU generator), and two prompts' differ."""
    key = hashlib.sha256(f"{int(seed)}\0{prompt}".encode("utf-8", "surrogatepass")).digest()
    gen = torch.Generator(device="cpu").manual_seed(int.from_bytes(key[:8], "little") % (2**63))
    return torch.randint(0, 2, (n,), generator=gen).to(torch.float32) * 2 - 1


def prompt_jacobian(
    model: LensModel,
    input_ids: torch.Tensor,
    *,
    source_layers: Sequence[int],
    target_layer: int,
    skip_first: int,
    dim_batch: int = 64,
    directions: torch.Tensor | None = None,
    method: str = "replicate",
    estimator: str = "all",
    signs: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[n_sources, k, d]` fp32: `C · J_l^(p)` for each source layer (`C = I` unless `directions` is given).

    `signs` (`[T]`, ±1) are required for the `self` and `future` estimators (`random_signs`)."""
    ids = input_ids.reshape(-1).to(model.device)
    T = ids.shape[0]
    mask = valid_position_mask(T, skip_first, device=model.device)
    n_valid = int(mask.sum())
    d = model.d_model
    k = d if directions is None else int(directions.shape[0])
    if directions is not None and directions.shape[-1] != d:
        raise LensError(f"directions have width {directions.shape[-1]}, the model has d_model {d}")
    if method not in ("replicate", "vmap"):
        raise LensError(f"unknown method {method!r} (allowed: replicate, vmap)")
    if estimator not in ESTIMATORS:
        raise LensError(f"unknown estimator {estimator!r} (allowed: {', '.join(ESTIMATORS)})")
    if estimator != "all" and (signs is None or signs.shape != (T,)):
        raise LensError(f"estimator {estimator!r} needs signs of shape ({T},), got "
                        f"{None if signs is None else tuple(signs.shape)}")
    sources = list(source_layers)
    B = max(1, min(int(dim_batch), k))
    root = min(sources)
    maskf = mask.to(torch.float32)
    # per sweep: the weight of each target position in the cotangent, that of each source position in the mean
    sweeps: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    if estimator in ("all", "future"):
        sweeps.append(("all", maskf, maskf))
    if estimator in ("self", "future"):
        s = signs.to(model.device, torch.float32) * maskf  # type: ignore[union-attr]  # checked above
        sweeps.append(("self", s, s))
    out = {name: torch.empty(len(sources), k, d, dtype=torch.float32, device=model.device) for name, _, _ in sweeps}

    with torch.enable_grad(), capture(model, sources + [target_layer], root=root, stop_after=target_layer) as acts:
        batch = ids[None, :].expand(B, T) if method == "replicate" else ids[None, :]
        run(model, batch)
        target = acts[target_layer]
        inputs = [acts[layer] for layer in sources]
        dtype = target.dtype
        passes = [(name, tw, sw, start) for name, tw, sw in sweeps for start in range(0, k, B)]
        for n_pass, (name, target_w, source_w, start) in enumerate(passes):
            n = min(B, k - start)
            rows = torch.zeros(n, d, dtype=dtype, device=model.device)
            if directions is None:
                rows[torch.arange(n), torch.arange(start, start + n)] = 1
            else:
                rows.copy_(directions[start : start + n].to(dtype))
            cot = rows[:, None, :] * target_w.to(dtype)[None, :, None]  # [n, T, d], zero outside V
            last = n_pass == len(passes) - 1
            if method == "replicate":
                if n < B:
                    cot = torch.cat([cot, cot.new_zeros(B - n, T, d)])
                padded = torch.autograd.grad(target, inputs, cot, retain_graph=not last)
                grads = [g[:n] for g in padded]
            else:
                batched = torch.autograd.grad(target, inputs, cot[:, None], retain_graph=not last,
                                              is_grads_batched=True)
                grads = [g[:, 0] for g in batched]
            for i, g in enumerate(grads):
                out[name][i, start : start + n] = (g.float() * source_w[None, :, None]).sum(1) / n_valid
    if estimator == "future":
        return out["all"] - out["self"]
    return out[estimator]
