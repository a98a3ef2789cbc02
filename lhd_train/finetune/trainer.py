"""`lhd train ALGO RECIPE [key=value ...]`: a TRL trainer with a LoRA adapter, resumable.

The algorithm's TRL classes, data formats and recipe section come from its table entry
(`config.algos`); this module builds any of them the same way.

Writes into the recipe's `output_dir`:
    checkpoint-<step>/      TRL/transformers checkpoints (adapter, optimizer, scheduler, RNG, trainer state)
    lhd_run.json            what this output dir is being trained on: recipe, base model files, data
                            digests (a resume that changes any of them is refused: `resume_rules`)
    adapter/                the final LoRA adapter + tokenizer + lhd_adapter.json + log_history.json
    fitted/                 each split fitted to the trainer's length, once (`fit_rows.fit_once`)

Device policy and TRL arguments: `trainer_args`. Rows are fitted to the trainer's length before TRL
sees them (`fit_rows`): nothing is dropped silently at long context."""
from __future__ import annotations

import inspect
import json
import logging
import math
import os
import time
from collections.abc import Sized
from pathlib import Path
from typing import Any, Literal, TypedDict

from lhd_train.config.algos import PROMPT_COMPLETION, OnlineSection, SftSpec
from lhd_train.config.recipe import Recipe, dump_recipe, load_recipe
from lhd_train.errors import InputError
from lhd_train.finetune import train_data as data_mod
from lhd_train.finetune.checkpoints import resume_checkpoint
from lhd_train.finetune.fit_rows import FITTED_DIR, fit_once
from lhd_train.finetune.lineage import adapter_lineage, dataset_lineage
from lhd_train.finetune.records import (
    ADAPTER_RECORD,
    ADAPTER_SCHEMA,
    AdapterRecord,
    SplitInfo,
    TrainingInfo,
    write_adapter_record,
)
from lhd_train.finetune.resume_rules import recipe_changes
from lhd_train.finetune.rewards import build_rewards, check_reward_columns, preflight_rewards
from lhd_train.finetune.trainer_args import (  # noqa: F401  (re-exported: tests and tools import them from here)
    build_config,
    cuda_available,
    lora_config,
    quantization_config,
    resolve_dtype,
    trainer_arguments,
)
from lhd_train.io.files import write_json_atomic
from lhd_train.io.provenance import package_versions, python_version, utc_now
from rollouts.model_files import changed_parts, weights_fingerprint

ADAPTER_SUBDIR = "adapter"
RUN_META = "lhd_run.json"
log = logging.getLogger(__name__)


class TrainingData(TypedDict):
    """The recipe's datasets in the trainer's format (`load_data`), with their provenance."""

    train: Any  # a datasets.Dataset
    eval: Any  # a datasets.Dataset, or None
    loss_on: str | None  # the sft section's: assistant | last_turn (after the fallbacks); None without one
    info: dict[str, SplitInfo]  # split -> path, rows, format, sha256, length_fit, ... (-> lhd_adapter.json)


class TrainingContext(TypedDict):
    """What `build_trainer` resolved, for the resume checks and the adapter's metadata."""

    out: Path
    cuda: bool
    dtype: str
    model: str  # an absolute folder or a hub id
    tokenizer: str  # the same, or the recipe's own `tokenizer:`
    data: dict[str, SplitInfo]  # TrainingData.info
    args: dict[str, Any]  # the trainer config's arguments, as JSON
    loss_on: str | None
    notes: list[str]  # adjustments made to the recipe (no CUDA, no wandb, ...)
    source: str
    recipe_path: Path | None


# ----------------------------------------------------------------------------- model and tokenizer


def resolve_model(name: str, recipe_path: Path | None, field: str = "model", source: str | None = None) -> str:
    """A local folder (`train_data.resolve_path`'s rule) as an absolute path; else a hub id."""
    p = data_mod.resolve_path(name, recipe_path, field, source or str(recipe_path or "recipe"), must_exist=False)
    if p.exists():
        return str(p.resolve())
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise InputError(source or str(recipe_path or "recipe"), field,
                         f"'{name}' is neither an existing folder nor a hub id (owner/name)")
    return name


