"""The lens fit's host-side sums overlap the next prompt's work (issue 30, B7): on CUDA each
estimate is added to the fp32 running sums in a worker thread while the GPU computes the next
prompt. Here the same path is forced on CPU (`FitOptions.overlap_sums`): the sums, the history and
the early stop equal the serial fit's exactly, and the addition of prompt i runs while prompt i+1
is being computed."""
from __future__ import annotations

import json
import threading
import time

import torch
from support.lens_toy import ByteTokenizer

import lens.accumulate as acc_mod
import lens.fit as fit_mod
from lens.fit import FitOptions, FitSettings, fit_lens

SETTINGS = FitSettings(target_layer=-1, skip_first=4, max_length=32, dim_batch=16)


def _fit(model, tok, prompts, overlap, **opts):
    return fit_lens(model, tok, prompts, SETTINGS, options=FitOptions(progress=False, overlap_sums=overlap, **opts))


def test_overlapped_sums_equal_the_serial_ones(llama, fit_prompts, toy, tmp_path):
    model, tok = llama
    prompts = fit_prompts[:3] + ["tiny"] + fit_prompts[3:6]  # "tiny" is skipped (too short)
    serial, overlapped = _fit(model, tok, prompts, False), _fit(model, tok, prompts, True)
    for layer in serial.lens.J:
        assert torch.equal(serial.lens.J[layer], overlapped.lens.J[layer])  # same additions, same order
    same_seconds = [{**h, "seconds": o["seconds"]} for h, o in zip(serial.history, overlapped.history, strict=True)]
    assert json.dumps(overlapped.history) == json.dumps(same_seconds)  # NaN Δ of the first prompt included
    assert overlapped.report["split_half_rel_diff"] == serial.report["split_half_rel_diff"]
    # the early stop falls on the same prompt: the one computed after it was due is dropped
    toy_prompts = [f"prompt number {i} for the toy" for i in range(30)]
    s = fit_lens(toy, ByteTokenizer(), toy_prompts, FitSettings(skip_first=4, max_length=40),
                 options=FitOptions(progress=False, stop_at_delta=1e-3, min_prompts=12, overlap_sums=False))
    o = fit_lens(toy, ByteTokenizer(), toy_prompts, FitSettings(skip_first=4, max_length=40), out_dir=tmp_path,
                 options=FitOptions(progress=False, stop_at_delta=1e-3, min_prompts=12, overlap_sums=True))
    assert s.report["stopped_early"] and o.report["stopped_early"] and s.lens.n_prompts == o.lens.n_prompts == 12
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert saved["next_idx"] == 12 and saved["n_a"] + saved["n_b"] == 12  # resumes at the prompt it dropped


def test_adding_a_prompt_overlaps_computing_the_next(toy, monkeypatch):
    """Each step is slowed to 0.2 s (a spy around the real functions): with the overlap, adding prompt
    i happens while prompt i+1 is computed, in another thread; serially they never overlap."""
    spans: dict[str, list[tuple[float, float, str]]] = {"compute": [], "add": []}
    real_jacobian, real_add = fit_mod.prompt_jacobian, acc_mod._accumulate

    def timed(kind, fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            time.sleep(0.2)
            spans[kind].append((t0, time.perf_counter(), threading.current_thread().name))
            return out
        return run

    monkeypatch.setattr(fit_mod, "prompt_jacobian", timed("compute", real_jacobian))
    monkeypatch.setattr(acc_mod, "_accumulate", timed("add", real_add))
    prompts = [f"prompt number {i} for the toy" for i in range(5)]
    settings = FitSettings(skip_first=4, max_length=40)

    def overlaps() -> int:
        c, a = spans["compute"], spans["add"]
        return sum(1 for i in range(len(a) - 1) if a[i][0] < c[i + 1][1] and c[i + 1][0] < a[i][1])

    fit_lens(toy, ByteTokenizer(), prompts, settings, options=FitOptions(progress=False, overlap_sums=True))
    assert len(spans["add"]) == 5 and overlaps() == 4
    assert {name for *_, name in spans["add"]} == {"lens-sums_0"}
    spans["compute"].clear()
    spans["add"].clear()
    fit_lens(toy, ByteTokenizer(), prompts, settings, options=FitOptions(progress=False, overlap_sums=False))
    assert len(spans["add"]) == 5 and overlaps() == 0
