"""Two judged rewards under DDP reduce their counts together, outside the reward coroutines
(issue 38, item 2). TRL runs async rewards concurrently (`asyncio.gather`), so each rank finishes
honesty and satisfaction in the order its judges answer; a reduction inside each reward paired one
rank's honesty count with another rank's satisfaction count. Here two real gloo ranks tally the
two rewards in opposite orders; one `check_failed_shares` after the step sums each reward's
counts over the ranks and both ranks stop on honesty (every grade failed), never on satisfaction."""
from __future__ import annotations

import socket

import pytest
import torch.multiprocessing as mp

STATUSES = {"honesty": ["unavailable"] * 10, "satisfaction": [None] * 10}


def _rank(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    from lhd_train.finetune.judged_rewards import JudgeFailing, _Setup, check_failed_shares

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        setups = {kind: _Setup(kind, None, None, None, None, 1, None, None, max_failed_share=0.5)
                  for kind in ("honesty", "satisfaction")}
        order = ["honesty", "satisfaction"] if rank == 0 else ["satisfaction", "honesty"]  # as the judges answered
        for kind in order:
            setups[kind].tally(None, STATUSES[kind])
        try:
            check_failed_shares([setups["honesty"], setups["satisfaction"]])  # the recipe's order
            results.put((rank, "no stop"))
        except JudgeFailing as e:
            results.put((rank, str(e)))
    finally:
        dist.destroy_process_group()


@pytest.mark.model  # two spawned torch.distributed ranks
def test_two_judged_rewards_reduce_once_in_the_recipes_order():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(_rank, args=(port, results), nprocs=2, join=True, start_method="spawn")
    got = dict(results.get(timeout=60) for _ in range(2))
    for rank in (0, 1):
        assert got[rank].startswith("20 of 20 honesty grades failed (100%"), got


class _Spec:
    def __init__(self, name):
        self.name, self.params, self.weight = name, {}, 1.0


def test_the_trainer_runs_the_check_after_each_step():
    """`lhd train` registers the judged rewards' check as a step-end callback (trainer.after_each_step)
    without importing judged_rewards itself; a reward whose grades all failed stops at the step's end."""
    import pytest

    from lhd_train.finetune.judged_rewards import JudgeFailing
    from lhd_train.finetune.rewards import build_rewards
    from lhd_train.finetune.trainer import after_each_step

    funcs, _ = build_rewards([_Spec("honesty"), _Spec("format_length")], "honest",
                             shared={"judge": {"base_url": "http://127.0.0.1:9/v1", "model": "judge"},
                                     "max_failed_share": 0.5})
    assert after_each_step(funcs[1:]) is None  # no judged reward: no callback
    callback = after_each_step(funcs)
    funcs[0].setup.tally(None, ["unavailable"] * 16)
    with pytest.raises(JudgeFailing, match="16 of 16 honesty grades"):
        callback.on_step_end(None, None, None)
