"""The one rule by which lhd loads a tokenizer: the one the folder saved, with its own token ids.

`AutoTokenizer` does not always return that one. For a folder whose `config.json` says
`model_type: qwen2` and whose `tokenizer_config.json` says `TokenizersBackend` (a generic fast
tokenizer, as `lhd_train.tiny_model` and any locally trained tokenizer save), transformers 5
builds `Qwen2Tokenizer` instead and rebuilds the pipeline from vocab and merges with Qwen2's own
normalizer and pre-tokenizer, dropping the ones in `tokenizer.json`. Measured with transformers
5.24 / tokenizers 0.23 (the case `tests/rollouts/test_tokenizer.py` keeps): a tiny qwen2 folder
whose saved pre-tokenizer splits on whitespace encodes 7 of 7 sample texts to other ids under
`AutoTokenizer`; one with GPT-2's byte-level regex differs on mixed whitespace, one with an NFKC
normalizer on full-width text. lhd's own tiny models save Qwen2's regex and NFC on purpose, so
their ids agree either way (checked on qwen2, qwen3 and llama tiny folders: same ids, same chat
template encoding); the rule matters for any other generic tokenizer in a qwen2 folder.
Generation (hf backend), prompt counting (served backends), training and the lens all load
through `load_tokenizer`, so the ids a model generated are the ids the lens and the trainer see
again.

A `vllm serve` is outside this rule: it loads the folder with `AutoTokenizer` itself (measured
with .venv-vllm, transformers 5.19: `CachedQwen2Tokenizer`, the same changed ids), so a folder of
that kind generates under vLLM with other ids than lhd trains and reads with. Keep a qwen2 folder's
tokenizer on Qwen2's regex and NFC, as `lhd_train.tiny_model` does, and both agree.

Named classes (`Qwen2Tokenizer` of real Qwen checkpoints, `LlamaTokenizerFast`, ...) go through
`AutoTokenizer` as their authors meant. Errors are the loaders' own (OSError, ValueError, ...):
each caller words them for its users.
"""

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
