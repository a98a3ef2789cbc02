"""Issue 40 item 1: an adapter in any folder loads.

PEFT names modules after an adapter and refuses a name with a dot, and a role names its adapter by
its folder, so `./ad`, a `mktemp -d` folder (`/tmp/tmp.XXXX`) or `runs/llama-3.1-8b-sft/adapter`
ended every command in `KeyError: module name can't contain "."`. Here real `lhd run` and `lhd
audit` commands load an adapter from such folders on the tiny model, and the rows they write show
its weights were used."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from test_failure_modes import RUN, SEED, cli, write_config

from lhd_train.io.files import read_jsonl


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, tiny_llama_dir) -> Path:
    """A LoRA adapter with non-zero weights (PEFT's default start is a no-op) in a plain folder."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    lora = get_peft_model(base, LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj", "v_proj", "o_proj"],
                                           init_lora_weights=False))
    out = tmp_path_factory.mktemp("adapter") / "plain"
    lora.save_pretrained(out)
    return out


def texts(run_dir: Path) -> list[str]:
    return [r["performer"]["text"] for r in read_jsonl(run_dir / "trials" / f"s{SEED}.jsonl")]


@pytest.fixture
def mktemp_dir():
    """A folder made by `mktemp -d`, as a user's shell makes one (its name holds a dot)."""
    d = Path(subprocess.run(["mktemp", "-d"], capture_output=True, text=True, check=True).stdout.strip())
    assert "." in d.name
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_run_and_audit_load_an_adapter_from_dotted_relative_and_absolute_folders(
        adapter, mktemp_dir, tmp_path, monkeypatch, capsys, tiny_llama_dir):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(adapter, tmp_path / "ad")  # `./ad`: relative, the dot is the path's own
    dotted = tmp_path / "runs" / "llama-3.1-8b-sft" / "adapter"  # absolute, a dot in a parent
    shutil.copytree(adapter, dotted)
    shutil.copytree(adapter, mktemp_dir, dirs_exist_ok=True)

    base_cfg = write_config(tmp_path / "base.yaml", tiny_llama_dir, tmp_path / "base")
    code, out = cli(monkeypatch, capsys, "run", str(base_cfg), "--no-progress")
    assert code == 0, out
    base = texts(tmp_path / "base" / RUN)

    answers = {}
    for name, where in {"relative": "./ad", "dotted": str(dotted), "mktemp": str(mktemp_dir)}.items():
        cfg = write_config(tmp_path / f"{name}.yaml", tiny_llama_dir, tmp_path / name)
        code, out = cli(monkeypatch, capsys, "run", str(cfg), "--no-progress", f"performer.adapter={where}")
        assert code == 0, out
        assert "module name" not in out
        run_dir = tmp_path / name / RUN
        manifest = json.loads((run_dir / "manifest.json").read_text())
        assert manifest["models"]["performer"]["adapter"] == where
        answers[name] = texts(run_dir)
    # One adapter, one seed: the same answers from every folder, and not the base model's.
    assert answers["relative"] == answers["dotted"] == answers["mktemp"]
    assert answers["relative"] != base

    run_dir = tmp_path / "relative" / RUN
    code, out = cli(monkeypatch, capsys, "audit", str(run_dir), "auditor.model=tiny",
                    f"auditor.adapter={mktemp_dir}", "--no-progress")
    assert code == 0, out
    audited = read_jsonl(run_dir / "audit" / "tiny-full" / f"s{SEED}.jsonl")
    assert len(audited) == len(answers["relative"])
    assert json.loads((run_dir / "audit" / "tiny-full" / "auditor.json").read_text())["role"]["adapter"] \
        == str(mktemp_dir)


def test_the_hf_backend_names_peft_adapters_by_identifiers(adapter, tmp_path, tiny_llama_dir):
    """Two adapters whose names are dotted paths load side by side, each reachable by its name."""
    import asyncio

    from rollouts.hf.backend import HFBackend, peft_names
    from rollouts.hf.spec import HFSpec
    from rollouts.types import GenerationRequest, SamplingParams

    names = {"./a.b": str(adapter), str(tmp_path / "v1.2" / "ad"): str(adapter)}
    assert all(n.isidentifier() for n in peft_names(names).values())
    backend = HFBackend.from_spec(HFSpec(model=str(tiny_llama_dir), adapters=names))
    sp = SamplingParams(temperature=0.0, max_tokens=8, n=1)
    reqs = [GenerationRequest([{"role": "user", "content": "hi"}], sp, None, name) for name in [None, *names]]

    async def ask() -> list:
        try:
            return await backend.generate(reqs)
        finally:
            await backend.aclose()

    out = asyncio.run(ask())
    assert all(r.ok for r in out), [r.error for r in out]
    plain, first, second = (r.completions[0].token_ids for r in out)
    assert first == second != plain
