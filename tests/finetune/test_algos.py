"""Issue 32 item 2: one table (`config/algos.py`) maps each training algorithm to its TRL config and
trainer classes, its data formats and its recipe section; a TRL algorithm lhd does not ship becomes
one entry plus a recipe. KTO (TRL 1.16's `KTOTrainer`) is the example: it takes the paired rows `lhd
data dpo` writes (TRL unpairs them: chosen desirable, rejected undesirable), so the test trains it
on lhd's own data shape and measures what it learned with the base model and PEFT."""
from __future__ import annotations

import dataclasses
import json
import typing

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

from lhd_train.config.algos import ALGOS, PAIRS, Algo
from lhd_train.config.recipe import Recipe, load_recipe
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
            hint = typing.get_type_hints(Recipe)[name]
            assert algo.section in typing.get_args(hint), (name, hint)
        online = "reward_funcs" in trainer.__init__.__code__.co_varnames
        assert algo.online == online, name  # online: the trainer scores its own completions with rewards


def test_a_recipe_names_a_table_entry_and_only_its_own_section(tmp_path):
    dpo = RECIPES / "tiny" / "dpo-honest.yaml"
    with pytest.raises(InputError, match=r"'algo'.*unknown algorithm 'kto'.*sft, dpo, grpo"):
        load_recipe(dpo, ["algo=kto"])
    with pytest.raises(InputError, match="unknown algorithm 'kto'"):
        load_recipe(dpo, [], algo="kto")
    with pytest.raises(InputError, match=r"'sft'.*only used with algo sft \(algo is dpo\)"):
        load_recipe(dpo, ["sft.loss_on=all"])
    assert load_recipe(RECIPES / "tiny" / "sft-honest.yaml").sft is not None  # its own section, defaulted
    assert load_recipe(dpo).sft is None and load_recipe(dpo).grpo is None


def test_kto_is_one_table_entry_and_trains_on_lhds_pairs(learnable, data, tmp_path, monkeypatch):  # noqa: F811
    from lhd_train.finetune.records import read_adapter_record
    from lhd_train.finetune.trainer import train_command

    recipe = tmp_path / "kto-honest.yaml"
    recipe.write_text((RECIPES / "tiny" / "dpo-honest.yaml").read_text().replace("algo: dpo", "algo: kto"))
    with pytest.raises(InputError, match="unknown algorithm 'kto'"):
        load_recipe(recipe)
    monkeypatch.setitem(ALGOS, "kto", Algo("kto", "KTOConfig", "KTOTrainer", (PAIRS,)))
    assert load_recipe(recipe, ["trainer.desirable_weight=1.0"]).trainer == {  # checked against KTOConfig
        **load_recipe(recipe).trainer, "desirable_weight": 1.0}

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
    assert "kl" in history[0] and "rewards/chosen" in history[0]  # KTO's own logs, not DPO's
    after = margins(load(learnable, adapter))
    print(f"KTO log p(chosen)-log p(rejected): {sum(before) / 4:.2f} -> {sum(after) / 4:.2f}")
    assert all(a > b + 1.0 for a, b in zip(after, before, strict=True)), (before, after)
