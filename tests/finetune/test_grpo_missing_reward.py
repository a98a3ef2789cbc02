"""A failed judge grade is never the best score (issue 38, item 2).

A judged reward returns None for a completion whose grade failed. With several rewards TRL's
default `sum_then_normalize` adds them with nansum, so that None counts as 0: the best honesty
score (honesty is -severity/4 <= 0). lhd sets `normalize_then_sum` for several rewards (each reward
normalised within its group first: a missing one is its group's mean) and refuses the other. The
test runs TRL's own scoring (`GRPOTrainer._generate_and_score_completions`, the tiny model
generating) on one group whose first grade failed."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

GRADES = [None, -0.75, -0.5, -0.25]  # the group's honesty: the first grade failed, the others -severity/4


@pytest.fixture(scope="module")
def trainer_for(tmp_path_factory):
    """build(extra overrides) -> lhd's GRPO trainer on the tiny model with the failing-grade reward."""
    from datasets import Dataset

    from lhd_train.config.recipe import load_recipe
    from lhd_train.finetune.rewards import REWARDS, register_reward
    from lhd_train.finetune.trainer import build_trainer
    from lhd_train.tiny_model import build_tiny_model

    tmp = tmp_path_factory.mktemp("grpo-nan")
    model = build_tiny_model("llama", tmp / "model", seed=0)
    rows = [{"prompt": [{"role": "user", "content": f"Status of task {i}?"}]} for i in range(4)]
    Dataset.from_list(rows).save_to_disk(str(tmp / "data"))

    @register_reward("test_graded_honesty", replace=True)
    def graded(direction: str):
        def reward(prompts, completions, **kw):
            return [GRADES[i % len(GRADES)] for i in range(len(completions))]
        return reward

    def build(*overrides: str):
        recipe_path = ROOT / "recipes" / "tiny" / "grpo-honest.yaml"
        recipe = load_recipe(recipe_path, [
            f"model={model}", f"data.train={tmp / 'data'}", f"output_dir={tmp / 'out'}",
            "grpo.rewards=[{name: test_graded_honesty, weight: 1.0}, {name: format_length, weight: 0.2, "
            "params: {min_chars: 0, max_chars: 100000}}]", "trainer.max_completion_length=4",
            "trainer.multi_objective_aggregation=null", *overrides],  # unset: lhd's default, not the recipe's
            algo="grpo")
        return build_trainer(recipe, recipe_path)

    yield build
    REWARDS.pop("test_graded_honesty", None)


@pytest.mark.model  # builds a GRPO trainer on a tiny model
def test_a_failed_grade_scores_its_groups_mean_not_the_best(trainer_for):
    trainer, ctx = trainer_for()
    row = trainer.train_dataset[0]
    out = trainer._generate_and_score_completions([row] * len(GRADES))  # TRL's own reward aggregation
    adv = out["advantages"].tolist()
    # graded -0.75 < -0.5 < -0.25 keep their order; the failed one sits with the group's mean (-0.5),
    # below the best. Under sum_then_normalize it would be the best: nansum makes None 0 > -0.25.
    assert adv[1] < adv[2] < adv[3], adv
    assert adv[0] == pytest.approx(adv[2], abs=1e-4) and adv[0] < max(adv), adv
    assert trainer.args.multi_objective_aggregation == "normalize_then_sum"
    assert any(n.startswith("multi_objective_aggregation=normalize_then_sum") for n in ctx["notes"])


@pytest.mark.model  # builds a GRPO trainer on a tiny model
def test_sum_then_normalize_with_several_rewards_is_refused(trainer_for):
    from lhd_train.errors import InputError

    with pytest.raises(InputError, match=r"trainer.multi_objective_aggregation.*nansum.*counts as 0"):
        trainer_for("trainer.multi_objective_aggregation=sum_then_normalize")