def _check_model_files(model: str, source: str, need_tokenizer: bool) -> None:
    """A local model folder that cannot load (cut weights, torn config.json, no tokenizer) is
    named in one line before TRL loads it, which would fail minutes later or with a traceback."""
    from rollouts.backend import BackendError
    from rollouts.model_files import check_model_dir

    try:
        check_model_dir(model, need_tokenizer=need_tokenizer)
    except BackendError as e:
        raise InputError(source, "model", str(e)) from None


def load_tokenizer(name: str, revision: str | None = None, source: str = "recipe", field: str = "tokenizer") -> Any:
    """The tokenizer the folder saved (`rollouts.tokenizer`'s one rule, the one generation used), with
    a pad token: the Llama-3 reserved pad when the vocabulary has it, else eos."""
    from rollouts.tokenizer import load_tokenizer as load_saved_tokenizer

    try:
        tok = load_saved_tokenizer(name, revision)
    except (OSError, ValueError) as e:
        raise InputError(source, field, f"cannot load a tokenizer from '{name}': {e}") from None
    if tok.pad_token is None:
        vocab = tok.get_vocab()
        tok.pad_token = "<|finetune_right_pad_id|>" if "<|finetune_right_pad_id|>" in vocab else tok.eos_token
    return tok


def template_supports_assistant_mask(tok) -> bool:
    """True when TRL's assistant_only_loss can work: {% generation %} markers, or a template TRL can patch."""
    from trl.chat_template_utils import get_training_chat_template

    if not tok.chat_template:
        return False
    try:
        get_training_chat_template(tok)
    except ValueError:
        return False
    return True


# ----------------------------------------------------------------------------- data


def load_data(recipe: Recipe, recipe_path: Path | None, source: str, tok: Any) -> TrainingData:
    """Train/eval datasets in the trainer's format, with provenance (paths, row counts, sha256)."""
    algo = recipe.algorithm
    loss_on = recipe.section.loss_on if isinstance(recipe.section, SftSpec) else None
    if loss_on == "assistant" and not template_supports_assistant_mask(tok):
        log.warning("the chat template has no {% generation %} markers and TRL cannot patch it: "
                    "sft.loss_on=assistant falls back to last_turn (loss on the final assistant message only)")
        loss_on = "last_turn"
    result = TrainingData(train=None, eval=None, loss_on=loss_on, info={})
    which: Literal["train", "eval"]
    for which, raw, split, defaults in (
        ("train", recipe.data.train, recipe.data.train_split, ("train",)),
        ("eval", recipe.data.eval, recipe.data.eval_split, data_mod.EVAL_SPLITS),
    ):
        if raw is None:
            result[which] = None
            continue
        field = f"data.{which}"
        path = data_mod.resolve_path(raw, recipe_path, field, source)
        digest = data_mod.sha256_files(path)
        ds = data_mod.load_dataset_at(path, split, source, field, defaults)
        fmt = data_mod.check_columns(ds, algo, source, field, path)
        data_mod.check_direction(ds, path, recipe.direction, source, field)
        if which == "train" and not fmt.answer_in_prompt and loss_on == "assistant":
            loss_on = result["loss_on"] = "last_turn"  # prompt/completion rows: the completion is the target
        rows = len(ds)
        lineage = dataset_lineage(ds, path)  # before the columns are cut to the trainer's (docs/training.md)
        if fmt.answer_in_prompt and loss_on == "last_turn":
            ds = data_mod.sft_to_last_turn(ds, source, field)
            fmt = PROMPT_COMPLETION
        ds = data_mod.select_columns(ds, algo, fmt)
        result[which] = ds
        result["info"][which] = SplitInfo(path=str(path), split=split if path.is_dir() else None, rows=rows,
                                          rows_read=rows, format=fmt.name, sha256=digest["sha256"],
                                          files=digest["files"], lineage=lineage)
    return result


# ----------------------------------------------------------------------------- the run


