"""Before any server starts: does vLLM accept each `backend: vllm` model?

vLLM lives in its own venv, so lhd cannot import it. The check runs `vllm_probe.py` with that
venv's python on the exact argv lhd would run (`vllm_command`), with the model replaced by a
temporary folder holding only the model's config.json (from a local folder, HF_HOME, or the one
shipped in configs/models/<name>/): vLLM's own parser, `AsyncEngineArgs` and `ModelConfig` then
refuse what the server would refuse at start-up (a max_model_len beyond the model's context, a
tensor-parallel size that does not divide the heads, an adapter vLLM cannot load), in seconds,
without weights or a GPU. `lhd doctor --config` reports the same as rows (VLLMSpec.config_rows)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollouts.backend import BackendError
from rollouts.vllm.server import find_vllm, venv_packages, vllm_command, vllm_device

if TYPE_CHECKING:
    from rollouts.vllm.spec import VLLMSpec

SHIPPED_CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"
PROBE = Path(__file__).with_name("probe.py")
PROBE_MARK = "LHD-VLLM-PROBE "
PROBE_TIMEOUT_S = 600.0
# Files of a model folder that vLLM's ModelConfig reads (no weights).
CONFIG_FILES = ("config.json", "tokenizer_config.json", "generation_config.json")
# `vllm serve` flags -> the model entry's field that writes them.
FLAG_FIELDS = {"--max-model-len": "max_model_len", "--tensor-parallel-size": "tensor_parallel_size",
               "--data-parallel-size": "data_parallel_size", "--gpu-memory-utilization": "gpu_memory_utilization",
               "--dtype": "dtype", "--revision": "revision", "--max-lora-rank": "max_lora_rank",
               "--lora-modules": "adapters", "--trust-remote-code": "trust_remote_code"}


@dataclass
class Finding:
    """One model's verdict: status ok | fail | skip, the model entry's field at fault, vLLM's words."""

    key: str
    status: str
    field: str | None
    message: str


def config_folder(spec: VLLMSpec) -> tuple[Path, str] | None:
    """The folder whose config.json describes `spec.model`, and where it came from."""
    local = Path(spec.model).expanduser()
    if (local / "config.json").is_file():
        return local, "local folder"
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(spec.model, "config.json", revision=spec.revision)
        if isinstance(cached, str):
            return Path(cached).parent, "HF_HOME"
    except Exception:  # noqa: BLE001 - not a hub id (a missing local path): try the shipped ones
        pass
    shipped = SHIPPED_CONFIGS / spec.model.rstrip("/").split("/")[-1].lower()
    if (shipped / "config.json").is_file():
        return shipped, f"shipped {shipped.relative_to(SHIPPED_CONFIGS.parents[1])}"
    return None


def venv_python(exe: str) -> str | None:
    """The python of the venv a `vllm` executable belongs to: its shebang, else bin/python beside it."""
    try:
        first = Path(exe).read_text(encoding="utf-8", errors="replace").splitlines()[0]
    except (OSError, IndexError):
        first = ""
    if first.startswith("#!"):
        cand = first[2:].strip().split()[0] if first[2:].strip() else ""
        if cand and Path(cand).is_file() and "python" in Path(cand).name:
            return cand
    for name in ("python", "python3"):
        if (Path(exe).parent / name).is_file():
            return str(Path(exe).parent / name)
    return None


def field_for(stage: str, message: str) -> str:
    """The model entry's field a vLLM refusal is about (the flag it names, else its topic)."""
    for flag, field in FLAG_FIELDS.items():
        if flag in message:
            return field
    if re.search(r"argument --[\w-]+", message):
        return "extra_args"
    if stage.startswith("lora"):
        return "adapters"
    low = message.lower()
    if stage == "parallel config" or "tensor parallel" in low:
        return "tensor_parallel_size"
    if "max_model_len" in low or "max model len" in low:
        return "max_model_len"
    if "hf_overrides" in low or "rope" in low:
        return "extra_args"
    if "dtype" in low:
        return "dtype"
    return "model"


def _run_probe(python: str, jobs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(jobs, f)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
    try:
        proc = subprocess.run([python, str(PROBE), f.name], capture_output=True, text=True, env=env,
                              timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BackendError(f"the vLLM config check ({python} {PROBE.name}) did not run: {e}") from None
    finally:
        os.unlink(f.name)
    line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith(PROBE_MARK)), None)
    if line is None:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
        raise BackendError(f"the vLLM config check ({python} {PROBE.name}) failed with exit code "
                           f"{proc.returncode}:\n{tail}")
    return {r["key"]: r for r in json.loads(line[len(PROBE_MARK):])}


def validate_vllm(specs: Mapping[str, VLLMSpec], devices: Mapping[str, str] | None = None,
                  exe: str | None = None) -> list[Finding]:
    """One Finding per model of `specs`: vLLM's verdict on the argv lhd would run on
    `devices[key]` (default: where it would run here). `exe` overrides which vLLM env judges."""
    findings: dict[str, Finding] = {}
    groups: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="lhd-vllm-check-") as tmp:
        for index, (key, spec) in enumerate(specs.items()):
            device = (devices or {}).get(key) or vllm_device(spec)
            vllm = exe or find_vllm(spec)  # any build judges a config alike; preflight refuses a CPU one on cuda
            python = venv_python(vllm) if vllm else None
            if vllm is None or python is None:
                findings[key] = Finding(key, "skip", None, "no vLLM environment found (vllm_executable, LHD_VLLM, "
                                        "PATH, .venv-vllm): not checked")
                continue
            source = config_folder(spec)
            if source is None:
                findings[key] = Finding(key, "skip", "model", f"{spec.model}: no config.json (not a local folder, "
                                        f"not in HF_HOME, none shipped in {SHIPPED_CONFIGS}): not checked")
                continue
            folder = Path(tmp) / f"model{index}"  # keys may hold any character
            folder.mkdir()
            for name in CONFIG_FILES:
                if (source[0] / name).is_file():
                    shutil.copyfile(source[0] / name, folder / name)
            try:
                argv = vllm_command(spec, 8000, key, device, exe="vllm")[1:]
            except BackendError as e:
                findings[key] = Finding(key, "fail", field_for("", str(e)), str(e))
                continue
            argv[1] = str(folder)
            version = venv_packages(vllm).get("vllm", "?")
            findings[key] = Finding(key, "ok", None, f"vLLM {version} accepts it ({device}; config.json: {source[1]})")
            groups.setdefault(python, []).append({"key": key, "argv": argv})
        for python, jobs in groups.items():
            for key, r in _run_probe(python, jobs).items():
                if not r["ok"]:
                    findings[key] = Finding(key, "fail", field_for(r["stage"], r["message"]),
                                            f"vLLM refuses it ({r['stage']}): {r['message']}")
    return [findings[k] for k in specs if k in findings]
