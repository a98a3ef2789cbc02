"""Training recipes: YAML → a typed `Recipe`, `key.sub=value` overrides, errors naming file and field.

A recipe says which base model to adapt, with which data, in which direction (honest or deceptive),
with which LoRA shape and which TRL trainer arguments. `trainer:` is passed to the algorithm's TRL
config (`config.algos`) after its keys are checked against that dataclass's fields and its values
against their declared types (so `learning_rate: 1e-4`, which YAML reads as a string, becomes a float).
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, TypeAdapter, ValidationError, create_model, field_validator, model_validator

from lhd_train.config.algos import ALGOS, Algo
from lhd_train.config.base import StrictModel, read_config, validate
from lhd_train.config.vocab import Direction
from lhd_train.errors import InputError

# The projection layers of Llama, Qwen2 and Qwen3 decoder blocks (same names in all three).
# vLLM 0.32's largest --max-lora-rank (vllm/config/lora.py); lhd's managed server sets --max-lora-rank from the
# adapters' own r (rollouts/vllm/server.py lora_rank), so any r up to this one can be served.
VLLM_MAX_LORA_RANK = 512
LLAMA_QWEN_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TARGET_PRESETS: dict[str, list[str] | str] = {
    "all-linear": "all-linear",
    "llama": LLAMA_QWEN_TARGETS,
    "qwen": LLAMA_QWEN_TARGETS,
    "attention": ["q_proj", "k_proj", "v_proj", "o_proj"],
}

# Trainer arguments the recipe sets through its own fields; setting them under `trainer:` is an error.
RESERVED_TRAINER_KEYS: dict[str, str] = {
    "output_dir": "use the top-level `output_dir`",
    "resume_from_checkpoint": "resuming is automatic; use the top-level `resume: false` to start over",
    "assistant_only_loss": "use `sft.loss_on: assistant`",
    "completion_only_loss": "use `sft.loss_on: last_turn` (or `all`)",
    "reward_weights": "give each reward's `weight` under the algorithm's section (`grpo.rewards`)",
}


class LoraSpec(StrictModel):
    r: int = Field(16, ge=1, le=1024, description="LoRA rank")
    alpha: float | None = Field(None, gt=0, description="lora_alpha; default 2*r")
    dropout: float = Field(0.05, ge=0, lt=1)
    target_modules: str | list[str] = Field(
        "all-linear",
        description="'all-linear' (every Linear except lm_head), a preset (llama, qwen, attention) or a list of names",
    )
    bias: Literal["none", "all", "lora_only"] = "none"
    use_rslora: bool = False
    use_dora: bool = False
    modules_to_save: list[str] | None = None
    for_vllm: bool = Field(
        True, description="the adapter will be served by vLLM (lhd run adapters:): refuse the settings vLLM 0.32 "
        "rejects when it loads an adapter (DoRA, bias, modules_to_save, r above its largest max_lora_rank 512)")

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, str) and v not in TARGET_PRESETS:
            raise ValueError(f"'{v}' is not a preset (allowed: {', '.join(TARGET_PRESETS)}, or a list of module names)")
        if isinstance(v, list) and not v:
            raise ValueError("the list is empty")
        return v

    @model_validator(mode="after")
    def _vllm_loads_it(self) -> LoraSpec:
        """vLLM refuses these at adapter load (vllm/lora/peft_helper.py `_validate_features`,
        `validate_legal`), which kills a managed server at start-up: refuse them at training instead."""
        if not self.for_vllm:
            return self
        bad = []
        if self.use_dora:
            bad.append("use_dora: vLLM does not support DoRA")
        if self.bias != "none":
            bad.append(f"bias: vLLM supports only 'none' (got '{self.bias}')")
        if self.modules_to_save:
            bad.append(f"modules_to_save: vLLM loads none for a causal LM (got {self.modules_to_save})")
        if self.r > VLLM_MAX_LORA_RANK:
            bad.append(f"r: {self.r} is above vLLM's largest --max-lora-rank ({VLLM_MAX_LORA_RANK})")
        if bad:
            raise ValueError("; ".join(bad) + ". Set lora.for_vllm=false for an adapter only PEFT/transformers "
                             "will load")
        return self

    def resolved_alpha(self) -> float:
        return self.alpha if self.alpha is not None else 2.0 * self.r

    def resolved_targets(self) -> str | list[str]:
        return (TARGET_PRESETS[self.target_modules] if isinstance(self.target_modules, str)
                else list(self.target_modules))


class DataSpec(StrictModel):
    train: str = Field(description="a `datasets` folder (save_to_disk) or a .jsonl file")
    eval: str | None = Field(None, description="optional evaluation set, same formats")
    train_split: str = Field("train", description="split to use when `train` is a DatasetDict folder")
    eval_split: str | None = Field(
        None, description="split for `eval` (default: eval, validation or test, whichever the folder has)"
    )


class WandbSpec(StrictModel):
    enabled: bool = Field(True, description="log to wandb when it is installed (report_to=none otherwise)")
    project: str = "lhd"
    entity: str | None = None
    mode: Literal["offline", "online", "disabled"] = Field("offline", description="WANDB_MODE; offline by default")
    run_name: str | None = None
    tags: list[str] = Field(default_factory=list)


class Recipe(StrictModel):
    algo: str = Field(description="a training algorithm of `config.algos.ALGOS`: sft, dpo, kto, grpo")
    model: str = Field(description="base model: local folder or hub id")
    revision: str | None = Field(None, description="hub revision (commit, tag or branch) of the base model")
    tokenizer: str | None = Field(None, description="tokenizer folder or id; default: the model's")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="weights dtype; auto: bfloat16 on CUDA, float32 on CPU"
    )
    direction: Direction
    data: DataSpec
    output_dir: str
    resume: bool = Field(True, description="continue from the last checkpoint-* in output_dir")
    lora: LoraSpec = Field(default_factory=LoraSpec)
    qlora: bool = Field(False, description="load the base in 4-bit nf4 (bitsandbytes, extra `qlora`)")
    trainer: dict[str, Any] = Field(default_factory=dict, description="arguments of the algorithm's TRL config")
    wandb: WandbSpec = Field(default_factory=WandbSpec)
    accelerate_config: str | None = Field(
        None, description="accelerate config for multi-GPU launches (informational here; used by slurm scripts)"
    )
    notes: str | None = None

    @field_validator("algo")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in ALGOS:
            raise ValueError(f"unknown algorithm '{v}' (allowed: {', '.join(ALGOS)})")
        return v

    @model_validator(mode="before")
    @classmethod
    def _only_own_section(cls, data: Any) -> Any:
        """A section named after another algorithm is refused; an empty own section is its defaults."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for name, algo in ALGOS.items():
            if algo.section is None or name not in data:
                continue
            if data[name] is None:  # `grpo:` with nothing under it, or a null an older record wrote
                del data[name]
            elif name != data.get("algo"):
                raise ValueError(f"{name}: this section is only used with algo {name} (algo is {data.get('algo')})")
        return data

    @property
    def algorithm(self) -> Algo:
        return ALGOS[self.algo]

    @property
    def section(self) -> StrictModel | None:
        """The algorithm's own settings (`sft:`, `grpo:`): the field `recipe_model` adds, named after it."""
        return getattr(self, self.algo) if self.algorithm.section is not None else None


