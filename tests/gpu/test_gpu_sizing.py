"""What the device check reads from the GPU it lands on (issue 38, item 1): the bandwidth bound
comes from the GPU's name, and the 8B lens test's dim batches from its memory, so an H100 is
neither measured against an H200's bandwidth nor asked for a 94 GiB plan on 79 GiB."""
from __future__ import annotations

import json

from gpu_support import LLAMA_8B, bandwidth_of, lens_dim_batches

from lens.plan import ModelShape, plan_fit


def test_the_bandwidth_bound_comes_from_the_gpus_name():
    assert bandwidth_of("NVIDIA H100 80GB HBM3") == 3.35e12
    assert bandwidth_of("NVIDIA H200") == 4.8e12
    assert bandwidth_of("NVIDIA H100 PCIe") == 2.0e12
    assert bandwidth_of("NVIDIA H100 NVL") == 3.9e12
    assert bandwidth_of("NVIDIA A10G") is None  # unknown: the test falls back to the measured copy rate


def test_the_8b_lens_batches_fit_the_gpus_memory():
    shape = ModelShape.parse(json.loads(LLAMA_8B.read_text()))
    sources, target = list(range(31)), 31
    h100, h200 = int(79.2 * 2**30), int(139.8 * 2**30)  # what torch reports for each
    assert lens_dim_batches(shape, h100, sources, target, 128) == [64]
    assert lens_dim_batches(shape, h200, sources, target, 128) == [64, 128]
    # the plans behind those answers: 128 needs more than the H100's headroom, 64 does not
    peak = {b: plan_fit(shape, dtype="bfloat16", attn="sdpa", sources=sources, target=target, tokens=128,
                        dim_batch=b).peak for b in (64, 128)}
    assert 0.9 * h100 < peak[128] < 0.9 * h200 and peak[64] < 0.9 * h100, peak
    # a GPU too small for 64: the planner's own largest fitting batch, not a plan that cannot run
    small = lens_dim_batches(shape, 40 * 2**30, sources, target, 128)
    assert len(small) == 1 and small[0] < 64