def build_trainer(recipe: Recipe, recipe_path: Path | None = None,
                  source: str | None = None) -> tuple[Any, TrainingContext]:
    """Everything up to `trainer.train()`. Returns (trainer, context for the metadata)."""
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    source = source or str(recipe_path or "recipe")
    out = Path(recipe.output_dir).expanduser().resolve()
    cuda = cuda_available()
    dtype = resolve_dtype(recipe, cuda)
    model = resolve_model(recipe.model, recipe_path, "model", source)
    _check_model_files(model, source, need_tokenizer=not recipe.tokenizer)
    tok_name = resolve_model(recipe.tokenizer, recipe_path, "tokenizer", source) if recipe.tokenizer else model
    tok = load_tokenizer(tok_name, recipe.revision if not recipe.tokenizer else None, source,
                         "tokenizer" if recipe.tokenizer else "model")
    data = load_data(recipe, recipe_path, source, tok)

    algo = recipe.algorithm
    extra: dict[str, Any] = {}
    reward_weights = None
    online = recipe.section
    if isinstance(online, OnlineSection):  # completions scored by the section's rewards
        reward_funcs, reward_weights = build_rewards(online.rewards, recipe.direction, source, online.plugins,
                                                     tokenizer=tok, section=recipe.algo,
                                                     shared={"judge": online.judge,
                                                             "supervisor_judge": online.supervisor_judge,
                                                             "max_failed_share": online.max_failed_grade_share})
        check_reward_columns(reward_funcs, data["train"].column_names, source)
        if data["eval"] is not None:
            check_reward_columns(reward_funcs, data["eval"].column_names, source, "data.eval")
        preflight_rewards(reward_funcs, data["train"], source)  # before any model loads
        extra["reward_funcs"] = list(reward_funcs)
        extra["callbacks"] = [c for c in [after_each_step(extra["reward_funcs"])] if c is not None]
        if online.vllm_server is not None:  # generation on a managed vLLM server, adapter synced by file
            server = f"{recipe.algo}.vllm_server"
            if recipe.trainer.get("use_vllm"):
                raise InputError(source, "trainer.use_vllm", f"true together with {server}: TRL's own vLLM "
                                 "path imports vLLM into the trainer", f"false ({server} generates)")
            if "rollout_func" not in inspect.signature(algo.trainer_class().__init__).parameters:
                raise InputError(source, server, f"{algo.trainer} takes no rollout_func: it generates only with "
                                 "transformers or its own vLLM (trainer.use_vllm)")
            from lhd_train.finetune.vllm_rollout import server_rollout

            extra["rollout_func"], stop = server_rollout(recipe, out, source)
            extra["callbacks"].append(stop)
            os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func's "experimental" warning
    args, notes = trainer_arguments(recipe, out, cuda, dtype, source, reward_weights)
    if isinstance(recipe.section, SftSpec):
        args["assistant_only_loss"] = data["loss_on"] == "assistant"
        args["completion_only_loss"] = data["loss_on"] == "last_turn"
    config = build_config(recipe, out, args, source)
    fit_lengths(recipe, config, data, tok, source)
    if algo.unpaired:  # after the fit, which measures the pairs
        for which in ("train", "eval"):
            if data[which] is not None:
                data[which] = data_mod.unpair_shuffled(data[which], config.seed)
    peft_config = lora_config(recipe)
    qconf = quantization_config(recipe, dtype, source)

    from safetensors import SafetensorError

    try:
        trainer = algo.trainer_class()(model=model, args=config, train_dataset=data["train"],
                                       eval_dataset=data["eval"], processing_class=tok, peft_config=peft_config,
                                       quantization_config=qconf, **extra)
    except (OSError, SafetensorError) as e:  # SafetensorError: a corrupt file transformers does not wrap
        raise InputError(source, "model", f"cannot load '{model}': {type(e).__name__}: {e}") from None
    for which, ds in (("train", trainer.train_dataset), ("eval", trainer.eval_dataset)):
        if isinstance(ds, Sized) and which in data["info"]:  # a map-style datasets.Dataset
            info = data["info"][which]
            info.rows_trained = len(ds)
            if len(ds) != info.rows:
                log.info("data.%s: TRL kept %d of the %d fitted rows", which, len(ds), info.rows)
    ctx = TrainingContext(out=out, cuda=cuda, dtype=dtype, model=model, tokenizer=tok_name, data=data["info"],
                          args=json.loads(json.dumps(args, default=str)),
                          loss_on=data["loss_on"], notes=notes, source=source, recipe_path=recipe_path)
    return trainer, ctx


