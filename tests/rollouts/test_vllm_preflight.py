"""Every shipped `backend: vllm` model, judged by real vLLM 0.32 (.venv-vllm): its `vllm serve` argv
as lhd builds it for cuda goes through vLLM's own parser, `AsyncEngineArgs` and `ModelConfig` on the
model's config.json (configs/models/<name>/config.json, no weights), in vLLM's own venv.

The YaRN suggestions written in the model files' comments are checked too (the Qwen2.5-72B form
without `max_position_embeddings` is what vLLM 0.32 refused, H1), and broken copies fail naming
the model entry's field. The first block needs no vLLM."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from lhd_train.config.run import preflight
from lhd_train.errors import InputError
from lhd_train.ops.doctor_checks import check_config
from rollouts.vllm import preflight as check
from rollouts.vllm import server
from rollouts.vllm.spec import VLLMSpec

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))
# The form the configs shipped before: vLLM 0.32 no longer scales max_position_embeddings by the factor.
OLD_YARN = '{"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, ' \
           '"rope_theta": 1000000.0}}'


def shipped_vllm_models() -> dict[str, VLLMSpec]:
    out = {}
    for path in CONFIGS:
        data = yaml.safe_load(path.read_text()) or {}
        for key, entry in (data.get("models") or {}).items():
            if entry.get("backend") == "vllm":
                out[f"{path.relative_to(ROOT)}:{key}"] = VLLMSpec(**entry)
    return out


def commented_suggestions() -> dict[str, VLLMSpec]:
    """The `["--hf-overrides", '...']` lines in the model files' comments, applied to their model
    with max_model_len 131072, as the comments tell a user to do."""
    out = {}
    for path in CONFIGS:
        text = path.read_text()
        for i, m in enumerate(re.finditer(r"^#\s+(\[\"--hf-overrides\".*\])\s*$", text, re.M)):
            data = yaml.safe_load(text) or {}
            [(key, entry)] = data["models"].items()
            extra = yaml.safe_load(m.group(1))
            out[f"{path.relative_to(ROOT)}:{key}:comment{i}"] = VLLMSpec(
                **{**entry, "max_model_len": 131072, "extra_args": list(entry.get("extra_args", [])) + extra})
    return out


def test_every_vllm_model_has_a_shipped_config_json():
    for label, spec in shipped_vllm_models().items():
        folder, source = check.config_folder(spec)
        assert (folder / "config.json").is_file(), label
    assert len(commented_suggestions()) >= 3  # Qwen2.5-7B, Qwen3-8B, Qwen3-32B


def test_field_names_come_from_vllms_message():
    assert check.field_for("argv", "argument --max-model-len: invalid int value") == "max_model_len"
    assert check.field_for("argv", "argument --foo: expected one argument") == "extra_args"
    assert check.field_for("model config", "User-specified max_model_len (262144) is greater") == "max_model_len"
    assert check.field_for("parallel config", "Total number of attention heads (28) must be divisible") \
        == "tensor_parallel_size"
    assert check.field_for("lora a", "LoRA rank 128 is greater than max_lora_rank 64.") == "adapters"


@pytest.fixture
def shared_vllm(vllm_python, monkeypatch):
    """The product's probe runs in the session's vLLM interpreter (tests/support/vllm_python.py)
    instead of a new process: same argv, same probe.py, same parsing of its answer."""
    monkeypatch.setattr(check, "subprocess", vllm_python.subprocess_module())
    before = vllm_python.jobs
    yield vllm_python
    assert vllm_python.jobs > before  # vLLM itself judged


@pytest.mark.vllm
def test_vllm_accepts_every_shipped_config_and_names_the_field_of_broken_ones(shared_vllm):
    specs = {**shipped_vllm_models(), **commented_suggestions()}
    good = set(specs)
    qwen72 = specs["configs/examples/vllm-llama8b.yaml:qwen72b"]
    llama8 = specs["configs/examples/vllm-llama8b.yaml:llama8b"]
    qwen7 = specs["configs/models/qwen2.5-7b-instruct.yaml:qwen7b"]
    specs["broken-len"] = llama8.model_copy(update={"max_model_len": 262144})
    specs["broken-yarn"] = qwen72.model_copy(update={"extra_args": ["--hf-overrides", OLD_YARN]})
    specs["broken-tp"] = qwen7.model_copy(update={"tensor_parallel_size": 8, "gpus": None})
    specs["broken-flag"] = qwen7.model_copy(update={"extra_args": ["--max-num-seqs", "many"]})
    findings = {f.key: f for f in check.validate_vllm(specs, {k: "cuda" for k in specs})}
    assert set(findings) == set(specs)
    for key in good:
        assert findings[key].status == "ok", (key, findings[key].message)
        assert "vLLM 0.32" in findings[key].message
    assert findings["broken-len"].status == "fail" and findings["broken-len"].field == "max_model_len"
    assert "262144" in findings["broken-len"].message
    assert (findings["broken-yarn"].field, findings["broken-yarn"].status) == ("max_model_len", "fail")
    assert "max_position_embeddings=32768" in findings["broken-yarn"].message
    assert findings["broken-tp"].field == "tensor_parallel_size" and "(28)" in findings["broken-tp"].message
    assert findings["broken-flag"].field == "extra_args" and "--max-num-seqs" in findings["broken-flag"].message


@pytest.mark.vllm
def test_doctor_and_run_refuse_a_broken_copy(tmp_path, monkeypatch, shared_vllm):
    """`lhd doctor --config` names the field of a broken copy of the flagship example, and `lhd run`
    refuses it before any server starts."""
    import lhd_train.bench.engine as engine
    from lhd_train.config.run import load_config

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4")
    monkeypatch.setattr(server, "checked_vllm", lambda spec, device: "vllm")  # the CPU build judges here
    data = yaml.safe_load((ROOT / "configs/examples/vllm-llama8b.yaml").read_text())
    data["models"]["llama8b"]["max_model_len"] = 262144
    data["output_dir"] = str(tmp_path)
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(data))
    rows = {c: (s, d) for c, s, d in check_config(broken)}
    assert rows["gpus (lhd run)"][0] == "ok"
    assert rows["vllm config qwen72b"][0] == "ok"
    status, detail = rows["vllm config llama8b"]
    assert status == "fail" and "field 'models.llama8b.max_model_len'" in detail and "262144" in detail
    cfg = load_config(broken)
    with pytest.raises(InputError) as e:
        preflight(engine.role_specs(cfg, engine.RUN_ROLES), broken)
    assert e.value.field == "models.llama8b.max_model_len"


@pytest.mark.vllm
def test_audit_refuses_a_broken_vllm_auditor_before_it_starts(tmp_path, monkeypatch, shared_vllm):
    """`lhd audit --auditor` runs the same check as `lhd run`: a broken copy of the 70B auditor
    config is refused naming the field, and no audit folder is written."""
    from lhd_train.cli.audit import audit_command
    from lhd_train.config.auditor import AuditCommand
    from lhd_train.interop.reference_import import import_reference

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.setattr(server, "checked_vllm", lambda spec, device: "vllm")  # the CPU build judges here
    run = tmp_path / "imported"
    import_reference(ROOT / "tests" / "data" / "reference-sessions", run, False)
    data = yaml.safe_load((ROOT / "configs/examples/auditor-llama70b.yaml").read_text())
    data["models"]["llama70b"]["max_model_len"] = 262144
    broken = tmp_path / "auditor.yaml"
    broken.write_text(yaml.safe_dump(data))
    before = sorted(p.name for p in (run / "audit").iterdir())  # the imported authors' labels
    with pytest.raises(InputError) as e:
        audit_command(AuditCommand(run=run, auditor=broken, progress=False))
    assert e.value.field == "models.llama70b.max_model_len" and "262144" in str(e.value)
    assert sorted(p.name for p in (run / "audit").iterdir()) == before


def test_doctor_notes_that_old_vllm_ignores_structured_outputs():
    """L8: a model sent vLLM's `structured_outputs` gets a note that servers before vLLM 0.10.2 drop
    the field silently (no vLLM needed: the example has no managed vllm model)."""
    rows = {c: (s, d) for c, s, d in check_config(ROOT / "configs/examples/openai-endpoint.yaml")}
    status, detail = rows["structured outputs performer"]
    assert status == "ok" and "0.10.2" in detail and "response_format" in detail
    assert "structured outputs judge" not in rows  # `auto` sends response_format first


def test_a_broken_vllm_env_is_one_doctor_row(tmp_path, monkeypatch):
    """A vLLM env whose python cannot run the check gives one failing row with its exit code and
    output, not a traceback that hides doctor's other rows."""
    py = tmp_path / "venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("#!/bin/sh\necho 'ImportError: libcudart.so.12' >&2\nexit 3\n")
    py.chmod(0o755)
    exe = py.with_name("vllm")
    exe.write_text(f"#!{py}\n")
    exe.chmod(0o755)
    monkeypatch.setenv("LHD_VLLM", str(exe))
    rows = {c: (s, d) for c, s, d in check_config(ROOT / "configs/models/qwen3-8b.yaml")}
    status, detail = rows["vllm config"]
    assert status == "fail" and "exit code 3" in detail and "libcudart" in detail
