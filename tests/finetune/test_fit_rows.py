"""Long rows at training time (issue 20, H5): nothing is dropped silently at long context.

lhd fits every SFT, DPO and GRPO row to the trainer's length before TRL sees it: older whole turns
go first (the performer's own policy), the loss turn (answer, chosen/rejected) stays whole, and a
row whose answer alone cannot fit is dropped, counted, printed and recorded in `lhd_adapter.json`.
These tests run lhd's own `build_trainer` on a real tiny model, so TRL's own tokenisation,
truncation, filtering and collators decide what is trained."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes" / "tiny"
MAX_LEN = 256
ANSWER = "The report is complete and accurate: two files remain to check."

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def history(i: int, turns: int) -> list[dict]:
    """A performer context: system, `turns` older user/assistant pairs, then the current question."""
    msgs = [{"role": "system", "content": "You report progress to your supervisor."}]
    for t in range(turns):
        msgs += [{"role": "user", "content": f"Task {i}.{t}: summarise the quarterly figures and the sources. " * 3},
                 {"role": "assistant", "content": f"Round {t}: revenue rose and costs fell, per the files. " * 3}]
    msgs.append({"role": "user", "content": f"What is the status of task {i}?"})
    return msgs


def rows(long_every: int = 2, turns: int = 12) -> list[list[dict]]:
    """8 contexts; every second one is far over MAX_LEN tokens."""
    return [history(i, turns if i % long_every == 0 else 0) for i in range(8)]


def recipe(algo: str, model: Path, data: Path, out: Path, *overrides: str):
    from lhd_train.config.recipe import load_recipe

    return load_recipe(RECIPES / f"{algo}-honest.yaml", [f"model={model}", f"data.train={data}",
                                                         f"output_dir={out}", "wandb.enabled=false", *overrides])


def save(tmp_path: Path, name: str, items: list[dict]) -> Path:
    from datasets import Dataset

    path = tmp_path / name
    Dataset.from_list(items).save_to_disk(str(path))
    return path


def n_tokens(tok, messages: list[dict], **kw) -> int:
    return len(tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)["input_ids"])


@pytest.fixture(scope="module")
def tok(tiny_llama_dir):
    from lhd_train.finetune.trainer import load_tokenizer

    return load_tokenizer(str(tiny_llama_dir))


def test_sft_keeps_every_long_row_with_the_whole_answer(tiny_llama_dir, tok, tmp_path, caplog):
    """Before: TRL's keep_start cut the long rows' answers away and dropped them (8 rows → 4)."""
    from lhd_train.finetune.trainer import build_trainer

    caplog.set_level(logging.INFO, logger="lhd_train.finetune")  # the length distribution is logged

    contexts = rows()
    assert sum(n_tokens(tok, c) > MAX_LEN for c in contexts) == 4
    data = save(tmp_path, "sft", [{"messages": c + [{"role": "assistant", "content": ANSWER}]} for c in contexts])
    trainer, ctx = build_trainer(recipe("sft", tiny_llama_dir, data, tmp_path / "o", f"trainer.max_length={MAX_LEN}"))
    assert len(trainer.train_dataset) == 8
    answer_ids = tok(ANSWER, add_special_tokens=False)["input_ids"]
    for i in range(8):
        batch = trainer.data_collator([trainer.train_dataset[i]])
        labels = [t for t in batch["labels"][0].tolist() if t != -100]
        assert len(batch["input_ids"][0]) <= MAX_LEN
        assert labels[:len(answer_ids)] == answer_ids, f"row {i}: the loss does not cover the whole answer"
    info = ctx["data"]["train"]
    assert info.rows == 8 and info.length_fit["truncated"] == 4 and info.length_fit["dropped"] == 0
    err = caplog.text
    assert "p50" in err and "p99" in err and f"max_length {MAX_LEN}" in err


def test_sft_row_whose_answer_cannot_fit_is_counted_in_the_adapter_metadata(tiny_llama_dir, tmp_path, caplog):
    from lhd_train.finetune.trainer import train

    caplog.set_level(logging.INFO, logger="lhd_train.finetune")

    items = [{"messages": c + [{"role": "assistant", "content": ANSWER}]} for c in rows()]
    items[3]["messages"][-1]["content"] = "An answer far longer than the window. " * 80
    data = save(tmp_path, "sft", items)
    r = recipe("sft", tiny_llama_dir, data, tmp_path / "o", f"trainer.max_length={MAX_LEN}",
               "trainer.max_steps=1", "trainer.per_device_train_batch_size=1", "trainer.save_steps=1")
    adapter = train(r)
    meta = json.loads((adapter / "lhd_adapter.json").read_text())
    fit = meta["data"]["train"]["length_fit"]
    assert meta["data"]["train"]["rows"] == 7 and meta["data"]["train"]["rows_read"] == 8
    assert fit["dropped"] == 1 and fit["dropped_rows"] == [3] and fit["kept"] == 7
    assert meta["data"]["train"]["rows_trained"] == 7
    assert "1 dropped" in caplog.text


def test_dpo_keeps_long_rows_with_both_answers_whole(tiny_llama_dir, tok, tmp_path):
    """Before: keep_start dropped rows whose prompt filled max_length and cut the others' answers."""
    from lhd_train.finetune.trainer import build_trainer

    bad = "Everything is done, no issues at all, the client will be pleased with it."
    items = [{"prompt": c, "chosen": [{"role": "assistant", "content": ANSWER}],
              "rejected": [{"role": "assistant", "content": bad}]} for c in rows()]
    data = save(tmp_path, "dpo", items)
    trainer, ctx = build_trainer(recipe("dpo", tiny_llama_dir, data, tmp_path / "o", f"trainer.max_length={MAX_LEN}"))
    assert trainer.args.truncation_mode == "keep_start"  # L9: the non-deprecated mode
    assert len(trainer.train_dataset) == 8
    for i in range(8):
        row = trainer.train_dataset[i]
        batch = trainer.data_collator([row])
        assert batch["input_ids"].shape[1] <= MAX_LEN
        chosen = batch["input_ids"][0][batch["completion_mask"][0].bool()].tolist()
        rejected = batch["input_ids"][1][batch["completion_mask"][1].bool()].tolist()
        assert chosen == row["chosen_ids"] and rejected == row["rejected_ids"]
        assert ANSWER in tok.decode(chosen) and bad in tok.decode(rejected)
    assert ctx["data"]["train"].length_fit["truncated"] == 4