@functools.cache
def _with_section(name: str, section: type[StrictModel]) -> type[Recipe]:
    model: type[Recipe] = create_model(f"Recipe[{name}]", __base__=Recipe,
                                       **{name: (section, Field(default_factory=section))})  # type: ignore[call-overload]
    return model


def recipe_model(data: Any) -> type[Recipe]:
    """The Recipe model for `data`: its algorithm's section a field named after the algorithm, so the
    YAML keeps `grpo:` and a bad field inside it is named `grpo.<field>`."""
    name = data.get("algo") if isinstance(data, dict) else None
    algo = ALGOS.get(name) if isinstance(name, str) else None
    return Recipe if algo is None or algo.section is None else _with_section(algo.name, algo.section)


@functools.cache
def _config_fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints.get(f.name) for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")}


def check_trainer_args(algo: str, args: dict[str, Any], source: str) -> dict[str, Any]:
    """Keys must be fields of the algo's TRL config and values must fit their declared types.

    Returns the arguments with values coerced to those types (e.g. the string '1e-4' to 0.0001)."""
    cls = ALGOS[algo].config_class()
    fields = _config_fields(cls)
    out: dict[str, Any] = {}
    for key, value in args.items():
        if key in RESERVED_TRAINER_KEYS:
            raise InputError(source, f"trainer.{key}",
                             f"set by the recipe, not under trainer: {RESERVED_TRAINER_KEYS[key]}")
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            raise InputError(source, f"trainer.{key}", f"not an argument of {cls.__name__}{hint}")
        hint_type = fields[key]
        if hint_type is None or value is None:
            out[key] = value
            continue
        try:
            adapter = TypeAdapter(hint_type)
        except Exception:  # an annotation pydantic cannot build: pass the value through unchecked
            out[key] = value
            continue
        try:
            coerced = adapter.validate_python(value)
            out[key] = value if _same(coerced, value) else coerced  # keep 1 as 1, "constant" as a str
        except ValidationError as e:
            msg = e.errors()[0]["msg"]
            raise InputError(source, f"trainer.{key}",
                             f"{value!r} does not fit {cls.__name__}.{key} ({hint_type}): {msg}") from None
    return out


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return False


