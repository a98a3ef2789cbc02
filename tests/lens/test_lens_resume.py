"""Issue 22 item 1 for the lens: `lhd lens fit` resuming a checkpoint refuses other model files at
the same path, and `lhd lens merge` refuses a lens given twice or shards that overlap."""
from __future__ import annotations

import shutil

import pytest
import torch
from typer.testing import CliRunner

from lens.errors import LensError
from lens.store import Lens, merge_lenses
from lhd_train.cli.lens import app

runner = CliRunner()


def _corpus(path, n=3):
    path.write_text("\n\n".join(f"Paragraph {i}: the quarterly report lists {i * 11} units sold in region {i} and "
                                f"notes that the numbers were checked twice by the finance team." for i in range(n)))
    return path


def _fit(model, corpus, out, *extra):
    return runner.invoke(app, ["fit", str(model), "--corpus", str(corpus), "--out", str(out), "--device", "cpu",
                               "--max-length", "24", "--skip-first", "4", "--source-layers", "0",
                               "--no-progress", "--threads", "1", "--save-dtype", "float32", *extra])


def test_fit_resume_refuses_changed_weights(tiny_dirs, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_dirs["llama"], model)
    corpus = _corpus(tmp_path / "c.txt")
    out = tmp_path / "L"
    res = _fit(model, corpus, out)
    assert res.exit_code == 0, res.output
    assert _fit(model, corpus, out).exit_code == 0  # same files: resumes (nothing left to do)
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one weight changed in place, config and path unchanged
    weights.write_bytes(bytes(data))
    res = _fit(model, corpus, out)
    assert res.exit_code != 0 and "the model's weights changed since this checkpoint" in res.output, res.output
    assert "Traceback" not in res.output
    assert _fit(model, corpus, out, "--no-resume").exit_code == 0


def _lens(value, n, sl, fingerprint="abc"):
    return Lens(J={0: torch.full((4, 4), float(value))},
                meta={"n_prompts": n, "sha256": f"sha-{value}-{sl}",
                      "corpus": {"path": "c.txt", "fingerprint": fingerprint, "n_prompts": 100, "slice": list(sl)}})


def test_merge_refuses_the_same_lens_twice(tiny_dirs, tmp_path):
    a, b = _lens(1.0, 2, (0, 2)), _lens(2.0, 3, (2, 5))
    assert merge_lenses([a, b]).n_prompts == 5
    with pytest.raises(LensError, match="lens 1 is lens 0 again"):
        merge_lenses([a, a])
    with pytest.raises(LensError, match=r"overlaps lens 0 \(prompts 0..1\)"):
        merge_lenses([a, _lens(3.0, 2, (1, 3))])
    assert merge_lenses([a, _lens(3.0, 2, (1, 3), fingerprint="another corpus")]).n_prompts == 4
    # through the CLI, on a real fitted lens: `lhd lens merge OUT L L`
    corpus = _corpus(tmp_path / "c.txt")
    assert _fit(tiny_dirs["llama"], corpus, tmp_path / "L").exit_code == 0
    res = runner.invoke(app, ["merge", str(tmp_path / "M"), str(tmp_path / "L"), str(tmp_path / "L")])
    assert res.exit_code != 0 and "given twice" in res.output and not (tmp_path / "M").exists(), res.output
    shutil.copytree(tmp_path / "L", tmp_path / "L2")  # the same lens under another name
    res = runner.invoke(app, ["merge", str(tmp_path / "M"), str(tmp_path / "L"), str(tmp_path / "L2")])
    assert res.exit_code != 0 and "lens 1 is lens 0 again" in res.output, res.output
