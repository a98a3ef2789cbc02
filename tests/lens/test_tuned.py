"""The tuned lens (`lens.tuned`, `lhd lens tune`), the J-lens release's third baseline: its training finds a
translator where an exact one exists, its readout is what the model's own norm and lm_head read from the
translated residual, its folder reads back only as written, and `lhd lens eval --tuned-lens` scores it beside
the lens (pass@k with paired differences; its training texts left out of the held-out KL)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from support.lens_toy import ByteTokenizer, ToyResidualModel
from typer.testing import CliRunner

from lens.errors import LensError
from lens.model import block_outputs
from lens.readout import Lenses, TunedLensReadout, build_readouts
from lens.store import Lens
from lens.tuned import (
    CHECKPOINT,
    SIDECAR,
    WEIGHTS,
    TunedLens,
    TuneOptions,
    TuneSettings,
    fit_tuned_lens,
    load_tuned_lens,
    save_tuned_lens,
)
from lhd_train.cli.lens import app

runner = CliRunner()
TEXTS = [f"Report {i}: the region sold {i * 13 % 97} units at {i % 7}.{i % 10} each; churn was {i * 3 % 40} percent, "
         f"and the manager asked for the numbers again on day {i}." for i in range(24)]


def test_training_finds_the_translator_of_a_linear_model():
    """The toy's blocks are linear per position, so `h_last = M_l h_l` exactly and a translator with KL 0
    exists; trained from zero (the logit lens), the held-back KL must fall below 1 % of the logit
    lens's at every layer."""
    model = ToyResidualModel(d=8, n_layers=4, scale=0.6, seed=3)
    lens = fit_tuned_lens(model, ByteTokenizer(), TEXTS, TuneSettings(
        layers=[0, 1, 2], max_length=64, skip_first=4, steps=300, batch_tokens=128, lr=3e-2, val_prompts=4,
        progress=False))
    before, after = lens.meta.kl_val_before, lens.meta.kl_val_after
    assert set(after) == {"0", "1", "2"} and lens.meta.n_prompts == 20 and lens.meta.n_val_prompts == 4
    for layer in after:
        assert before[layer] > 0.05, before  # the logit lens is far from the model here
        assert after[layer] < 0.01 * before[layer], (layer, before[layer], after[layer])  # measured: 0.0002-0.0003
    assert before["0"] > before["2"]  # the earliest layer has the most to translate
    # the model's own weights are untouched and get no gradient
    assert all(p.grad is None and not p.requires_grad for p in model.parameters())


def test_readout_reads_the_translated_residual(llama):
    model, _ = llama
    d, g = model.d_model, torch.Generator().manual_seed(0)
    A = {0: 0.1 * torch.randn(d, d, generator=g)}
    b = {0: 0.1 * torch.randn(d, generator=g)}
    tuned = TunedLens(A, b)
    ro = build_readouts(model, Lenses({"tuned": tuned}))["tuned"]
    assert isinstance(ro, TunedLensReadout) and ro.has_layer(0) and ro.has_layer(model.n_layers - 1)
    acts = block_outputs(model, torch.tensor([[1, 5, 9, 4]]))
    h = acts[0][0]
    hf = model.hf
    with torch.no_grad():
        hand = hf.lm_head(hf.model.norm(h + h @ A[0].T + b[0])).float()
        assert torch.allclose(ro.logits(0, h).float(), hand, atol=1e-4)
        last = model.n_layers - 1
        assert torch.allclose(ro.logits(last, acts[last][0]).float(), hf.lm_head(hf.model.norm(acts[last][0])).float())
    u = torch.randn(d, generator=g)
    assert torch.allclose(ro.direction(0, u), u + A[0].T @ u, atol=1e-5)  # the adjoint of the linear part
    # read beside a lens, it must cover the lens's layers
    lens = Lens(J={0: torch.eye(d), 1: torch.eye(d)}, meta={"target_layer": model.n_layers - 1})
    with pytest.raises(LensError, match=r"lacks layers \[1\]"):
        build_readouts(model, Lenses({"jacobian": lens, "tuned": tuned}))


