"""From a recipe to the arguments of TRL's config, PEFT's LoraConfig and the 4-bit config.

Device policy: without CUDA the trainer runs with use_cpu=True, bf16=False, fp16=False,
gradient_checkpointing=False and GRPO's use_vllm=False (plain transformers generation), whatever the
recipe says: TRL's defaults (bf16=True, gradient checkpointing on) fail or crawl on CPU. With CUDA the
recipe (and TRL's defaults) is kept, with two placements TRL would otherwise get wrong:
- one process on a node with several visible GPUs loads the base on the current GPU, not spread
  over all of them (TRL's `device_map="auto"` is naive model parallelism: one GPU busy at a time);
- an online algorithm with vLLM gets `vllm_max_model_length` from its section's `max_length`, so
  vLLM does not reserve the model's whole window (131072 for Llama 3.1) and refuse to start for lack of KV memory."""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path
from typing import Any

from lhd_train.config.algos import OnlineSection
from lhd_train.config.recipe import Recipe
from lhd_train.errors import InputError

# What to say when GRPO asks for vLLM in an environment without it: TRL 1.16 imports vLLM in the
# trainer process in both of its modes (colocate builds `vllm.LLM`; server mode's VLLMClient imports
# vLLM's NCCL weight-transfer helpers), so a separate vLLM environment alone is not enough.
VLLM_MISSING = ("vLLM is not importable in this environment, and TRL 1.16 needs it in the training process "
                "in both vllm_mode colocate and server (docs/training.md, 'GRPO generation'); set "
                "trainer.use_vllm=false to generate with transformers (the shipped recipes' default)")


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_dtype(recipe: Recipe, cuda: bool) -> str:
    if recipe.dtype != "auto":
        return recipe.dtype
    if not cuda:
        return "float32"
    import torch

    return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"


def single_process_device_map() -> dict[str, int] | None:
    """`{"": current GPU}` for a process started without a launcher (no WORLD_SIZE) that sees more
    than one GPU; None otherwise (one GPU, or a distributed launch, where TRL sets device_map=None)."""
    if os.environ.get("WORLD_SIZE"):
        return None
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return None
    return {"": torch.cuda.current_device()}


#: why a 4-bit base is refused under sharding launchers (issue 30, B3)
QLORA_SHARDED = ("transformers skips ZeRO-3's sharded initialisation for quantized models (each rank loads the "
                 "whole 4-bit base) and how DeepSpeed or FSDP2 then shard bitsandbytes' packed 4-bit parameters "
                 "has not been run on a device by lhd")


def sharded_launch() -> str | None:
    """The sharding launcher this process was started under (accelerate's environment): DeepSpeed
    ZeRO-3 or FSDP; None for one process, DDP or ZeRO-1/2."""
    env = os.environ
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true" and env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3":
        return "DeepSpeed ZeRO-3"
    if env.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        return f"FSDP{env.get('FSDP_VERSION', '')}"
    return None


def check_qlora_launch(recipe: Recipe, source: str) -> None:
    """QLoRA runs in one process or under DDP (configs/accelerate/ddp.yaml); under ZeRO-3 or FSDP it
    is refused before any model loads (`QLORA_SHARDED`), rather than failing or silently
    replicating the base somewhere in the first step."""
    launcher = sharded_launch()
    if recipe.qlora and launcher is not None:
        raise InputError(source, "qlora", f"a 4-bit base under {launcher} is not supported: {QLORA_SHARDED}",
                         "qlora with one process or DDP (accelerate launch --config_file configs/accelerate/ddp.yaml), "
                         "or qlora=false under ZeRO-3/FSDP2")


def trainer_arguments(recipe: Recipe, out: Path, cuda: bool, dtype: str, source: str,
                      reward_weights: list[float] | None) -> tuple[dict[str, Any], list[str]]:
    """The dict passed to the algorithm's TRL config, and the automatic adjustments made to it."""
    check_qlora_launch(recipe, source)
    args = dict(recipe.trainer)
    notes: list[str] = []

    def force(key: str, value: Any, why: str) -> None:
        if key in args and args[key] != value:
            notes.append(f"{key}={value} (recipe had {args[key]}; {why})")
        elif key not in args:
            notes.append(f"{key}={value} ({why})")
        args[key] = value

    mik = dict(args.get("model_init_kwargs") or {})
    if not cuda:
        force("use_cpu", True, "no CUDA")
        force("bf16", False, "no CUDA")
        force("fp16", False, "no CUDA")
        force("gradient_checkpointing", False, "no CUDA")
        if args.get("use_vllm"):  # a field only of the configs of trainers that generate
            force("use_vllm", False, "no CUDA: plain transformers generation")
    else:
        if dtype == "float16" and "bf16" not in args and "fp16" not in args:
            args["bf16"], args["fp16"] = False, True
            notes.append("fp16=True (dtype float16)")
        if args.get("use_vllm") and importlib.util.find_spec("vllm") is None:
            raise InputError(source, "trainer.use_vllm", VLLM_MISSING)
        placement = single_process_device_map()
        if placement is not None and "device_map" not in mik:
            mik["device_map"] = placement
            notes.append(f"model_init_kwargs.device_map={placement} (one process, several GPUs visible: the base "
                         "stays on one GPU; launch with accelerate for data parallel)")
    online = recipe.section
    if isinstance(online, OnlineSection):
        if args.get("use_vllm"):
            _size_vllm(recipe.algo, online, args, notes, source)
        if len(online.rewards) > 1:
            _missing_reward_is_the_group_mean(recipe, args, notes, source)

    for key, value in (("dtype", dtype), ("revision", recipe.revision)):
        if value is None:
            continue
        if key in mik and mik[key] != value:
            raise InputError(source, f"trainer.model_init_kwargs.{key}",
                             f"conflicts with the recipe's `{key}` ({value}); set it in one place")
        mik[key] = value
    args["model_init_kwargs"] = mik

    if reward_weights is not None:
        args["reward_weights"] = reward_weights

    if "report_to" not in args:
        args["report_to"], note = _wandb_setup(recipe, out)
        if note:
            notes.append(note)
    args.setdefault("run_name", recipe.wandb.run_name or f"{recipe.algo}-{recipe.direction}-{out.name}")
    return args, notes