#: Trainer arguments whose types let through values that train nothing or diverge: the test each
#: value must pass and what is allowed (TRL takes `max_steps: 0` and a negative learning rate).
TRAINER_BOUNDS: dict[str, tuple[Any, str]] = {
    "max_steps": (lambda v: v == -1 or v >= 1, "-1 (train num_train_epochs) or a whole number >= 1"),
    "learning_rate": (lambda v: v > 0, "a number > 0"),
    "num_train_epochs": (lambda v: v > 0, "a number > 0"),
    "per_device_train_batch_size": (lambda v: v >= 1, "a whole number >= 1"),
    "gradient_accumulation_steps": (lambda v: v >= 1, "a whole number >= 1"),
}


def check_trainer_bounds(args: dict[str, Any], source: str) -> None:
    for key, (ok, allowed) in TRAINER_BOUNDS.items():
        if key in args and args[key] is not None and not ok(args[key]):
            raise InputError(source, f"trainer.{key}", f"{args[key]!r} is out of range", allowed)


def parse_recipe(data: dict[str, Any], source: str | Path) -> Recipe:
    recipe = validate(recipe_model(data), data, source)
    recipe.trainer = check_trainer_args(recipe.algo, recipe.trainer, str(source))
    check_trainer_bounds(recipe.trainer, str(source))
    return recipe


def load_recipe(path: str | Path, overrides: list[str] | None = None, algo: str | None = None) -> Recipe:
    """Read a recipe, apply `key.sub=value` overrides, validate. `algo` (from the command line) must agree."""
    path = Path(path)
    data = read_config(path, overrides, "recipe file")
    if algo is not None:
        if algo not in ALGOS:
            raise InputError("command line", "algo", f"unknown algorithm '{algo}'", ", ".join(ALGOS))
        if data.get("algo") is None:
            data["algo"] = algo
        elif data["algo"] != algo:
            raise InputError(path, "algo", f"the recipe is for '{data['algo']}' but `lhd train {algo}` was asked for")
    return parse_recipe(data, path)


def dump_recipe(recipe: Recipe) -> dict[str, Any]:
    return recipe.model_dump(mode="json")
