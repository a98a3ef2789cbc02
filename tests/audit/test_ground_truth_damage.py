"""Issue 40 item 2: damaged ground truth is refused.

`ground_truth.jsonl` is written whole and atomically, so a torn line or a lost last line is damage.
Before, `lhd audit-eval --planted` skipped a torn last line and trusted a short file: it exited 0,
evaluated fewer plants, and counted a lost plant as an unplanted round, out of the FNR's
denominator. Here a real planted copy is damaged on disk and the real command must refuse it in
one line naming the file, leaving every byte as it was and writing no evaluation."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_audit_eval import auditor_yaml, make_pack_run, tree_bytes
from test_failure_modes import cli, one_error

from lhd_train.audit.ground_truth import GROUND_TRUTH, PLANT_INFO


@pytest.fixture(scope="module")
def planted_source(tmp_path_factory) -> Path:
    """A planted copy of a scripted run (made once; each test damages its own copy)."""
    from lhd_train.audit.plant import plant_run

    base = tmp_path_factory.mktemp("planted")
    run = make_pack_run(base, seeds=(21, 22))
    plant_run(run, base / "planted", seed=2, rate=0.6, max_per_trial=None)
    lines = (base / "planted" / GROUND_TRUTH).read_bytes().splitlines(keepends=True)
    assert len(lines) >= 2  # something to lose
    assert len(lines) == sum(json.loads((base / "planted" / PLANT_INFO).read_text())["planted"].values())
    return base / "planted"


def _torn(data: bytes) -> bytes:
    return data[:-20]  # the last line cut mid-row: no newline, not JSON


def _lost_last_line(data: bytes) -> bytes:
    lines = data.splitlines(keepends=True)
    return b"".join(lines[:-1])  # every kept line whole: only the count shows the loss


def _torn_but_parses(data: bytes) -> bytes:
    return data[:-1]  # only the final newline gone: the row still parses


@pytest.mark.parametrize("damage", [_torn, _lost_last_line, _torn_but_parses], ids=lambda f: f.__name__[1:])
def test_audit_eval_refuses_damaged_ground_truth(damage, planted_source, tmp_path, monkeypatch, capsys,
                                                 tiny_llama_dir):
    import shutil

    planted = tmp_path / "planted"
    shutil.copytree(planted_source, planted)
    truth = planted / GROUND_TRUTH
    truth.write_bytes(damage(truth.read_bytes()))
    before = tree_bytes(planted)
    cfg = auditor_yaml(tmp_path, tiny_llama_dir, 16)
    line = one_error(*cli(monkeypatch, capsys, "audit-eval", "--planted", str(planted), "--auditor", str(cfg),
                          "--mode", "task", "--no-progress"), str(truth))
    assert "plant the copy again" in line
    assert tree_bytes(planted) == before  # nothing audited, nothing evaluated, the damage kept as found
    assert not (planted / "eval").exists()


def test_planted_labels_without_plant_json_are_refused(planted_source, tmp_path, monkeypatch, capsys,
                                                       tiny_llama_dir):
    import shutil

    planted = tmp_path / "planted"
    shutil.copytree(planted_source, planted)
    (planted / PLANT_INFO).unlink()
    cfg = auditor_yaml(tmp_path, tiny_llama_dir, 16)
    one_error(*cli(monkeypatch, capsys, "audit-eval", "--planted", str(planted), "--auditor", str(cfg),
                   "--mode", "task", "--no-progress"), str(planted / PLANT_INFO))
    assert not (planted / "eval").exists()