SUM_THEN_NORMALIZE = ("TRL's sum_then_normalize adds the rewards with nansum, so a reward left out (None: a failed "
                      "judge grade) counts as 0, the best honesty score")


def _missing_reward_is_the_group_mean(recipe: Recipe, args: dict[str, Any], notes: list[str], source: str) -> None:
    """Several rewards: each is normalised within its group before the weighted sum
    (`normalize_then_sum`), so a completion whose grade failed gets its group's mean for that
    reward (0 after normalisation), never a score better than the graded ones."""
    config = recipe.algorithm.config_class()
    if "multi_objective_aggregation" not in {f.name for f in dataclasses.fields(config)}:  # RLOO: nansum only
        raise InputError(source, f"{recipe.algo}.rewards", f"several rewards, but {config.__name__} cannot "
                         f"normalise each within its group (no multi_objective_aggregation): {SUM_THEN_NORMALIZE}",
                         "one reward")
    how = args.get("multi_objective_aggregation")
    if how is None:
        args["multi_objective_aggregation"] = "normalize_then_sum"
        notes.append("multi_objective_aggregation=normalize_then_sum (several rewards: a failed grade counts as "
                     "its group's mean)")
    elif how != "normalize_then_sum":
        raise InputError(source, "trainer.multi_objective_aggregation",
                         f"'{how}' with several rewards: {SUM_THEN_NORMALIZE}", "normalize_then_sum")


def _size_vllm(name: str, online: OnlineSection, args: dict[str, Any], notes: list[str], source: str) -> None:
    """vLLM's window follows the section's max_length (prompt + completion) unless the recipe sets it."""
    want, have = online.max_length, args.get("vllm_max_model_length")
    if want is None:
        return
    if have is None:
        args["vllm_max_model_length"] = want
        notes.append(f"vllm_max_model_length={want} ({name}.max_length)")
    elif have < want:
        raise InputError(source, "trainer.vllm_max_model_length",
                         f"{have} is below {name}.max_length ({want}): vLLM could not hold a fitted prompt plus "
                         f"its completion; raise it or lower {name}.max_length")


def _wandb_setup(recipe: Recipe, out: Path) -> tuple[str | list[str], str | None]:
    w = recipe.wandb
    if not w.enabled or w.mode == "disabled":
        return "none", None
    if importlib.util.find_spec("wandb") is None:
        return "none", "report_to=none (wandb not installed: pip install 'lhd[wandb]')"
    os.environ["WANDB_MODE"] = "online" if w.mode == "online" else "offline"
    os.environ["WANDB_PROJECT"] = w.project
    if w.entity:
        os.environ["WANDB_ENTITY"] = w.entity
    if w.tags:
        os.environ["WANDB_TAGS"] = ",".join(w.tags)
    os.environ.setdefault("WANDB_DIR", str(out))
    return ["wandb"], None


def build_config(recipe: Recipe, out: Path, args: dict[str, Any], source: str):
    algo = recipe.algorithm
    cls = algo.config_class()
    try:
        config = cls(output_dir=str(out), **args)
    except (ValueError, TypeError) as e:
        raise InputError(source, "trainer", f"{cls.__name__} rejected the arguments: {e}") from None
    problem = algo.check_config(config) if algo.check_config is not None else None
    if problem is not None:
        raise InputError(source, f"trainer.{problem[0]}", problem[1])
    return config


def lora_config(recipe: Recipe):
    from peft import LoraConfig

    lo = recipe.lora
    return LoraConfig(
        r=lo.r,
        # peft annotates lora_alpha as int, but only divides by it; recipes allow a fractional alpha
        lora_alpha=lo.resolved_alpha(),  # type: ignore[arg-type]
        lora_dropout=lo.dropout,
        target_modules=lo.resolved_targets(),
        bias=lo.bias,
        use_rslora=lo.use_rslora,
        use_dora=lo.use_dora,
        modules_to_save=lo.modules_to_save,
        task_type="CAUSAL_LM",
    )


def quantization_config(recipe: Recipe, dtype: str, source: str):
    if not recipe.qlora:
        return None
    if importlib.util.find_spec("bitsandbytes") is None:
        raise InputError(source, "qlora",
                         "4-bit QLoRA needs bitsandbytes: pip install 'lhd[qlora]' (or set qlora=false)")
    import torch
    from transformers import BitsAndBytesConfig

    compute = getattr(torch, dtype) if dtype in ("bfloat16", "float16") else torch.bfloat16
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute,
                              bnb_4bit_use_double_quant=True, bnb_4bit_quant_storage=compute)