def after_each_step(reward_funcs: list[Any]) -> Any:
    """A trainer callback running the judged rewards' `check_after_step` (their failed-grade counts,
    summed over the ranks in one all-reduce, `judged_rewards.check_failed_shares`) after every
    optimizer step, or None without judged rewards. The check travels on the reward functions, so
    this module never imports judged_rewards (its graders need scipy, which the GPU image lacks)."""
    judged = [f for f in reward_funcs if callable(getattr(f, "check_after_step", None))]
    if not judged:
        return None
    from transformers import TrainerCallback

    check, setups = judged[0].check_after_step, [f.setup for f in judged]

    class JudgeShareCheck(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            check(setups)

    return JudgeShareCheck()


def fit_lengths(recipe: Recipe, config: Any, data: TrainingData, tok: Any, source: str) -> None:
    """Fit each split to the trainer's length (`fit_rows`), print the length distribution and what
    was cut or dropped, and record it in the data info (→ lhd_adapter.json)."""
    reserve = 0
    online = recipe.section
    if isinstance(online, OnlineSection):  # the prompt is measured, with room kept for the completion
        max_length = online.max_length or getattr(config, "vllm_max_model_length", None)
        reserve = int(config.max_completion_length or 0)
        if max_length is not None and max_length <= reserve:
            raise InputError(source, f"{recipe.algo}.max_length", f"{max_length} leaves no room for a prompt next "
                             f"to trainer.max_completion_length ({reserve})")
        if max_length is None:
            log.warning("%s.max_length is not set: the prompts are not truncated (TRL 1.16 does not cut them)",
                        recipe.algo)
    else:
        max_length = config.max_length
    for which in ("train", "eval"):
        if data[which] is None:
            continue
        info = data["info"][which]
        fmt = recipe.algorithm.format_named(info.format)
        ds, report, _ = fit_once(data[which], fmt, tok, max_length, reserve, which, Path(config.output_dir),
                                 f"{info.sha256}/{info.split}/{info.rows}/{','.join(data[which].column_names)}")
        data[which] = ds
        info.rows = report.kept
        info.length_fit = report.to_json()
        for line in report.lines():
            log.info("%s", line)
        if report.kept == 0:
            raise InputError(source, f"data.{which}",
                             f"{info.path}: no row fits max_length {max_length}: every answer alone is longer")


def _run_record(recipe: Recipe, ctx: TrainingContext) -> dict[str, Any]:
    return {"algo": recipe.algo, "direction": recipe.direction, "base_model": ctx["model"],
            "data_sha256": {k: v.sha256 for k, v in ctx["data"].items()},
            "base_files": weights_fingerprint(ctx["model"]), "recipe": dump_recipe(recipe),
            "tokenizer_files": weights_fingerprint(ctx["tokenizer"]) if ctx["tokenizer"] != ctx["model"] else None}


def _check_resume(recipe: Recipe, ctx: TrainingContext) -> Path | None:
    out: Path = ctx["out"]
    ckpt = resume_checkpoint(out)  # the newest complete one (a damaged newer one is named and left aside)
    if ckpt is None:
        return None
    if not recipe.resume:
        raise InputError(ctx["source"], "resume", f"resume is false but {out} already has {ckpt.name}; "
                         "remove the checkpoints or choose another output_dir")
    run_file = out / RUN_META
    if run_file.is_file():
        try:
            before = json.loads(run_file.read_text(encoding="utf-8"))
        except ValueError:
            before = {}
        now = _run_record(recipe, ctx)
        for key in ("algo", "direction", "base_model", "data_sha256"):
            if key in before and before[key] != now[key]:
                raise InputError(ctx["source"], "output_dir",
                                 f"{out} holds checkpoints of a different run ({key}: {before[key]} vs {now[key]}); "
                                 "choose another output_dir or remove the checkpoints")
        for key, field, what in (("base_files", "model", "base model"), ("tokenizer_files", "tokenizer", "tokenizer")):
            changed = changed_parts(before.get(key), now[key])
            if changed:
                raise InputError(ctx["source"], field, f"the {what}'s {' and '.join(changed)} at {now[key]['path']} "
                                 f"changed since {ckpt.name} was saved; restore them, or choose another output_dir")
        changes = recipe_changes(before["recipe"], now["recipe"]) if "recipe" in before else []
        if changes:
            field, then, new = changes[0]
            raise InputError(ctx["source"], field, f"{out}/{ckpt.name} was trained with {field}={json.dumps(then)}, "
                             f"now {json.dumps(new)}; resuming would train one adapter under two recipes: use the "
                             "checkpoint's value, another output_dir, or remove the checkpoints",
                             more=len(changes) - 1)
    return ckpt


def final_metrics(log_history: list[dict[str, Any]]) -> dict[str, Any]:
    """The last logged value of every metric (train summary keys included)."""
    final: dict[str, Any] = {}
    for entry in log_history:
        for k, v in entry.items():
            if k in ("step", "epoch"):
                continue
            if isinstance(v, (int, float)):
                final[k] = v
    return final


def _finite(x: Any) -> Any:
    return x if not isinstance(x, float) or math.isfinite(x) else str(x)


def _finished(args: Any, ckpt_state: dict[str, Any], step: int) -> bool:
    """The checkpoint already reached the end the current arguments ask for."""
    max_steps = int(getattr(args, "max_steps", -1) or -1)
    if max_steps > 0:
        return step >= max_steps
    planned = int(ckpt_state.get("max_steps") or 0)  # epoch-based: the total the checkpointed run computed
    return (planned > 0 and step >= planned
            and float(ckpt_state.get("num_train_epochs") or 0) == float(getattr(args, "num_train_epochs", 0)))


def train(recipe: Recipe, recipe_path: Path | None = None, source: str | None = None) -> Path:
    """Train the adapter a recipe describes; resume when output_dir has a checkpoint. Returns the adapter dir."""
    started = utc_now()
    t0 = time.time()
    trainer, ctx = build_trainer(recipe, recipe_path, source)
    out: Path = ctx["out"]
    for note in ctx["notes"]:
        log.info("set %s", note)
    resume = _check_resume(recipe, ctx)
    start_step = 0
    ckpt_state: dict[str, Any] = {}
    if resume is not None:
        try:
            ckpt_state = json.loads((resume / "trainer_state.json").read_text(encoding="utf-8"))
            start_step = int(ckpt_state["global_step"])
        except (OSError, ValueError, KeyError):
            start_step = -1
    adapter_dir = out / ADAPTER_SUBDIR
    finished = resume is not None and _finished(trainer.args, ckpt_state, start_step)
    if finished and (adapter_dir / ADAPTER_RECORD).is_file():
        log.info("already trained (step %d); nothing to do: %s", start_step, adapter_dir)
        return adapter_dir
    main = trainer.is_world_process_zero()
    if main and not (resume is not None and (out / RUN_META).is_file()):  # a resume keeps the first record
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out / RUN_META, _plain({**_run_record(recipe, ctx), "started_at": started}))
    log.info("%s (%s) on %s → %s%s", recipe.algo, recipe.direction, ctx["model"], out,
             f", resuming from {resume.name}" if resume else "")
    result = trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    eval_metrics = trainer.evaluate() if "eval" in ctx["data"] else None
    trainer.save_model(str(adapter_dir))
    if main:
        history = trainer.state.log_history
        lora = recipe.lora
        record = AdapterRecord(
            schema_=ADAPTER_SCHEMA, algo=recipe.algo, direction=recipe.direction, base_model=ctx["model"],
            base_revision=recipe.revision,
            base_commit=getattr(getattr(trainer.model, "config", None), "_commit_hash", None),
            tokenizer=ctx["tokenizer"], dtype=ctx["dtype"], recipe_path=str(recipe_path) if recipe_path else None,
            recipe=dump_recipe(recipe), data=ctx["data"],
            lineage=adapter_lineage(ctx["data"], recipe),  # runs, seeds, auditors: `lhd report` checks them
            sft_loss_on=ctx["loss_on"],
            lora={"r": lora.r, "alpha": lora.resolved_alpha(), "dropout": lora.dropout,
                  "target_modules": lora.resolved_targets(), "qlora": recipe.qlora},
            training=TrainingInfo(
                global_step=trainer.state.global_step, max_steps=trainer.state.max_steps, epoch=trainer.state.epoch,
                resumed_from=str(resume) if resume else None, start_step=start_step,
                device="cuda" if ctx["cuda"] else "cpu", world_size=trainer.args.world_size,
                adjustments=ctx["notes"], trainer_args=ctx["args"], accelerate_config=recipe.accelerate_config,
                seconds=round(time.time() - t0, 2)),
            metrics=_plain({"final": {k: _finite(v) for k, v in final_metrics(history).items()},
                            "train": {k: _finite(v) for k, v in (result.metrics or {}).items()},
                            "eval": {k: _finite(v) for k, v in (eval_metrics or {}).items()} or None}),
            versions={k: v for k, v in package_versions().items() if v} | {"python": python_version()},
            started_at=started, finished_at=utc_now())
        # log_history first: a present lhd_adapter.json is what says "trained" (checked above)
        write_json_atomic(adapter_dir / "log_history.json", _plain(history))
        write_adapter_record(adapter_dir, record)
        log.info("adapter: %s (step %d)", adapter_dir, trainer.state.global_step)
    return adapter_dir


