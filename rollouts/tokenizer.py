"""The one rule by which lhd loads a tokenizer: the one the folder saved, with its own token ids.

`AutoTokenizer` rebuilds a generic fast tokenizer (`TokenizersBackend`) in a qwen2 folder as
`Qwen2Tokenizer`, with other token ids; generation, prompt counting, training and the lens all load
through `load_tokenizer`, so they see the same ids. Named classes go through `AutoTokenizer`.
Errors are the loaders' own (OSError, ValueError, ...): each caller words them for its users.
The measurements, and why a `vllm serve` of such a folder differs: docs/serving.md, "One rule for
loading a tokenizer"."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# tokenizer_config.json classes that mean "the pipeline in tokenizer.json, as saved"
GENERIC_FAST_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def saved_tokenizer_class(name: str, revision: str | None = None, *, local_files_only: bool = False) -> str | None:
    """`tokenizer_class` from the folder's (or hub snapshot's) tokenizer_config.json; None when
    there is none or it cannot be read (the loader then reports the real problem)."""
    folder = Path(name).expanduser()
    config_file: Path | None = folder / "tokenizer_config.json" if folder.is_dir() else None
    if config_file is None:
        try:
            from huggingface_hub import hf_hub_download

            config_file = Path(hf_hub_download(name, "tokenizer_config.json", revision=revision,
                                               local_files_only=local_files_only))
        except Exception:  # noqa: BLE001 - not on the hub, offline, bad id: AutoTokenizer says which
            return None
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    cls = config.get("tokenizer_class") if isinstance(config, dict) else None
    return cls if isinstance(cls, str) else None


def load_tokenizer(name: str, revision: str | None = None, *, trust_remote_code: bool = False,
                   local_files_only: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer `name` (a local folder or a hub id) was saved with; see the module docstring."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    where: dict[str, Any] = {"local_files_only": local_files_only} | ({"revision": revision} if revision else {})
    if saved_tokenizer_class(name, revision, local_files_only=local_files_only) in GENERIC_FAST_CLASSES:
        fast: PreTrainedTokenizerBase = PreTrainedTokenizerFast.from_pretrained(name, **where)
        return fast
    auto: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code, **where)
    return auto
