"""Before any server starts: does vLLM accept each `backend: vllm` model, and do the models started
together fit the GPUs this process may use?

vLLM lives in its own venv, so lhd cannot import it. The check runs `vllm_probe.py` with that
venv's python on the exact argv lhd would run (`vllm_command`), with the model replaced by a
temporary folder holding only the model's config.json (from a local folder, HF_HOME, or the one
shipped in configs/models/<name>/): vLLM's own parser, `AsyncEngineArgs` and `ModelConfig` then
refuse what the server would refuse at start-up (a max_model_len beyond the model's context, a
tensor-parallel size that does not divide the heads, an adapter vLLM cannot load), in seconds,
without weights or a GPU. `lhd doctor --config` reports the same as rows."""
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

from lhd_train.errors import InputError
from rollouts.backend import BackendError
from rollouts.gpus import GpuAssignmentError, check_claims, gpu_count, hf_position, parse_positions
from rollouts.spec import ModelSpec
from rollouts.vllm_server import checked_vllm, find_vllm, venv_packages, vllm_command, vllm_device

SHIPPED_CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"
PROBE = Path(__file__).with_name("vllm_probe.py")
PROBE_MARK = "LHD-VLLM-PROBE "
PROBE_TIMEOUT_S = 600.0
OK, WARN, FAIL = "ok", "warn", "fail"  # doctor's row statuses
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


def config_folder(spec: ModelSpec) -> tuple[Path, str] | None:
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


def _run_probe(python: str, jobs: list[dict]) -> dict[str, dict]:
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


def validate_vllm(specs: Mapping[str, ModelSpec], devices: Mapping[str, str] | None = None,
                  exe: str | None = None) -> list[Finding]:
    """One Finding per model of `specs` (vllm ones only): vLLM's verdict on the argv lhd would run on
    `devices[key]` (default: where it would run here). `exe` overrides which vLLM env judges."""
    findings: dict[str, Finding] = {}
    groups: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="lhd-vllm-check-") as tmp:
        for index, (key, spec) in enumerate(specs.items()):
            if spec.backend != "vllm":
                continue
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


def gpu_claims(specs: Mapping[str, ModelSpec], visible: int) -> dict[str, list[int]]:
    """model key -> the GPU positions it occupies: a vllm server on cuda its `gpus:` (else the first
    tp × dp, as vLLM takes them), an hf model on cuda/cuda:N (auto: cuda when a GPU is visible) one."""
    claims: dict[str, list[int]] = {}
    for key, spec in specs.items():
        if spec.backend == "vllm" and vllm_device(spec) == "cuda":
            need = spec.tensor_parallel_size * spec.data_parallel_size
            positions = parse_positions(spec.gpus, key) if spec.gpus else list(range(need))
            if len(positions) < need:
                raise GpuAssignmentError(key, "gpus", f"gpus {spec.gpus!r} lists {len(positions)} GPU(s) but "
                                         f"tensor_parallel_size x data_parallel_size = {need}")
            claims[key] = positions
        elif spec.backend == "hf":
            device = ("cuda" if visible else "cpu") if spec.device == "auto" else spec.device
            pos = hf_position(device, key)
            if pos is not None:
                claims[key] = [pos]
    return claims


def check_gpus(specs: Mapping[str, ModelSpec], source: str | Path, visible: int | None = None) -> None:
    """InputError naming `models.<key>.<field>` when the models started together ask for more GPUs
    than are visible or share one."""
    visible = gpu_count() if visible is None else visible
    try:
        check_claims(gpu_claims(specs, visible), visible)
    except GpuAssignmentError as e:
        field = "device" if e.key is not None and e.key in specs and specs[e.key].backend == "hf" else e.field
        raise InputError(source, f"models.{e.key}.{field}", e.problem) from None


def preflight(specs: Mapping[str, ModelSpec], source: str | Path) -> list[str]:
    """`lhd run`'s check before any server starts: GPUs, the vLLM build, then vLLM's own verdict on
    every vllm model. Raises InputError/BackendError; returns notes to print (checks skipped)."""
    check_gpus(specs, source)
    vllm = {k: s for k, s in specs.items() if s.backend == "vllm"}
    for spec in vllm.values():
        device = vllm_device(spec)
        if find_vllm(spec, device) is not None:
            checked_vllm(spec, device)  # a CPU build for a cuda model is refused here
    notes = []
    for f in validate_vllm(vllm):
        if f.status == "fail":
            raise InputError(source, f"models.{f.key}.{f.field}", f.message)
        if f.status == "skip":
            notes.append(f"vLLM config check skipped for '{f.key}': {f.message}")
    return notes


