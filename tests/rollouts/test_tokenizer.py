"""One tokenizer rule (`rollouts.tokenizer.load_tokenizer`): every loader returns the pipeline the
folder saved, so generation, prompt counting, training and the lens see the same token ids.

The folder that tells the rules apart is a qwen2 model whose tokenizer.json was saved with a
pre-tokenizer other than Qwen2's (here: split on whitespace): `AutoTokenizer` then rebuilds it
as `Qwen2Tokenizer` with Qwen2's own pre-tokenizer, and the ids change."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

TEXTS = ["Hello world 12345 ok", "  leading spaces and\ttabs\n\nnewlines", "don't I'll we've"]


@pytest.fixture(scope="module")
def own_pretokenizer_qwen2(tiny_qwen2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny qwen2 model with a tokenizer that splits on whitespace before byte-level BPE."""
    from tokenizers import Tokenizer, pre_tokenizers

    folder = tmp_path_factory.mktemp("qwen2_own_pretokenizer") / "model"
    shutil.copytree(tiny_qwen2_dir, folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.save(str(folder / "tokenizer.json"))
    return folder


def _saved_ids(folder: Path) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return [tok.encode(t, add_special_tokens=False).ids for t in TEXTS]


def _ids(tok) -> list[list[int]]:
    return [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]


def test_autotokenizer_alone_changes_this_folders_ids(own_pretokenizer_qwen2: Path) -> None:
    """Why the rule exists: with the installed transformers, AutoTokenizer replaces the saved
    pre-tokenizer of a generic fast tokenizer in a qwen2 folder. Should this start failing, the
    special case in rollouts/tokenizer.py no longer changes ids and can go."""
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(own_pretokenizer_qwen2)
    assert type(auto).__name__ == "Qwen2Tokenizer"
    assert _ids(auto) != _saved_ids(own_pretokenizer_qwen2)


def test_load_tokenizer_keeps_the_saved_ids(own_pretokenizer_qwen2: Path, tiny_llama_dir: Path) -> None:
    from rollouts.tokenizer import load_tokenizer

    assert _ids(load_tokenizer(str(own_pretokenizer_qwen2))) == _saved_ids(own_pretokenizer_qwen2)
    assert _ids(load_tokenizer(str(tiny_llama_dir), local_files_only=True)) == _saved_ids(tiny_llama_dir)


def test_every_loader_uses_the_rule(own_pretokenizer_qwen2: Path) -> None:
    """hf generation, served-model prompt counting, the trainer and the lens: the same ids."""
    from lens.model import load_hf
    from lens.model import load_tokenizer as lens_tokenizer
    from lhd_train.finetune.trainer import load_tokenizer as trainer_tokenizer
    from rollouts.hf.backend import HFBackend
    from rollouts.hf.spec import HFSpec
    from rollouts.model_files import counting_tokenizer
    from rollouts.openai_backend import OpenAISpec

    folder = str(own_pretokenizer_qwen2)
    saved = _saved_ids(own_pretokenizer_qwen2)
    backend = HFBackend.from_spec(HFSpec(model=folder, device="cpu", dtype="float32"))
    assert _ids(backend.tokenizer) == saved
    assert _ids(counting_tokenizer(OpenAISpec(model="served-name", tokenizer=folder,
                                             base_url="http://127.0.0.1:1/v1"))) == saved
    assert _ids(trainer_tokenizer(folder)) == saved
    assert _ids(lens_tokenizer(folder)) == saved
    assert _ids(load_hf(folder, device="cpu")[1]) == saved


def test_errors_stay_with_the_callers(tmp_path: Path) -> None:
    """rollouts raises the loader's error; the trainer and the lens word it for their users."""
    from lens.errors import LensError
    from lens.model import load_tokenizer as lens_tokenizer
    from lhd_train.errors import InputError
    from lhd_train.finetune.trainer import load_tokenizer as trainer_tokenizer
    from rollouts.tokenizer import load_tokenizer

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises((OSError, ValueError)):
        load_tokenizer(str(empty), local_files_only=True)
    with pytest.raises(InputError, match="cannot load a tokenizer"):
        trainer_tokenizer(str(empty), source="recipe.yaml", field="tokenizer")
    with pytest.raises(LensError, match="cannot load a tokenizer"):
        lens_tokenizer(str(empty))
