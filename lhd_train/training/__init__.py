"""LoRA fine-tuning with TRL: recipes (YAML), reward registry, `lhd train sft|dpo|grpo`.

Heavy imports (torch, transformers, trl) happen inside the functions, so importing this package is cheap.
"""
from __future__ import annotations

from lhd_train.config.recipe import Recipe, load_recipe, parse_recipe
from lhd_train.training.rewards import REWARDS, register_reward, register_reward_function

__all__ = ["Recipe", "load_recipe", "parse_recipe", "REWARDS", "register_reward", "register_reward_function",
           "train", "train_command", "ADAPTER_META"]

ADAPTER_META = "lhd_adapter.json"


def train(*args, **kwargs):
    from lhd_train.training.runner import train as _train

    return _train(*args, **kwargs)


def train_command(algo: str, recipe, overrides: list[str]):
    """`lhd train sft|dpo|grpo RECIPE [key=value ...]` → the adapter folder (see runner.train_command)."""
    from lhd_train.training.runner import train_command as _tc

    return _tc(algo, recipe, overrides)
