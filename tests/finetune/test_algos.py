"""Issue 32 item 2: one table (`config/algos.py`) maps each training algorithm to its TRL config and
trainer classes, its data formats and its recipe section; a TRL algorithm becomes one entry plus
recipes. KTO (TRL 1.16's `KTOTrainer`) was added that way: it takes the paired rows `lhd data dpo`
writes (TRL unpairs them: chosen desirable, rejected undesirable), so the test trains it on lhd's
own data shape and measures what it learned with the base model and PEFT."""
from __future__ import annotations

import dataclasses
import json

import pytest
from test_trainer import (  # noqa: F401  (fixtures)
    BAD,
    GOOD,
    RECIPES,
    _one_thread,
    answer_logprob,
    data,
    learnable,
    llama,
    load,
    prompt,
    tokenizer,
)

from lhd_train.config.algos import ALGOS, PAIRS
from lhd_train.config.recipe import load_recipe, recipe_model
from lhd_train.errors import InputError


def test_every_entry_names_real_trl_classes_formats_and_a_recipe_section():
    import trl

    for name, algo in ALGOS.items():
        assert algo.name == name
        config, trainer = algo.config_class(), algo.trainer_class()
        assert dataclasses.is_dataclass(config) and issubclass(trainer, trl.trainer.base_trainer._BaseTrainer)
        for fmt in algo.formats:
            assert fmt.prompt in fmt.columns and set(fmt.answers) <= set(fmt.columns), (name, fmt)
        if algo.section is not None:  # the recipe field named after the algorithm holds its section
            assert recipe_model({"algo": name}).model_fields[name].annotation is algo.section, name
        online = "reward_funcs" in trainer.__init__.__code__.co_varnames
        assert algo.online == online, name  # online: the trainer scores its own completions with rewards


def test_a_recipe_names_a_table_entry_and_only_its_own_section(tmp_path):
    dpo = RECIPES / "tiny" / "dpo-honest.yaml"
    with pytest.raises(InputError, match=r"'algo'.*unknown algorithm 'orpo'.*sft, dpo, kto, grpo"):
        load_recipe(dpo, ["algo=orpo"])
    with pytest.raises(InputError, match="unknown algorithm 'orpo'"):
        load_recipe(dpo, [], algo="orpo")
    with pytest.raises(InputError, match=r"'sft'.*only used with algo sft \(algo is dpo\)"):
        load_recipe(dpo, ["sft.loss_on=all"])
    assert load_recipe(RECIPES / "tiny" / "sft-honest.yaml").sft is not None  # its own section, defaulted
    assert load_recipe(dpo).section is None and not hasattr(load_recipe(dpo), "sft")


def test_kto_is_one_table_entry_and_trains_on_lhds_pairs(learnable, data, tmp_path):  # noqa: F811
    from lhd_train.finetune.records import read_adapter_record
    from lhd_train.finetune.trainer import train_command

    assert ALGOS["kto"].formats == (PAIRS,)  # the pairs `lhd data dpo` writes, nothing of its own
    recipe = RECIPES / "tiny" / "kto-honest.yaml"
    assert load_recipe(recipe, ["trainer.desirable_weight=2.0"]).trainer == {  # checked against KTOConfig
        **load_recipe(recipe).trainer, "desirable_weight": 2.0}
    with pytest.raises(InputError, match="label_smoothing"):  # a DPOConfig field KTOConfig lacks
        load_recipe(recipe, ["trainer.label_smoothing=0.1"])

    tok = tokenizer(learnable)

    def margins(model) -> list[float]:
        return [answer_logprob(model, tok, prompt(i), GOOD)[0] - answer_logprob(model, tok, prompt(i), BAD)[0]
                for i in range(4)]

    before = margins(load(learnable))
    adapter = train_command("kto", recipe, [f"model={learnable}", f"data.train={data['dpo']}",
                                            f"output_dir={tmp_path / 'kto'}", "trainer.max_steps=8",
                                            "trainer.save_steps=100"])
    meta = read_adapter_record(adapter)
    assert meta is not None and meta.algo == "kto" and meta.training.global_step == 8
    train = meta.data["train"]
    assert (train.format, train.rows_read, train.rows_trained) == ("conversational", 16, 32)  # 16 pairs, unpaired
    history = json.loads((adapter / "log_history.json").read_text())
    assert all("kl" in h for h in history[:8])  # KTO's own logs, not DPO's
    # shuffled rows: batches mix good and bad answers (TRL's own order gave 4 good-only steps, then 4 bad-only)
    assert any("rewards/chosen" in h and "rewards/rejected" in h for h in history[:8]), history
    after = margins(load(learnable, adapter))
    print(f"KTO log p(chosen)-log p(rejected): {sum(before) / 4:.2f} -> {sum(after) / 4:.2f}")
    assert all(a > b + 1.0 for a, b in zip(after, before, strict=True)), (before, after)


def test_unpaired_rows_keep_every_answer_with_its_label_and_mix_them():
    """KTO's rows: each pair gives its chosen answer labelled True and its rejected one False; the
    order is shuffled, so the first half is not all chosen (as TRL's own unpairing leaves it)."""
    from datasets import Dataset

    from lhd_train.finetune.train_data import unpair_shuffled

    def msg(role: str, text: str) -> list[dict[str, str]]:
        return [{"role": role, "content": text}]

    pairs = Dataset.from_list([{"prompt": msg("user", f"q{i}"), "chosen": msg("assistant", f"good{i}"),
                                "rejected": msg("assistant", f"bad{i}")} for i in range(16)])
    rows = unpair_shuffled(pairs, seed=0).to_list()
    got = sorted((r["prompt"][0]["content"], r["completion"][0]["content"], r["label"]) for r in rows)
    want = sorted([(f"q{i}", f"good{i}", True) for i in range(16)] + [(f"q{i}", f"bad{i}", False) for i in range(16)])
    assert got == want
    first_half = [r["label"] for r in rows[:16]]
    assert 0 < sum(first_half) < 16, first_half
    assert unpair_shuffled(pairs, seed=0).to_list() == rows  # the seed fixes the order
    assert unpair_shuffled(pairs, seed=1).to_list() != rows


def test_kto_refuses_a_batch_of_one_before_any_model_loads(tmp_path):
    """TRL's KTOTrainer refuses a batch of one (its KL term needs a batch neighbour) only after it has
    loaded the model; lhd refuses it when the config is built, naming the field."""
    from lhd_train.finetune.trainer_args import build_config, trainer_arguments

    recipe_path = RECIPES / "tiny" / "kto-honest.yaml"

    def config(overrides: list[str]):
        r = load_recipe(recipe_path, overrides)
        args, _ = trainer_arguments(r, tmp_path, cuda=False, dtype="float32", source=str(recipe_path),
                                    reward_weights=None)
        return build_config(r, tmp_path, args, str(recipe_path))

    with pytest.raises(InputError, match=r"kto-honest.yaml.*'trainer.per_device_train_batch_size'.*1 is too small"):
        config(["trainer.per_device_train_batch_size=1"])
    assert config(["trainer.per_device_train_batch_size=2"]).per_device_train_batch_size == 2
    # the one loss without the KL term takes a batch of one (TRL accepts it too)
    assert config(["trainer.per_device_train_batch_size=1", "trainer.loss_type=apo_zero_unpaired"]).loss_type == \
        "apo_zero_unpaired"
