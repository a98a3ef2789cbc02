"""Session fixtures for the lens tests: tiny random Llama and Qwen3 models (Llama-3-style and
Qwen-style chat templates) with a locally trained byte-level BPE tokenizer, the toy residual
model, and a small task pack. Nothing is downloaded."""
from __future__ import annotations

import contextlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch
from lens_data import make_pack  # noqa: E402  (shared with the test modules)
from support.lens_toy import ToyResidualModel, build_lens_tiny, lens_corpus

from lens.model import load_hf


@contextlib.contextmanager
def one_thread():
    """Tiny models gain nothing from intra-op threads, and spinning OpenMP threads slow a shared
    2-core machine down by an order of magnitude; the setting is restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_models")
    corpus = lens_corpus()
    with one_thread():
        return {arch: build_lens_tiny(arch, root / arch, corpus=corpus, num_layers=3, seed=1)
                for arch in ("llama", "qwen3")}


def _load(path):
    with one_thread():
        return load_hf(str(path), dtype="float32", device="cpu", attn_implementation="eager")


@pytest.fixture(scope="session")
def llama(tiny_dirs):
    return _load(tiny_dirs["llama"])


@pytest.fixture(scope="session")
def qwen(tiny_dirs):
    return _load(tiny_dirs["qwen3"])


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def tiny(request, llama, qwen):
    return llama if request.param == "llama" else qwen


@pytest.fixture(scope="session")
def toy():
    return ToyResidualModel(d=8, n_layers=4, seed=0)


@pytest.fixture(scope="session")
def pack():
    return make_pack()


@pytest.fixture(scope="session")
def fit_prompts():
    return [
        f"The report for region {i} lists {i * 7} units sold at a price of {i + 2}.50 each, and the team notes "
        f"that demand in week {i} was higher than planned because of the new customers."
        for i in range(1, 7)
    ]
