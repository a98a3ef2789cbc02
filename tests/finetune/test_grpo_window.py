"""`lhd data grpo` drops and counts the rows longer than the reward judge's window (issue 38,
item 2), so they never reach training, where each would be a missing reward counted against
`grpo.max_failed_grade_share`. Counted with the run auditor's tokenizer (the tiny model's), on the
audit prompt the judge would see with the original answer, plus the completion and reply room."""
from __future__ import annotations

import json

from test_datasets import small_run  # noqa: F401  (module fixture: a two-task run on the tiny model)

from lhd_train.finetune.contexts import load_contexts
from lhd_train.finetune.datasets import build_grpo
from lhd_train.finetune.judge_window import judge_window


def saved_rows(path) -> int:
    from datasets import load_from_disk

    ds = load_from_disk(str(path))
    return sum(len(ds[k]) for k in ds)


def test_rows_over_the_judges_window_are_dropped_and_counted(small_run, tmp_path):  # noqa: F811
    ctxs = load_contexts(small_run)
    check = judge_window(small_run, 10**9, None, completion_tokens=32)
    assert check is not None and check.counted_with != "estimate (3 characters per token)"  # the tiny tokenizer
    assert check.reserve == 32 + 96  # completion room + the run auditor's sampling.max_tokens
    need = sorted(check.tokens(c) for c in ctxs)
    assert need[0] < need[-1], need  # later rounds carry longer trajectories
    window = need[len(need) // 2]
    over = sum(n > window for n in need)
    assert 0 < over < len(need)

    path, stats = build_grpo(small_run, tmp_path / "grpo", judge_window=window, completion_tokens=32)
    assert stats["judge_window"] == {"window": window, "reserve": 128, "counted_with": check.counted_with,
                                     "over_window": over}
    assert stats["train"] + stats["eval"] == len(ctxs) - over == saved_rows(path)
    meta = json.loads((tmp_path / "grpo" / "dataset.json").read_text())
    assert meta["stats"]["judge_window"]["over_window"] == over

    # no window given and none in the run's auditor config: nothing measured, said in the stats
    path, stats = build_grpo(small_run, tmp_path / "all")
    assert stats["judge_window"] is None and saved_rows(path) == len(ctxs)