def test_saved_folder_reads_back_and_refuses_what_it_did_not_write(tmp_path):
    model = ToyResidualModel(d=8, n_layers=3, seed=1)
    lens = fit_tuned_lens(model, ByteTokenizer(), TEXTS[:6], TuneSettings(
        layers=[0, 1], max_length=32, skip_first=2, steps=5, val_prompts=2, progress=False),
        meta={"corpus": {"path": "x.txt"}})
    out = save_tuned_lens(lens, tmp_path / "t")
    back = load_tuned_lens(out, model=model)
    assert back.layers == [0, 1] and back.meta.corpus == {"path": "x.txt"} and back.meta.n_tokens == lens.meta.n_tokens
    assert all(torch.equal(back.A[k], lens.A[k]) and torch.equal(back.b[k], lens.b[k]) for k in (0, 1))
    with pytest.raises(LensError, match="d_model 8 and 3 blocks"):
        load_tuned_lens(out, model=ToyResidualModel(d=4, n_layers=3))
    side = json.loads((out / SIDECAR).read_text())
    (out / SIDECAR).write_text(json.dumps({**side, "layers": "0,1"}))
    with pytest.raises(LensError, match=f"{SIDECAR}.*'layers'"):
        load_tuned_lens(out)
    (out / SIDECAR).write_text(json.dumps(side))
    data = bytearray((out / WEIGHTS).read_bytes())
    data[-1] ^= 1
    (out / WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(LensError, match="sha256"):
        load_tuned_lens(out)
    with pytest.raises(LensError, match="lhd lens tune"):
        load_tuned_lens(tmp_path)


def test_cli_tune_then_eval_beside_the_lens(tiny_dirs, tmp_path):
    model = tiny_dirs["llama"]
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(TEXTS[:8]))
    common = ["--device", "cpu", "--threads", "1", "--no-progress", "--max-length", "32", "--skip-first", "4"]
    r = runner.invoke(app, ["fit", str(model), "--corpus", str(corpus), "--out", str(tmp_path / "L"), "--n-prompts",
                            "2", "--source-layers", "0", "--save-dtype", "float32", "--dim-batch", "64", *common])
    assert r.exit_code == 0, r.output
    bad = runner.invoke(app, ["tune", str(model), "--corpus", str(corpus), "--out", str(tmp_path / "T"),
                              "--n-prompts", "4", "--val-prompts", "4"])
    assert bad.exit_code == 2 and "--val-prompts': 4 leaves no prompt" in bad.output
    r = runner.invoke(app, ["tune", str(model), "--corpus", str(corpus), "--out", str(tmp_path / "T"), "--n-prompts",
                            "4", "--val-prompts", "1", "--layers", "0", "--steps", "20", *common])
    assert r.exit_code == 0, r.output
    assert "held-back KL, logit lens -> tuned: 0:" in r.output
    mine = tmp_path / "lens-eval-mine.json"
    mine.write_text(json.dumps({"items": [
        {"name": "a", "prompt": "The shop sold many boxes of", "intermediates": ["tea"]},
        {"name": "b", "prompt": "The manager asked for the", "intermediates": ["numbers", "report"]}]}))
    out = tmp_path / "ev"
    r = runner.invoke(app, ["eval", str(model), "--readout", f"jacobian={tmp_path / 'L'}",
                            "--readout", f"tuned={tmp_path / 'T'}",
                            "--prompt-set", str(mine), "--corpus", str(corpus), "--out", str(out), "--device", "cpu",
                            "--threads", "1", "--no-progress", "--bootstrap", "20", "--no-causal"])
    assert r.exit_code == 0, r.output
    passk = json.loads((out / "passk.json").read_text())["mine"]
    assert "tuned" in passk["auc"] and {"tuned - logit", "tuned - jacobian"} <= set(passk["auc_diff"])
    ranks = [json.loads(x) for x in (out / "passk_ranks.jsonl").read_text().splitlines()]
    assert {x["readout"] for x in ranks if x["readout"] == "tuned"} and "| tuned |" in (out / "quality.md").read_text()
    sha = json.loads((tmp_path / "T" / SIDECAR).read_text())["sha256"]
    assert f"- tuned_lens: {sha}" in (out / "quality.md").read_text()  # the tuned lens read, named by its checksum
    res = json.loads((out / "eval.json").read_text())
    # the lens's 2 fit texts and the tuned lens's 4 (trained and held back) are all left out of the held-out KL
    assert res["fit_texts_excluded"] == 4 and res["n_texts"] == 4
    assert any(k.startswith("kl_tuned") for k in res["layers"][0])


def _same_translators(a: TunedLens, b: TunedLens) -> bool:
    return a.layers == b.layers and all(torch.equal(a.A[k], b.A[k]) and torch.equal(a.b[k], b.b[k]) for k in a.layers)


