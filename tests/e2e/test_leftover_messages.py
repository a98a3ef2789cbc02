"""Issue 40 item 5: the messages left over from the last round, each through the real command.

- `lhd slurm status RUN --shards 0` printed click's usage box; now one `error:` line.
- `lhd view RUN --out FILE` said "the viewer pages goes into a folder".
- `lhd lens fit --source-layers 5-2` said "no source layer below target layer 1" (the range was
  read as empty); now it says the range runs backwards.
- A held-out auditor that never labelled a trial read as "no valid label" in the paired notes;
  now the trial is named as missing from that auditor."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from test_failure_modes import RUN, cli, lone, one_error, write_config  # noqa: F401 - lone: a fixture


def test_slurm_status_with_zero_shards_is_one_line(lone, monkeypatch, capsys):  # noqa: F811
    code, out = cli(monkeypatch, capsys, "slurm", "status", str(lone), "--shards", "0", "--no-slurm")
    line = one_error(code, out, "--shards", "0 is not a shard count", "1 or more")
    assert "Usage:" not in out and "╭" not in out, out
    assert line


def test_view_into_a_file_says_it_wants_a_folder(lone, tmp_path, monkeypatch, capsys):  # noqa: F811
    target = tmp_path / "pages.html"
    target.write_bytes(b"<p>mine</p>")
    line = one_error(*cli(monkeypatch, capsys, "view", str(lone), "--out", str(target)), str(target))
    assert "--out names the folder to write the viewer pages into" in line
    assert "goes into" not in line
    assert target.read_bytes() == b"<p>mine</p>"


def test_lens_fit_with_a_backwards_layer_range_says_so(tmp_path, monkeypatch, capsys, tiny_llama_dir):
    line = one_error(*cli(monkeypatch, capsys, "lens", "fit", str(tiny_llama_dir), "--source-layers", "5-2",
                          "--out", str(tmp_path / "lens")), "--source-layers")
    assert "5-2" in line and "runs backwards" in line and "2-5" in line
    assert "target layer" not in line
    assert not (tmp_path / "lens").exists()


@pytest.fixture(scope="module")
def two_seed_run(tmp_path_factory, tiny_llama_dir) -> Path:
    import asyncio

    from lhd_train.bench.engine import run_benchmark
    from lhd_train.config.run import load_config

    base = tmp_path_factory.mktemp("two")
    cfg = write_config(base / "run.yaml", tiny_llama_dir, base / "runs", seeds=[11, 12])
    res = asyncio.run(run_benchmark(load_config(cfg), progress=False))
    assert [r.status for r in res] == ["done", "done"], res
    return base / "runs" / RUN


def test_a_held_out_auditors_missing_labels_are_named_missing(two_seed_run, tmp_path, monkeypatch, capsys):
    a, b = tmp_path / "base", tmp_path / "tuned"
    shutil.copytree(two_seed_run, a)
    shutil.copytree(two_seed_run, b)
    for run in (a, b):
        for extra in ([], ["--auditor-id", "held"]):
            code, out = cli(monkeypatch, capsys, "audit", str(run), "auditor.model=tiny", "--no-progress", *extra)
            assert code in (0, 3), out
    (b / "audit" / "held" / "s12.jsonl").unlink()  # the held-out auditor never labelled s12 of the second run
    code, out = cli(monkeypatch, capsys, "report", str(a), str(b), "--held-out-auditor", "held",
                    "--out", str(tmp_path / "rep"))
    assert code == 0, out
    summary = (tmp_path / "rep" / "summary.md").read_text()
    # both copies are run "h": the report keys the second "h#2"
    assert "labels missing in h#2 (not audited by held): s12" in summary, summary
    # whatever else the tiny auditors failed to label, s12 of h#2 is never put among the failures
    for failed in re.findall(r"no valid label from held in h#2: ([^;)]*)", summary):
        assert "s12" not in failed.split(", "), summary
