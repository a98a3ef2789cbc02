"""The random-transport control keeps each matrix's singular values and nothing else."""
from __future__ import annotations

import torch

from lens.controls import random_transport
from lens.store import Lens


def _lens() -> Lens:
    g = torch.Generator().manual_seed(3)
    J = {0: torch.eye(6) + 0.3 * torch.randn(6, 6, generator=g), 2: torch.randn(4, 6, generator=g)}
    return Lens(J, {"sha256": "abc", "target_layer": 3})


def test_same_singular_values_other_bases() -> None:
    lens = _lens()
    ctl = random_transport(lens, seed=1)
    for layer, J in lens.J.items():
        R = ctl.J[layer]
        assert R.shape == J.shape
        assert torch.allclose(torch.linalg.svdvals(R.double()), torch.linalg.svdvals(J.double()), atol=1e-5)
        # not the same map: the left singular vectors of R are not those of J
        assert (R - J).norm() > 0.1 * J.norm()
    assert ctl.meta.control == {"kind": "random_transport", "seed": 1, "of": "abc"}
    assert ctl.target_layer == 3 and ctl.meta.sha256 is None and "sha256" not in ctl.meta.to_json()


def test_seeded() -> None:
    lens = _lens()
    a, b, c = random_transport(lens, 5), random_transport(lens, 5), random_transport(lens, 6)
    assert all(torch.equal(a.J[k], b.J[k]) for k in a.J)
    assert not torch.allclose(a.J[0], c.J[0])


def test_orthogonal_factors_are_haar_like() -> None:
    # a random orthogonal map of the identity keeps every singular value at 1 but is not the identity
    lens = Lens({0: torch.eye(8)}, {})
    R = random_transport(lens, 0).J[0].double()
    assert torch.allclose(R @ R.T, torch.eye(8, dtype=torch.float64), atol=1e-6)
    assert (R - torch.eye(8)).norm() > 1.0
