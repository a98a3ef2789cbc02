"""Long rows are fitted before the process group starts, never behind a barrier (issue 38, item 2).

Rank 0 used to fit every long row under accelerate's `main_process_first` while ranks 1-7 waited
in a barrier bounded by `ddp_timeout` (30 min): a data set with ~1,000 long rows killed the job
before the fitted cache was saved, on every resubmission. Now:
- `lhd train ... --fit-only` fits and saves in one process without loading the model (the Slurm
  job runs it before `srun accelerate launch`), and training then loads what it saved;
- a distributed launch that finds no cache fits in every rank at once, with no collective: two
  real gloo ranks whose fitting takes longer than the group's timeout both reach the next
  collective (here a barrier, as DDP's first broadcast would be) in time."""
from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S, FIT_S = 3, 6  # the group's timeout, and how long fitting takes in the second test


def rows(n: int, words: int) -> list[dict]:
    text = " ".join(f"report{i % 50} units" for i in range(words))
    return [{"messages": [{"role": "system", "content": "You report."}, {"role": "user", "content": text},
                          {"role": "assistant", "content": "Done."}]} for _ in range(n)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from lhd_train.tiny_model import build_tiny_model

    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "m", seed=0)


@pytest.mark.model  # loads a tiny model
def test_fit_only_saves_what_training_loads(tiny, tmp_path, monkeypatch):
    from datasets import Dataset

    from lhd_train.finetune import fit_rows
    from lhd_train.finetune.trainer import train_command

    Dataset.from_list(rows(6, 400)).save_to_disk(str(tmp_path / "data"))
    args = [f"model={tiny}", f"data.train={tmp_path / 'data'}", f"output_dir={tmp_path / 'out'}",
            "trainer.max_length=128"]
    folder = train_command("sft", ROOT / "recipes" / "tiny" / "sft-honest.yaml", args, fit=True)
    saved = sorted(p.name.split("-")[0] for p in folder.iterdir())
    assert saved == ["train"] and (next(folder.iterdir()) / "rows").is_dir()  # rows were cut: saved

    def refit(*a, **k):
        raise AssertionError("fitted again instead of loading the saved rows")

    monkeypatch.setattr(fit_rows, "fit_dataset", refit)
    data = train_command("sft", ROOT / "recipes" / "tiny" / "sft-honest.yaml", args, fit=True)
    assert data == folder  # the second process loaded what the first saved


def _rank(rank: int, port: int, tiny: str, out: str, results) -> None:
    import os
    from datetime import timedelta

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch.distributed as dist
    from accelerate import PartialState
    from datasets import Dataset

    from lhd_train.config.algos import ALGOS
    from lhd_train.finetune import fit_rows
    from rollouts.tokenizer import load_tokenizer

    state = PartialState(cpu=True, backend="gloo", timeout=timedelta(seconds=TIMEOUT_S))
    real = fit_rows.fit_dataset

    def slow(*a, **k):  # the long rows of a real data set: longer than the group's timeout
        time.sleep(FIT_S)
        return real(*a, **k)

    fit_rows.fit_dataset = slow
    try:
        ds = Dataset.from_list(rows(4, 300))
        fmt = ALGOS["sft"].format_named("messages")
        fit_rows.fit_once(ds, fmt, load_tokenizer(tiny), 128, 0, "train", Path(out), "digest")
        dist.barrier()  # the next collective (DDP's first broadcast)
        results.put((rank, "ok", state.num_processes))
    except Exception as e:  # noqa: BLE001  (reported to the test, which names it)
        results.put((rank, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}", state.num_processes))
    finally:
        dist.destroy_process_group()


@pytest.mark.model  # loads a tiny model
def test_no_rank_waits_behind_a_barrier_while_rows_are_fitted(tiny, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").Queue()
    mp.start_processes(_rank, args=(port, str(tiny), str(tmp_path / "out"), results), nprocs=2, join=True,
                       start_method="spawn")
    got = sorted(results.get(timeout=60) for _ in range(2))
    assert got == [(0, "ok", 2), (1, "ok", 2)], got
    assert len(list((tmp_path / "out" / "fitted").iterdir())) == 1  # rank 0 saved it, once
