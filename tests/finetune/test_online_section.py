"""Issue 37 item 5: the online path is found by the recipe's section (`recipe.section`, an
`OnlineSection`), never by GRPO's name. A second online algorithm, TRL's RLOO, defined here and
nowhere in lhd (a table entry, a section class, a recipe), is accepted by the config, trained
through the online path (its rewards called on its completions) and recorded under its own section."""
from __future__ import annotations

import json

import pytest
import yaml
from test_trainer import RECIPES, _one_thread, data, llama, logged  # noqa: F401  (fixtures)

from lhd_train.config.algos import ALGOS, PROMPTS, Algo, OnlineSection
from lhd_train.config.recipe import load_recipe
from lhd_train.errors import InputError
from lhd_train.finetune.rewards import REWARDS, register_reward


class RlooSection(OnlineSection):
    """RLOO's section: the online settings only (its own knobs are RLOOConfig's, under `trainer:`)."""


@pytest.fixture
def rloo(monkeypatch, tmp_path):
    """The table entry and a recipe for RLOO, built from the tiny GRPO recipe."""
    monkeypatch.setitem(ALGOS, "rloo", Algo("rloo", "RLOOConfig", "RLOOTrainer", (PROMPTS,), section=RlooSection,
                                            unit="completions"))
    raw = yaml.safe_load((RECIPES / "tiny" / "grpo-honest.yaml").read_text())
    raw["algo"], raw["rloo"] = "rloo", {"rewards": [{"name": "format_length"}], "max_length": 256}
    del raw["grpo"], raw["trainer"]["multi_objective_aggregation"]
    path = tmp_path / "rloo-honest.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_second_online_algorithm_is_its_table_entry_a_section_and_a_recipe(rloo):
    r = load_recipe(rloo)
    assert ALGOS["rloo"].online and isinstance(r.section, RlooSection) and r.section.max_length == 256
    assert r.model_dump(mode="json")["rloo"]["rewards"][0]["name"] == "format_length"  # the YAML shape, kept
    with pytest.raises(InputError, match=r"'rloo.max_length'.*>= 2"):
        load_recipe(rloo, ["rloo.max_length=1"])
    with pytest.raises(InputError, match=r"'trainer.multi_objective_aggregation'.*not an argument of RLOOConfig"):
        load_recipe(rloo, ["trainer.multi_objective_aggregation=normalize_then_sum"])
    with pytest.raises(InputError, match=r"'grpo'.*only used with algo grpo \(algo is rloo\)"):
        load_recipe(rloo, ["grpo.max_length=64"])
    grpo = load_recipe(RECIPES / "tiny" / "grpo-honest.yaml")
    assert not hasattr(grpo, "rloo") and type(grpo.section).__name__ == "GrpoSpec"


def test_the_second_online_algorithm_trains_through_the_online_path(rloo, llama, data, tmp_path):  # noqa: F811
    from lhd_train.finetune.trainer import train_command

    base = [f"model={llama}", f"data.train={data['grpo']}", f"output_dir={tmp_path / 'out'}",
            "trainer.max_steps=2", "trainer.max_completion_length=8", "trainer.save_steps=100"]
    # the errors name the recipe's own section, and what RLOO's TRL trainer lacks
    with pytest.raises(InputError, match=r"'rloo.rewards'.*unknown reward 'nope'"):
        train_command("rloo", rloo, [*base, "rloo.rewards=[{name: nope}]"])
    with pytest.raises(InputError, match=r"'rloo.rewards'.*RLOOConfig cannot normalise each within its group"):
        train_command("rloo", rloo, [*base, "rloo.rewards=[{name: format_length}, {name: from_column, params: "
                                            "{column: score}}]"])
    with pytest.raises(InputError, match=r"'rloo.vllm_server'.*RLOOTrainer takes no rollout_func"):
        train_command("rloo", rloo, [*base, "rloo.vllm_server={device: cpu}"])

    calls = []

    @register_reward("test_rloo_probe", replace=True)
    def probe(direction: str):
        def reward(prompts, completions, completion_ids, **kw):
            calls.append(len(completions))
            return [float(len(ids) % 2) for ids in completion_ids]

        return reward

    try:
        adapter = train_command("rloo", rloo, [*base, "rloo.rewards=[{name: test_rloo_probe}]"])
    finally:
        REWARDS.pop("test_rloo_probe", None)
    meta = json.loads((adapter / "lhd_adapter.json").read_text())
    assert meta["algo"] == "rloo" and meta["training"]["global_step"] == 2
    assert meta["recipe"]["rloo"]["rewards"] == [{"name": "test_rloo_probe", "weight": 1.0, "params": {}}]
    assert calls and calls[0] == 4  # one prompt's 4 generations scored by the section's reward
    assert len(logged(adapter, "rewards/test_rloo_probe/mean")) == 2
    # the prompts were fitted to rloo.max_length less the completion's room, as GRPO's are
    assert meta["data"]["train"]["length_fit"]["max_length"] == 256


def test_a_resume_may_move_the_sections_judges_but_not_change_its_rewards(rloo):
    """The fields a resume may change come from the section (`OnlineSection.RESUME_FREE`), under the
    recipe's own section name; a record written before sections were one field (`sft: null`,
    `grpo: null` beside the own section) compares equal."""
    from lhd_train.config.recipe import dump_recipe
    from lhd_train.finetune.resume_rules import recipe_changes

    for path, name in ((RECIPES / "tiny" / "grpo-honest.yaml", "grpo"), (rloo, "rloo")):
        before = dump_recipe(load_recipe(path))
        moved = dump_recipe(load_recipe(path, [f"{name}.judge.base_url=http://127.0.0.1:9/v1",
                                               f"{name}.judge.model=j", f"{name}.max_failed_grade_share=0.5"]))
        assert [c[0] for c in recipe_changes(before, moved)] == [f"{name}.judge.model"]
        changed = dump_recipe(load_recipe(path, [f"{name}.max_length=128"]))
        assert recipe_changes(before, changed) == [(f"{name}.max_length", 256 if name == "rloo" else None, 128)]
        assert recipe_changes({**before, "sft": None, "dpo": None}, before) == []
