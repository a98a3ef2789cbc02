"""Issue 22 item 1, no mixing on resume: a resume that would combine work done with different
inputs is refused in one line naming what changed, and the first run's provenance is kept.

Model folders are real tiny models (`lhd_train.tiny_model`); the auditor's answers come from the
scripted backend of tests/audit/test_auditor.py (what is tested is the resume rule, not a model)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support.scripted import ScriptedBackend
from test_auditor import audit, auditor_script, make_run, rows_of

from lhd_train.bench.engine import _check_weights
from lhd_train.errors import InputError
from rollouts.model_files import changed_parts, weights_fingerprint


@pytest.fixture
def model_copy(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, dst)
    return dst


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert old in text
    path.write_text(text.replace(old, new, 1), encoding="utf-8")


# ---------------------------------------------------------------- model files (lhd run)

def test_fingerprint_names_tokenizer_template_and_config(model_copy: Path) -> None:
    before = weights_fingerprint(str(model_copy))
    _edit(model_copy / "chat_template.jinja", "<|im_start|>", "<|im_start|> ")
    assert changed_parts(before, weights_fingerprint(str(model_copy))) == ["chat template"]
    before = weights_fingerprint(str(model_copy))
    tok = json.loads((model_copy / "tokenizer.json").read_text())
    tok["added_tokens"][0]["content"] += "x"
    (model_copy / "tokenizer.json").write_text(json.dumps(tok))
    assert changed_parts(before, weights_fingerprint(str(model_copy))) == ["tokenizer files"]
    before = weights_fingerprint(str(model_copy))
    cfg = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps(cfg | {"rope_theta": 1234.0}))
    assert changed_parts(before, weights_fingerprint(str(model_copy))) == ["config.json / generation_config.json"]
    # weights only: an older record without parts still compares its weights digest
    legacy = {k: v for k, v in weights_fingerprint(str(model_copy)).items() if k != "parts"}
    assert changed_parts(legacy, weights_fingerprint(str(model_copy))) == []


def test_run_resume_refuses_a_changed_chat_template(model_copy: Path, tmp_path: Path) -> None:
    """The run manifest's comparison (`lhd run` resume): same weights, another chat template."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "manifest.json").write_text(json.dumps({"weights": {"m": weights_fingerprint(str(model_copy))}}))
    _check_weights(run, {"m": weights_fingerprint(str(model_copy))})  # unchanged: resumes
    _edit(model_copy / "chat_template.jinja", "<|im_start|>", "<|im_start|> ")
    with pytest.raises(InputError, match=r"weights\.m.*the chat template at .* changed"):
        _check_weights(run, {"m": weights_fingerprint(str(model_copy))})


# ---------------------------------------------------------------- lhd audit

def test_audit_resume_refuses_changed_auditor_files(tmp_path: Path, model_copy: Path) -> None:
    cfg, tids = make_run(tmp_path, auditor_model=str(model_copy))
    audit(cfg, ScriptedBackend(auditor_script()))
    audit(cfg, ScriptedBackend(auditor_script()))  # same files: a no-op resume
    _edit(model_copy / "chat_template.jinja", "<|im_start|>", "<|im_start|> ")
    with pytest.raises(InputError, match=r"model_files\.model.*chat template .*changed since this auditor id"):
        audit(cfg, ScriptedBackend(auditor_script()))
    shutil.copy(model_copy / "model.safetensors", tmp_path / "w")
    data = bytearray((model_copy / "model.safetensors").read_bytes())
    data[-1] ^= 1  # one weight changed in place
    (model_copy / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(InputError, match=r"weights and chat template"):
        audit(cfg, ScriptedBackend(auditor_script()))


def test_noop_audit_rerun_keeps_the_first_provenance(tmp_path: Path) -> None:
    cfg, tids = make_run(tmp_path)
    audit(cfg, ScriptedBackend(auditor_script()))
    info = cfg.run_dir / "audit" / "m-full" / "auditor.json"
    first = json.loads(info.read_text())
    assert first["describe"] == {"model": "scripted"}
    audit(cfg, None)  # nothing left to do: no backend is built
    again = json.loads(info.read_text())
    kept = {k: again.get(k) for k in first if k != "updated_at"}
    assert kept == {k: v for k, v in first.items() if k != "updated_at"}


def test_labels_of_an_unfinished_trial_are_flagged_and_redone(tmp_path: Path) -> None:
    cfg, (tid,) = make_run(tmp_path)
    done = cfg.run_dir / "trials" / f"{tid}.done"
    marker = done.read_bytes()
    done.unlink()
    summary = audit(cfg, ScriptedBackend(auditor_script()), include_unfinished=True)
    n = summary.totals["rounds"]
    assert n > 1 and summary.totals["audited"] == n
    assert all(r["trial_unfinished"] is True for r in rows_of(cfg, "m-full", tid))
    assert summary.totals["partial"] == n
    audit(cfg, ScriptedBackend(auditor_script()), include_unfinished=True)  # still unfinished: nothing redone
    assert len(rows_of(cfg, "m-full", tid)) == n
    done.write_bytes(marker)  # the trial finishes
    summary = audit(cfg, ScriptedBackend(auditor_script()))
    assert summary.totals["audited"] == n and summary.totals["relabel"] == n and summary.totals["partial"] == 0
    rows = rows_of(cfg, "m-full", tid)
    latest = {r["global_round"]: r for r in rows}  # appended after the flagged ones
    assert len(rows) == 2 * n and not any(r.get("trial_unfinished") for r in latest.values())
    assert audit(cfg, ScriptedBackend(auditor_script())).totals["audited"] == 0