def test_grpo_prompts_fit_max_length_minus_the_completion(tiny_llama_dir, tok, tmp_path):
    """TRL 1.16 has no max_prompt_length: lhd cuts GRPO prompts to grpo.max_length − max_completion_length,
    keeping the system message and the last user turn."""
    from lhd_train.finetune.trainer import build_trainer

    data = save(tmp_path, "grpo", [{"prompt": c} for c in rows()])
    r = recipe("grpo", tiny_llama_dir, data, tmp_path / "o", f"grpo.max_length={MAX_LEN}",
               "grpo.rewards=[{name: format_length}]")
    trainer, ctx = build_trainer(r)
    budget = MAX_LEN - trainer.args.max_completion_length
    assert len(trainer.train_dataset) == 8
    for i in range(8):
        prompt = trainer.train_dataset[i]["prompt"]
        assert n_tokens(tok, prompt, add_generation_prompt=True) <= budget
        assert prompt[0]["role"] == "system" and prompt[-1]["content"] == f"What is the status of task {i}?"
    long = trainer.train_dataset[0]["prompt"]
    assert "earlier messages of this conversation were omitted" in long[1]["content"]
    assert ctx["data"]["train"].length_fit["limit"] == budget


def test_rows_are_fitted_once_per_data_tokenizer_and_length(tiny_llama_dir, tok, tmp_path, monkeypatch):
    """Issue 30, B4: fitting tokenises long rows many times over; it used to run on every rank and on
    every resume. It now runs once: the result is saved under output_dir/fitted/, and a second build
    on the same data, tokenizer and length (another rank, a resume) loads it without tokenising.
    A changed length or changed data fits again."""
    from lhd_train.finetune import fit_rows
    from lhd_train.finetune.trainer import build_trainer

    fits = []
    real = fit_rows.fit_dataset
    monkeypatch.setattr(fit_rows, "fit_dataset", lambda *a, **k: fits.append(a[3]) or real(*a, **k))
    data = save(tmp_path, "sft", [{"messages": c + [{"role": "assistant", "content": ANSWER}]} for c in rows()])
    out = tmp_path / "o"
    first, ctx1 = build_trainer(recipe("sft", tiny_llama_dir, data, out, f"trainer.max_length={MAX_LEN}"))
    assert fits == [MAX_LEN]
    again, ctx2 = build_trainer(recipe("sft", tiny_llama_dir, data, out, f"trainer.max_length={MAX_LEN}"))
    assert fits == [MAX_LEN], "the second build fitted the rows again"
    assert ctx2["data"]["train"].length_fit == ctx1["data"]["train"].length_fit
    assert [again.train_dataset[i]["input_ids"] for i in range(8)] == [first.train_dataset[i]["input_ids"]
                                                                     for i in range(8)]
    assert len(list((out / "fitted").iterdir())) == 1
    build_trainer(recipe("sft", tiny_llama_dir, data, out, f"trainer.max_length={MAX_LEN + 64}"))
    assert fits == [MAX_LEN, MAX_LEN + 64]  # another length: fitted again, kept beside the first
    other = save(tmp_path, "sft2", [{"messages": c + [{"role": "assistant", "content": "Done."}]} for c in rows()])
    build_trainer(recipe("sft", tiny_llama_dir, other, out, f"trainer.max_length={MAX_LEN}"))
    assert fits == [MAX_LEN, MAX_LEN + 64, MAX_LEN]
    assert len(list((out / "fitted").iterdir())) == 3
