"""Every config lhd ships or keeps as a fixture still loads now that each backend has its own spec
(issue 32), and run directories written by the flat `ModelSpec` still read: their files hold every
field of every backend at its default, which the per-backend specs drop."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lhd_train.config.auditor import AuditorConfig
from lhd_train.config.base import validate
from lhd_train.config.recipe import load_recipe
from lhd_train.config.run import RunConfig, load_config, load_saved_config
from rollouts.backends import BACKENDS, parse_spec

ROOT = Path(__file__).resolve().parents[2]
# The flat spec's fields: the union of what the per-backend specs take (files written before hold them all).
FLAT_FIELDS = {"backend", "model", "revision", "dtype", "device", "max_batch_size", "batch_wait_ms", "max_model_len",
               "trust_remote_code", "adapters", "base_url", "api_key_env", "max_in_flight", "timeout_s",
               "max_retries", "structured_outputs", "tokenizer", "startup_timeout_s", "tensor_parallel_size",
               "data_parallel_size", "gpu_memory_utilization", "enable_prefix_caching", "prefix_cache_gib",
               "kv_budget_gib", "max_lora_rank", "extra_args", "gpus", "cpu_kv_cache_gib", "vllm_executable"}
FIXTURE = ROOT / "tests" / "data" / "runs" / "v1-control-study"


def yaml_files() -> list[Path]:
    return sorted(p for d in ("configs", "recipes", "tests/data") for p in (ROOT / d).rglob("*.yaml"))


def kind(data: dict) -> str:
    if "run_name" in data:
        return "run"
    if "auditor" in data:
        return "auditor"
    if "models" in data:
        return "models"
    if "algo" in data or "lora" in data:
        return "recipe"
    return "other"  # accelerate configs, the authors' own session configs


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_yaml_loads(path):
    data = yaml.safe_load(path.read_text()) or {}
    what = kind(data)
    if what == "run":
        cfg = load_config(path)
        assert set(cfg.models) == set(data["models"])
        for key, spec in cfg.models.items():
            assert type(spec) is BACKENDS[data["models"][key]["backend"]]
    elif what == "auditor":
        cfg = validate(AuditorConfig, data, path)
        assert type(cfg.spec) is BACKENDS[data["models"][data["auditor"]["model"]]["backend"]]
    elif what == "models":
        for entry in data["models"].values():
            spec = parse_spec(entry)
            # every field the file sets is kept, with its value
            assert {k: getattr(spec, k) for k in entry} == entry
    elif what == "recipe":
        load_recipe(path)


def test_the_kinds_cover_the_files():
    kinds = [kind(yaml.safe_load(p.read_text()) or {}) for p in yaml_files()]
    assert kinds.count("run") >= 4 and kinds.count("models") >= 6 and kinds.count("recipe") >= 10
    assert kinds.count("auditor") >= 1


def test_the_fixture_run_written_by_the_flat_spec_still_reads():
    saved = yaml.safe_load((FIXTURE / "config.resolved.yaml").read_text())
    assert set(saved["models"]["tiny"]) == FLAT_FIELDS  # the old writer's form: every field of every backend
    cfg = load_saved_config(FIXTURE)
    spec = cfg.models["tiny"]
    assert type(spec) is BACKENDS["hf"] and spec.max_batch_size == 8 and spec.model == "runs/tiny-llama"
    assert set(spec.model_dump()) == set(BACKENDS["hf"].model_fields)
    # the auditor record's copy of the spec reads too
    import json

    record = json.loads((FIXTURE / "audit" / "tiny-full" / "auditor.json").read_text())
    assert parse_spec(record["model_spec"]) == spec


def test_a_resume_compares_an_old_config_as_read_today(tmp_path):
    """`lhd run` refuses to resume a run with another config; an old run's config (every backend's
    fields) read today compares equal to the same config written per backend."""
    from lhd_train.bench.engine import _check_resume

    saved = yaml.safe_load((FIXTURE / "config.resolved.yaml").read_text())
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.resolved.yaml").write_text(yaml.safe_dump(saved))
    cfg = validate(RunConfig, saved, "test")
    _check_resume(run_dir, cfg)  # no error: the same config
    changed = cfg.model_copy(update={"max_rounds_per_task": 5})
    with pytest.raises(Exception, match="max_rounds_per_task"):
        _check_resume(run_dir, changed)


def test_a_non_default_foreign_field_in_an_old_file_is_still_refused():
    entry = {"backend": "hf", "model": "m", "tensor_parallel_size": 2}
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        parse_spec(entry)


def doc_model_entries() -> list[tuple[str, dict]]:
    """(where, entry) of every `models:` entry in a fenced YAML block of the README and docs/."""
    import re

    found = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "configs").rglob("*.md"))]:
        for block in re.findall(r"```ya?ml\n(.*?)```", doc.read_text(), re.S):
            data = yaml.safe_load(block)
            models = data.get("models") if isinstance(data, dict) else None
            for key, entry in (models or {}).items():
                found.append((f"{doc.relative_to(ROOT)}:{key}", entry))
    return found


def test_every_documented_model_entry_loads():
    entries = doc_model_entries()
    assert entries, "the docs show at least one models: entry (docs/auditing.md's auditor config)"
    for where, entry in entries:
        spec = parse_spec(entry)
        assert type(spec) is BACKENDS[entry["backend"]], where
        assert {k: getattr(spec, k) for k in entry} == entry, where
