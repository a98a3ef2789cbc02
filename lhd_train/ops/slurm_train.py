"""How many nodes and GPUs a Slurm training job takes, and the global batch that follows.

The size comes from the accelerate config the recipe names (or `--var accelerate=`): a one-process
config (`single_gpu.yaml`, `distributed_type: "NO"`) is one node and one GPU, whatever else is
asked; a DeepSpeed or FSDP config takes the nodes and GPUs the variables ask for, by default its
own `num_machines` and `num_processes`. Every process adds `per_device_train_batch_size x
gradient_accumulation_steps` rows to an optimizer step, so the script states the global batch:
a recipe tuned on one GPU that runs on 16 takes 16 times fewer steps per epoch."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lhd_train.config.algos import ALGOS
from lhd_train.errors import InputError
from lhd_train.io.files import read_yaml_mapping

ROOT = Path(__file__).resolve().parents[2]
ACCELERATE_CONFIGS = {"single_gpu": "configs/accelerate/single_gpu.yaml", "ddp": "configs/accelerate/ddp.yaml",
                      "zero3": "configs/accelerate/zero3.yaml", "fsdp2": "configs/accelerate/fsdp2.yaml"}


@dataclass
class TrainSize:
    acc_file: str  # as the job's `accelerate launch --config_file` gets it
    distributed_type: str
    nodes: int
    gpus_per_node: int
    per_device: int
    accum: int
    fsdp_checkpointing: bool  # the config does activation checkpointing itself

    @property
    def single(self) -> bool:
        return self.distributed_type == "NO"

    @property
    def processes(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def global_batch(self) -> int:
        return self.per_device * self.accum * self.processes

    def batch_line(self, algo: str) -> str:
        return (f"global batch {self.global_batch} {ALGOS[algo].unit} per optimizer step = per_device_train_batch_size "
                f"{self.per_device} x gradient_accumulation_steps {self.accum} x {self.processes} process(es)")


def _accelerate_file(recipe: dict[str, Any], source: Path, given: Any) -> tuple[str, Path, str]:
    """(the name as written, the file to read, where it came from) of the accelerate config."""
    if given is not None:
        name, origin = ACCELERATE_CONFIGS.get(str(given), str(given)), "--var accelerate"
        if str(given) not in ACCELERATE_CONFIGS and not name.endswith((".yaml", ".yml")):
            raise InputError("command line", origin, f"'{given}'",
                             ", ".join(ACCELERATE_CONFIGS) + " or a path to an accelerate YAML")
    else:  # a recipe without one is what plain `lhd train` runs: one process
        name = str(recipe.get("accelerate_config") or ACCELERATE_CONFIGS["single_gpu"])
        origin = "accelerate_config"
    path = Path(name) if Path(name).is_file() else ROOT / name
    if not path.is_file():
        raise InputError(source if origin == "accelerate_config" else "command line", origin,
                         f"accelerate config '{name}' not found", ", ".join(ACCELERATE_CONFIGS.values()))
    return name, path, origin


def _trainer_value(recipe: dict[str, Any], algo: str, key: str) -> int:
    value = (recipe.get("trainer") or {}).get(key)
    if value is None:  # TRL's default (imported only when the recipe leaves it out)
        default = next(f.default for f in dataclasses.fields(ALGOS[algo].config_class()) if f.name == key)
        if default is dataclasses.MISSING:
            raise InputError("recipe", f"trainer.{key}", "not set, and TRL gives it no default")
        value = default
    return int(value)


def train_size(recipe: dict[str, Any], source: Path, algo: str, v: dict[str, Any]) -> TrainSize:
    """The job's nodes and GPUs per node for `recipe` (read from `source`, overrides applied) and
    the variables `v` (`nodes`, `gpus_per_node`, `accelerate`; None = from the accelerate config)."""
    name, path, origin = _accelerate_file(recipe, source, v["accelerate"])
    acc = read_yaml_mapping(path, "accelerate config")
    dtype = str(acc.get("distributed_type") or "NO")
    if dtype == "NO":
        for var in ("nodes", "gpus_per_node"):
            if v[var] not in (None, 1):
                raise InputError("command line", f"--var {var}",
                                 f"{v[var]}: {name} ({origin}) runs one process on one GPU",
                                 "1, or --var accelerate=ddp|zero3|fsdp2 to train on several GPUs")
        nodes, gpn = 1, 1
    else:
        machines = int(acc.get("num_machines") or 1)
        nodes = v["nodes"] if v["nodes"] is not None else machines
        gpn = v["gpus_per_node"] if v["gpus_per_node"] is not None else max(1, int(acc.get("num_processes") or 8)
                                                                            // machines)
        if nodes < 1:
            raise InputError("command line", "--var nodes", "training needs at least one node")
        if gpn < 1:
            raise InputError("command line", "--var gpus_per_node", "training needs at least one GPU per node")
    fsdp = acc.get("fsdp_config") or {}
    zero = (acc.get("deepspeed_config") or {}).get("zero_stage")
    sharded = "FSDP" if dtype == "FSDP" else ("DeepSpeed ZeRO-3" if dtype == "DEEPSPEED" and str(zero) == "3" else None)
    if recipe.get("qlora") and sharded:
        from lhd_train.finetune.trainer_args import QLORA_SHARDED

        raise InputError(source if origin == "accelerate_config" else "command line", origin,
                         f"{name} is {sharded}, and the recipe sets qlora: true: {QLORA_SHARDED}",
                         "configs/accelerate/ddp.yaml (--var accelerate=ddp) for QLoRA on several GPUs")
    return TrainSize(name, dtype, nodes, gpn, _trainer_value(recipe, algo, "per_device_train_batch_size"),
                     _trainer_value(recipe, algo, "gradient_accumulation_steps"),
                     dtype == "FSDP" and bool(fsdp.get("fsdp_activation_checkpointing")))
