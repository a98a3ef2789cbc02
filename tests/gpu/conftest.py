"""The device tests: the paths most at risk on a GPU node, without network and without vLLM.

Each test takes `device` (its CPU form, which the CPU suite runs, and its `gpu`-marked CUDA form) or
`cuda` (CUDA only). Without CUDA the CUDA forms skip, saying why. On a lent GPU machine
`scripts/gpu_check.sh` runs `pytest -m gpu tests/gpu` with LHD_CHECK_LINES=1: each test then prints,
as it finishes, one `CHECK <name>: PASS|FAIL|SKIP <measurements> [seconds]` line and its `PROJ`
lines (a measurement projected to Llama-3.1-8B), so a run stopped by its timeout keeps what it
measured. LHD_GPU_DEVICE picks the GPU (default `cuda`)."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

GPU = os.environ.get("LHD_GPU_DEVICE", "cuda")
LINES = os.environ.get("LHD_CHECK_LINES") == "1"
_config: list[pytest.Config] = []


def pytest_configure(config: pytest.Config) -> None:
    _config.append(config)


FIRST = ("test_versions", "test_env")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`versions`, then `env`, before every other device test: a version outside lhd's ranges or a
    missing CUDA is what to read first, and a run stopped by its timeout has printed them."""
    def rank(item: pytest.Item) -> int:
        if not item.nodeid.startswith("tests/gpu/"):
            return len(FIRST)
        name = getattr(item, "originalname", item.name)
        return FIRST.index(name) if name in FIRST else len(FIRST)

    items.sort(key=rank)  # stable: the rest keep their order


def _write(line: str) -> None:
    terminal = _config[-1].pluginmanager.get_plugin("terminalreporter") if LINES and _config else None
    if terminal is not None:
        after_progress = getattr(getattr(terminal, "_tw", None), "width_of_current_line", 0)  # pytest's dots
        terminal.write(("\n" if after_progress else "") + line + "\n", flush=True)


def _cuda_or_skip() -> str:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: torch sees no GPU (scripts/gpu_check.sh runs these on a GPU machine)")
    return GPU


@pytest.fixture(scope="session", params=["cpu", pytest.param(GPU, marks=pytest.mark.gpu, id="cuda")])
def device(request: pytest.FixtureRequest) -> str:
    """`cpu` (the small form of the test) or the GPU."""
    return "cpu" if request.param == "cpu" else _cuda_or_skip()


@pytest.fixture(scope="session", params=[pytest.param(GPU, marks=pytest.mark.gpu, id="cuda")])
def cuda() -> str:
    """The GPU, for tests that have no CPU form."""
    return _cuda_or_skip()


@pytest.fixture(scope="session")
def tiny4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The random tiny Llama with 4 layers (its tokenizer also tokenises the 8B-shaped models' prompts)."""
    from lhd_train.tiny_model import build_tiny_model

    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny4") / "tiny-llama", seed=0, num_layers=4)


@pytest.fixture
def measure(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """Record a measurement: it goes on the test's CHECK line."""
    return lambda text: request.node.user_properties.append(("measure", text))


@pytest.fixture
def project() -> Callable[[str], None]:
    """Print a projection to the real model as a `PROJ` line (with LHD_CHECK_LINES=1)."""
    return lambda text: _write(f"PROJ {text}")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """One CHECK line per test of this folder, as it finishes."""
    if not LINES or not (report.when == "call" or report.skipped or report.failed):
        return
    name = report.nodeid.split("::")[-1].removeprefix("test_").split("[")[0]
    detail = "; ".join(text for key, text in report.user_properties if key == "measure")
    if report.skipped:
        status = "SKIP"
        detail = str(report.longrepr[2]).removeprefix("Skipped: ") if isinstance(report.longrepr, tuple) else detail
    elif report.failed:
        status = "FAIL"
        crash = getattr(report.longrepr, "reprcrash", None)
        why = crash.message.splitlines()[0][:400] if crash is not None and crash.message else report.when
        detail = f"{detail}; {why}" if detail else why
    else:
        status = "PASS"
    _write(f"CHECK {name}: {status} {detail} [{report.duration:.1f} s]")


@pytest.hookimpl(tryfirst=True)
def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config) -> tuple[str, str, str] | None:
    """With CHECK lines, no progress letters between them (the summary still counts every outcome)."""
    if not LINES or not report.nodeid.startswith("tests/gpu/"):
        return None
    if report.when == "call" or report.skipped or report.failed:
        return ("error" if report.failed and report.when != "call" else report.outcome), "", ""
    return None