def _plain(obj: Any) -> Any:
    """`obj` with whatever JSON cannot hold (paths, dtypes) as text."""
    return json.loads(json.dumps(obj, default=str))


def fit_only(recipe: Recipe, recipe_path: Path | None = None, source: str | None = None) -> TrainingData:
    """Fit the recipe's splits to the trainer's length and save them where `train` loads them
    (`fit_rows.fit_once`), in this one process, without loading the model: run before a
    distributed launch, so no rank waits behind a barrier while rows are fitted (issue 38)."""
    source = source or str(recipe_path or "recipe")
    out = Path(recipe.output_dir).expanduser().resolve()
    cuda = cuda_available()
    dtype = resolve_dtype(recipe, cuda)
    model = resolve_model(recipe.model, recipe_path, "model", source)
    tok_name = resolve_model(recipe.tokenizer, recipe_path, "tokenizer", source) if recipe.tokenizer else model
    tok = load_tokenizer(tok_name, recipe.revision if not recipe.tokenizer else None, source,
                         "tokenizer" if recipe.tokenizer else "model")
    data = load_data(recipe, recipe_path, source, tok)
    online = recipe.section
    weights = [float(r.weight) for r in online.rewards] if isinstance(online, OnlineSection) else None
    args, _ = trainer_arguments(recipe, out, cuda, dtype, source, weights)
    args["report_to"] = "none"
    fit_lengths(recipe, build_config(recipe, out, args, source), data, tok, source)
    return data


def train_command(algo: str, recipe: Path, overrides: list[str], fit: bool = False) -> Path:
    """`lhd train ALGO RECIPE [key=value ...]` → the adapter folder (`fit`: the fitted rows' folder,
    nothing trained)."""
    path = Path(recipe)
    r = load_recipe(path, overrides, algo=algo)
    if fit:
        fit_only(r, recipe_path=path.resolve(), source=str(path))
        return Path(r.output_dir).expanduser().resolve() / FITTED_DIR
    return train(r, recipe_path=path.resolve(), source=str(path))
