"""The variables of `lhd slurm render STAGE CONFIG --var key=value`: one model per stage.

`StageVars` holds what every stage takes; each stage's model adds its own variables and its own
defaults (time limit, nodes, CPUs, ...). The audit stage's `mode`, `window` and `concurrency`
default to `lhd audit`'s (`config.auditor.DEFAULT_OPTIONS`); the data and lens stages take every
option of their command as a variable, from the command's own model (`DataOptions`,
`lens.settings.FitArgs`), so a default cannot differ between the job and the command line.
`lhd slurm vars STAGE` prints a model's defaults; `stage_vars` validates `--var` values into one,
and its errors name the variable (`--var shards`) and, where there is a short list, the allowed
values."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, ConfigDict, ValidationError

from lens.settings import FitArgs
from lhd_train.config.auditor import AuditOptions
from lhd_train.config.base import StrictModel
from lhd_train.config.data import DataOptions
from lhd_train.config.flags import cli_fields
from lhd_train.errors import InputError, validation_error

STAGES = ("rollout", "audit", "data", "train", "lens", "merge")


def _whole(v: Any) -> Any:
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
        raise ValueError(f"{v!r} is not a whole number >= 0")
    return v


def _at_least_one(v: int | None) -> int | None:
    if v is not None and v < 1:
        raise ValueError("must be at least 1")
    return v


def _one_line(v: Any) -> Any:
    """A value lands on one line of a shell script: a line break (or any control character)
    would start a line of its own there, which bash runs."""
    if isinstance(v, str) and any(ord(c) < 32 or ord(c) == 127 for c in v):
        raise ValueError(f"{v!r} holds a line break or control character; a value is one line")
    return v


# Characters a value of an `#SBATCH --opt=VALUE` line may not hold: whitespace would add options of
# its own (`partition='gpu --uid=0'`), quotes, `$`, backquotes and `;` are shell syntax in a value
# that is also used in commands (`job_name` names the merge script). Constraint syntax (`&|[]`) stays.
_NOT_IN_DIRECTIVE = set(" \t\"'`$;\\<>")


def _directive(v: Any) -> Any:
    _one_line(v)
    bad = sorted(set(str(v)) & _NOT_IN_DIRECTIVE) if v is not None else []
    if bad:
        raise ValueError(f"{v!r} holds {' '.join(repr(c) for c in bad)}; an #SBATCH value is one word without "
                         "shell syntax")
    return v


def _as_list(v: Any) -> Any:
    if isinstance(v, str):  # `--var setup='module load cuda'`: one line
        v = [v]
    if not isinstance(v, list):
        raise ValueError("must be a list, e.g. [a, b]")
    for item in v:
        _one_line(item)
    return v


def _as_mapping(v: Any) -> Any:
    if not isinstance(v, dict):
        raise ValueError("must be a mapping, e.g. {NCCL_DEBUG: WARN}")
    for k, val in v.items():
        if not (isinstance(k, str) and k.isidentifier() and k.isascii()):
            raise ValueError(f"{k!r} is not an environment variable name (letters, digits, '_')")
        _one_line(val)
    return v


Whole = Annotated[int | None, BeforeValidator(_whole)]  # None: leave it to the config / the #SBATCH default
Shards = Annotated[int | None, BeforeValidator(_whole), AfterValidator(_at_least_one)]
Lines = Annotated[list[Any], BeforeValidator(_as_list)]
Exports = Annotated[dict[Any, Any], BeforeValidator(_as_mapping)]
# names, sizes and times as written (`--var time=60`, `--var account=1234`); always one line
Text = Annotated[str | int | float | None, AfterValidator(_one_line)]
Directive = Annotated[str | int | float | None, AfterValidator(_directive)]  # an #SBATCH option's value


class StageVars(StrictModel):
    """Variables every stage takes (None = leave the #SBATCH line out)."""

    job_name: Directive = None  # default lhd-<stage>-<name>
    partition: Directive = None
    account: Directive = None
    qos: Directive = None
    constraint: Directive = None
    reservation: Directive = None
    time: Directive = None  # per-stage default
    nodes: Whole = 1  # only `train` uses more than one node; the other stages spread over nodes as array tasks
    gpus_per_node: Whole = None  # default: worked out from the config
    max_gpus_per_node: Whole = 8  # GPUs a node of the partition has: a job that needs more is refused
    gpu_directive: Literal["gpus-per-node", "gres"] = "gpus-per-node"  # gres: #SBATCH --gres=gpu:N
    device: Literal["cuda", "cpu"] = "cuda"  # cpu: a partition without GPUs (no GPU lines, OMP/MKL threads = cpus)
    cpus: Whole = 16  # --cpus-per-task
    mem: Directive = "128G"
    exclusive: bool = False
    array_parallel: Whole = None  # at most this many array tasks at once (--array=0-N%K)
    logs_dir: Directive = "logs/slurm"
    workdir: Text = "${SLURM_SUBMIT_DIR}"
    setup: Lines = ["source .venv/bin/activate"]  # lines run before anything (module load ..., conda activate ...)
    hf_home: Text = None  # export HF_HOME
    offline: bool = True  # export HF_HUB_OFFLINE=1 (compute nodes: pre-download models)
    env: Exports = {}  # extra exports
    sbatch_extra: Lines = []  # extra "#SBATCH ..." options, e.g. ["--mail-type=END"]
    merge_job: bool = True  # array stages: task 0 submits the dependent merge job
    merge_time: Directive = "02:00:00"
    merge_cpus: Whole = 4
    merge_mem: Directive = "32G"
    merge_partition: Directive = None  # default: `partition`


class RolloutVars(StageVars):
    time: Directive = "24:00:00"
    shards: Shards = None  # default: min(4, trials)
    overrides: Lines = []


class AuditVars(StageVars, AuditOptions):
    """`lhd audit`'s own options (`AuditOptions`: fields, defaults and bounds declared once) plus
    where the job runs. Not frozen like the options: the renderer fills in worked-out values."""

    model_config = ConfigDict(frozen=False)

    time: Directive = "24:00:00"
    shards: Shards = 1
    auditor: Text = None
    run_dir: Text = None
    overrides: Lines = []


class DataVars(StageVars, DataOptions):
    """`lhd data bon|dpo` as a job: the command's own options (`DataOptions`: the same defaults and
    bounds, rendered as its flags) plus where it runs."""

    time: Directive = "24:00:00"
    shards: Shards = 1
    kind: Literal["bon", "dpo"] = "dpo"
    out: Text = None
    auditor: Text = None
    run_dir: Text = None
    overrides: Lines = []


class TrainVars(StageVars):
    time: Directive = "48:00:00"
    nodes: Whole = None  # default: from the accelerate config (single_gpu: 1 node x 1 GPU; zero3/fsdp2: 1 x 8)
    gpus_per_node: Whole = None
    cpus: Whole = 64
    mem: Directive = "0"
    accelerate: Text = None  # single_gpu, ddp, zero3, fsdp2 or a YAML (default: the recipe's, else single_gpu)
    algo: Text = None  # default: the recipe's
    main_port: int | None = None  # default: from the job id (PORT_FROM_JOB_ID), so jobs sharing a node differ
    rdzv_backend: Text = "c10d"
    overrides: Lines = []


class LensVars(StageVars, FitArgs):
    """`lhd lens fit` as an array job: every option of the fit (`lens.settings.FitArgs`: the same
    defaults and bounds, rendered as its flags) plus what the stage works out or names itself."""

    time: Directive = "24:00:00"
    shards: Shards = 4
    model: Text = None  # default: the config's model (a run config: the performer's)
    corpus: Text = None
    out: Text = None
    fit_args: Lines = []  # further words for `lhd lens fit`, after the rendered options
    gpus_per_node: Whole = 1
    cpus: Whole = 8
    mem: Directive = "64G"


class MergeVars(StageVars):
    time: Directive = "02:00:00"
    shards: Shards = None
    cpus: Whole = 4
    mem: Directive = "32G"
    gpus_per_node: Whole = 0


STAGE_MODELS: dict[str, type[StageVars]] = {"rollout": RolloutVars, "audit": AuditVars, "data": DataVars,
                                            "train": TrainVars, "lens": LensVars, "merge": MergeVars}


def stage_model(stage: str) -> type[StageVars]:
    if stage not in STAGE_MODELS:
        raise InputError("command line", "STAGE", f"unknown stage '{stage}'", ", ".join(STAGES))
    return STAGE_MODELS[stage]


def stage_vars(stage: str, given: dict[str, Any]) -> StageVars:
    """The variables of `stage`: its defaults with `given` (`--var` values) on top, checked."""
    model = stage_model(stage)
    known = cli_fields(model)  # a library-only knob of the lens fit (a test's stop switch) is no variable
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise InputError("command line", f"--var {unknown[0]}", f"not a variable of the '{stage}' stage",
                         ", ".join(sorted(known)))
    try:
        v = model.model_validate(given)
    except ValidationError as err:
        e = validation_error(err, "command line", model)
        raise InputError("command line", f"--var {e.field}" if e.field else "--var", e.problem, e.allowed,
                         more=len(err.errors()) - 1) from None
    if stage != "train" and v.nodes != 1:
        hint = "" if stage == "merge" else " (array tasks spread the work over nodes: --var shards=N)"
        raise InputError("command line", "--var nodes", f"{v.nodes}: a {stage} job runs on one node and "
                         f"another would sit idle{hint}", "1")
    if v.device == "cpu":
        if given.get("gpus_per_node"):
            raise InputError("command line", "--var gpus_per_node",
                             f"{given['gpus_per_node']} GPUs with device=cpu (a partition without GPUs)", "0")
        if stage == "train":
            raise InputError("command line", "--var device", "the train stage needs GPUs (accelerate with "
                             "DeepSpeed/FSDP); device=cpu is for rollout, audit, data, lens and merge", "cuda")
        v.gpus_per_node = 0
    return v