def test_a_stopped_training_resumes_to_the_translators_of_one_that_never_stopped(tmp_path):
    """Translators, Adam's moments, the schedule and the draw generator all come back from the checkpoint: the
    resumed run ends bit-equal to the uninterrupted one; a checkpoint of other settings, or a torn one, is refused
    with the way out, and --no-resume starts again."""
    model = ToyResidualModel(d=8, n_layers=4, scale=0.6, seed=3)
    s = TuneSettings(layers=[0, 2], max_length=48, skip_first=4, steps=40, batch_tokens=64, lr=3e-2, val_prompts=2,
                     progress=False)
    whole = fit_tuned_lens(model, ByteTokenizer(), TEXTS[:10], s)
    assert whole.meta.training["complete"] and whole.meta.training["resumed_at"] is None
    out = tmp_path / "t"
    out.mkdir()
    part = fit_tuned_lens(model, ByteTokenizer(), TEXTS[:10], s, out_dir=out,
                          options=TuneOptions(stop_after=13, checkpoint_minutes=0))
    assert not part.meta.training["complete"] and part.meta.training["steps_done"] == 13
    assert (out / CHECKPOINT).is_file() and not _same_translators(part, whole)
    rest = fit_tuned_lens(model, ByteTokenizer(), TEXTS[:10], s, out_dir=out)
    assert rest.meta.training["complete"] and rest.meta.training["resumed_at"] == 13
    assert _same_translators(rest, whole)
    assert rest.meta.training["history"] == whole.meta.training["history"]
    assert rest.meta.kl_val_after == whole.meta.kl_val_after
    # another learning rate would mix two trainings in one lens
    with pytest.raises(LensError, match=r"cannot resume with different settings \(lr: checkpoint 0.03 vs now 0.01\)"):
        fit_tuned_lens(model, ByteTokenizer(), TEXTS[:10], TuneSettings(**{**vars(s), "lr": 1e-2}), out_dir=out)
    with pytest.raises(LensError, match="cannot resume with different settings.*prompts_sha256"):
        fit_tuned_lens(model, ByteTokenizer(), TEXTS[1:11], s, out_dir=out)
    fresh = fit_tuned_lens(model, ByteTokenizer(), TEXTS[:10], s, out_dir=out, options=TuneOptions(resume=False))
    assert fresh.meta.training["resumed_at"] is None and _same_translators(fresh, whole)
    (out / CHECKPOINT).write_bytes((out / CHECKPOINT).read_bytes()[:100])
    with pytest.raises(LensError, match="not a readable tuned-lens training checkpoint.*--no-resume"):
        fit_tuned_lens(model, ByteTokenizer(), TEXTS[:10], s, out_dir=out)


@pytest.mark.model  # `lhd lens tune` in a subprocess, killed and resumed
def test_cli_tune_killed_mid_training_resumes_and_ends_as_an_unbroken_run(tiny_dirs, tmp_path):
    """A real `lhd lens tune` process, checkpointing about every step, is SIGKILLed mid-training; the rerun says
    where it resumed, ends with the translators of an uninterrupted run and removes its checkpoint."""
    model = tiny_dirs["llama"]
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(TEXTS[:8]))
    args = ["--corpus", str(corpus), "--n-prompts", "4", "--val-prompts", "1", "--layers", "0,1", "--steps", "4000",
            "--batch-tokens", "16", "--device", "cpu", "--threads", "1", "--no-progress", "--max-length", "24",
            "--skip-first", "4"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "lhd_train.cli", "lens", "tune", str(model), "--out", str(killed),
                             *args, "--checkpoint-minutes", "0.0005"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 180
    while not (killed / CHECKPOINT).exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    output = proc.communicate()[0]
    assert proc.returncode == -signal.SIGKILL, f"it ended before the kill (rc {proc.returncode}): {output[-2000:]}"
    assert (killed / CHECKPOINT).exists() and not (killed / WEIGHTS).exists()
    r = runner.invoke(app, ["tune", str(model), "--out", str(killed), *args])
    assert r.exit_code == 0, r.output
    assert "(resumed at step " in r.output and not (killed / CHECKPOINT).exists()
    r = runner.invoke(app, ["tune", str(model), "--out", str(tmp_path / "whole"), *args])
    assert r.exit_code == 0 and "resumed" not in r.output, r.output
    a, b = load_tuned_lens(killed), load_tuned_lens(tmp_path / "whole")
    assert _same_translators(a, b) and a.meta.training["resumed_at"] > 0