def _groups(data: dict, specs: dict[str, ModelSpec]) -> list[tuple[str, dict[str, ModelSpec]]]:
    """The sets of models one process starts together: `lhd run`'s roles, `lhd audit`'s auditor,
    `lhd data`'s both; a file of bare `models:` entries is one set. Role adapters are added as `lhd run` adds them."""
    run_keys: dict[str, ModelSpec] = {}
    for role in ("performer", "supervisor", "summariser"):
        rc = data.get(role) if isinstance(data.get(role), dict) else None
        if rc and rc.get("model") in specs:
            spec = run_keys.setdefault(rc["model"], specs[rc["model"]].model_copy(deep=True))
            if rc.get("adapter"):
                spec.adapters.setdefault(rc["adapter"], rc["adapter"])
    out = [("lhd run", run_keys)] if run_keys else []
    auditor = data.get("auditor") if isinstance(data.get("auditor"), dict) else None
    if auditor and auditor.get("model") in specs:
        key = auditor["model"]
        out.append(("lhd audit", {key: specs[key]}))
        if run_keys and key not in run_keys:  # `lhd data` samples and grades at once
            out.append(("lhd data", {**run_keys, key: specs[key]}))
    return out or [("models", specs)]


def doctor_rows(config: str | Path) -> list[tuple[str, str, str]]:
    """`lhd doctor --config`: rows for the GPU assignment of each set of models started together and
    vLLM's verdict on every vllm model (judged for cuda unless the entry says device: cpu)."""
    import yaml

    data = yaml.safe_load(Path(config).read_text(encoding="utf-8")) or {}
    specs: dict[str, ModelSpec] = {}
    rows: list[tuple[str, str, str]] = []
    for key, entry in ((data.get("models") or {}) if isinstance(data, dict) else {}).items():
        try:
            specs[key] = ModelSpec(**entry)
        except Exception as e:  # noqa: BLE001 - pydantic names the field
            rows.append((f"config {key}", FAIL, f"{config}: models.{key}: {' '.join(str(e).split())}"))
    if not specs:
        return rows
    visible = gpu_count()
    for stage, group in _groups(data, specs):
        try:
            if visible:
                check_gpus(group, config, visible)
                rows.append((f"gpus ({stage})", OK, f"{visible} GPU(s) visible; " + _claims_text(group, visible)))
            else:  # no GPU here: only what the config says of itself (two models on one GPU)
                check_gpus(group, config, 1 << 16)
                rows.append((f"gpus ({stage})", WARN, "no GPU visible here: GPU counts not checked (run doctor on "
                             "the GPU node); no GPU is given to two models"))
        except (InputError, GpuAssignmentError) as e:
            rows.append((f"gpus ({stage})", FAIL, str(e)))
    for key, spec in specs.items():
        if spec.backend == "openai" and spec.structured_outputs == "vllm":
            rows.append((f"structured outputs {key}", OK, "sends vLLM's `structured_outputs` field: a server older "
                         "than vLLM 0.10.2 ignores it silently and answers unconstrained (lhd then parses and "
                         "retries); for such a server use structured_outputs: response_format"))
    devices = {k: "cpu" if s.device == "cpu" else "cuda" for k, s in specs.items()}
    label = {OK: OK, "fail": FAIL, "skip": WARN}
    try:
        findings = validate_vllm(specs, devices)
    except BackendError as e:  # the vLLM env itself is broken: one row, the other checks stand
        return rows + [("vllm config", FAIL, str(e))]
    for f in findings:
        where = f"{config}: field 'models.{f.key}.{f.field}': " if f.status == "fail" else ""
        rows.append((f"vllm config {f.key}", label[f.status], where + f.message))
    return rows


def _claims_text(group: Mapping[str, ModelSpec], visible: int) -> str:
    claims = gpu_claims(group, visible)
    return "; ".join(f"{k}: position(s) {','.join(map(str, v))}" for k, v in claims.items()) or "no model on a GPU"
