"""`lhd slurm render STAGE CONFIG [--var k=v ...] [--dry-run]`: sbatch scripts for every stage.

The scripts are jinja2 templates in `slurm/<stage>.sbatch.j2` (StrictUndefined: a missing variable
is an error). This module works out each stage's commands once, from the config and the variables,
and hands them to the template; `dry_run_commands` prints the same commands with the slurm variables
filled in, so what `--dry-run` shows is what the job runs. Stages: rollout, audit, data, train
(sized by `slurm_train`), lens, merge; GPU requests are checked against the partition
(`slurm_gpus`). What each stage's job runs: docs/cluster.md, "Slurm jobs" and "Layouts"."""
from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from lens.settings import FitArgs
from lhd_train.config.algos import ALGOS
from lhd_train.config.auditor import AuditOptions
from lhd_train.config.base import parse_assignment, read_config, validate
from lhd_train.config.data import DataOptions
from lhd_train.config.flags import to_argv
from lhd_train.errors import InputError
from lhd_train.ops.slurm_gpus import node_gpus
from lhd_train.ops.slurm_train import train_size
from lhd_train.ops.slurm_vars import stage_vars

ROOT = Path(__file__).resolve().parents[2]
TASK = "${SLURM_ARRAY_TASK_ID}"


def template_dir() -> Path:
    return Path(os.environ.get("LHD_SLURM_TEMPLATES") or ROOT / "slurm")


def q(value: Any) -> str:
    return shlex.quote(str(value))


_ENV_REF = re.compile(r"\$(\{[A-Za-z_][A-Za-z0-9_]*\}|[A-Za-z_][A-Za-z0-9_]*)")


def qv(value: Any) -> str:
    """`value` double-quoted for bash with its `$NAME` / `${NAME}` references left to expand
    (`workdir=${SLURM_SUBMIT_DIR}`) and everything else literal: `$(...)`, backquotes, quotes
    and backslashes in a `--var` never run."""
    text, out, pos = str(value), [], 0
    for m in _ENV_REF.finditer(text):
        out += [re.sub(r'([\\"$`])', r"\\\1", text[pos:m.start()]), m.group(0)]
        pos = m.end()
    out.append(re.sub(r'([\\"$`])', r"\\\1", text[pos:]))
    return '"' + "".join(out) + '"'


class Block(str):
    """A rendered text that is many lines on purpose (the merge job's script in its heredoc)."""


def _one_line_only(value: Any) -> Any:
    """Every `{{ ... }}` of a template lands inside one line; a value holding a line break would
    start a line of its own, which bash runs. Checked on the rendered value itself, so no config
    field or variable, validated or not, can add a line to a script."""
    if not isinstance(value, Block) and isinstance(value, str) and ("\n" in value or "\r" in value):
        raise InputError("command line", "--var", f"{value[:60]!r} holds a line break; a value in a slurm script "
                         "is one line")
    return value


def _join(*parts: str | None) -> str:
    return " ".join(p for p in parts if p)


# ----------------------------------------------------------------------------- variables


def parse_vars(items: list[str] | None) -> dict[str, Any]:
    """`--var key=value` pairs; values are YAML (`shards=4`, `setup=[module load cuda, ...]`)."""
    return dict(parse_assignment(item, "--var") for item in items or [])


def command_argv(options: type[BaseModel], v: dict[str, Any], exclude: tuple[str, ...] = ()) -> str:
    """The flags of a command's options model (`DataOptions`, `lens.settings.FitArgs`) from the stage's
    variables of the same names, quoted: only values that differ from the command's own defaults."""
    settings = options.model_validate({k: v[k] for k in options.model_fields})
    return " ".join(q(word) for word in to_argv(settings, exclude=exclude))


def _resolve_vars(stage: str, given: dict[str, Any]) -> dict[str, Any]:
    """The stage's variables (`ops.slurm_vars`), checked, as the dict the planners and templates read."""
    return stage_vars(stage, given).model_dump()


# ----------------------------------------------------------------------------- configs


def _load_run_config(config: Path):
    from lhd_train.config.run import load_config

    return load_config(config)


def role_model_keys(cfg: Any, roles: tuple[str, ...]) -> list[str]:
    keys: list[str] = []
    for r in roles:
        rc = getattr(cfg, r, None) if r != "summariser" else (cfg.summariser or cfg.supervisor)
        if rc is not None and rc.model not in keys:
            keys.append(rc.model)
    return keys


def _job_needs(p: Plan, models: dict[str, Any], keys: list[str], v: dict[str, Any], servers: bool = False) -> None:
    """What the job's node must provide for the models `keys` (each backend says: API keys to export,
    the executables the guard checks; with `servers`, the server command lines for the plan's notes),
    recorded on the plan. A managed vLLM
    on a GPU falls back to $LHD_VLLM / `vllm` on PATH, which the guard exports, so the checkout's CPU
    build in .venv-vllm is never picked up on a GPU node."""
    needs = [models[k].job_needs(k, v["device"] != "cpu") for k in keys]
    p.required_env = sorted({name for n in needs for name in n.env})
    p.extra.update(vllm_default=any(n.vllm_from_path for n in needs),
                   vllm_exes=sorted({exe for n in needs for exe in n.executables}))
    if servers:
        p.extra["servers"] = [n.server for n in needs if n.server]


# ----------------------------------------------------------------------------- plans


@dataclass
class Plan:
    """What one stage's job(s) run. `commands` may use `${SLURM_ARRAY_TASK_ID}` (array stages) and
    `$SLURM_PROCID` / `$MAIN_PROCESS_IP` (train); `dry_run_commands` fills them in."""

    stage: str
    name: str
    array: int | None = None  # number of array tasks
    commands: list[str] = field(default_factory=list)
    merge_commands: list[str] = field(default_factory=list)  # the dependent job's commands
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    summary: list[str] = field(default_factory=list)  # what `lhd slurm render` also says on stderr
    required_env: list[str] = field(default_factory=list)
    gpus: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _shard_dir(output_dir: str, run_name: str, idx: str | int, n: int) -> str:
    prefix = str(Path(output_dir) / f"{run_name}-shard")
    return q(prefix) + str(idx) + q(f"of{n}")


def _plan_rollout(config: Path, v: dict[str, Any]) -> Plan:
    from lhd_train.bench.engine import RUN_ROLES

    cfg = _load_run_config(config)
    n_trials = len(cfg.trial_seeds())
    shards = v["shards"] or min(4, n_trials)
    if shards > n_trials:
        raise InputError("command line", "--var shards", f"{shards} shards for {n_trials} trials: some would be empty",
                         f"1 ... {n_trials}")
    keys = role_model_keys(cfg, RUN_ROLES)
    gpus, notes = node_gpus(cfg.models, keys, dict.fromkeys(keys, config), on_gpu=v["device"] != "cpu",
                            limit=v["max_gpus_per_node"], why="`lhd run` starts every role's model at once: ")
    p = Plan("rollout", cfg.run_name, array=shards, gpus=gpus, notes=notes)
    _job_needs(p, cfg.models, keys, v, servers=True)
    p.commands = [_join("lhd run", q(config), f"--shard {TASK}/{shards}", "--no-progress",
                        *[q(o) for o in v["overrides"]])]
    shard_dirs = [_shard_dir(cfg.output_dir, cfg.run_name, i, shards) for i in range(shards)]
    p.merge_commands = [_join("lhd merge", *shard_dirs, "--out", q(cfg.run_dir))]
    p.extra["trials_per_shard"] = [((n_trials * (i + 1)) // shards) - ((n_trials * i) // shards) for i in range(shards)]
    return p


def _auditor_models(config: Path, v: dict[str, Any], cfg: Any) -> tuple[dict[str, Any], str | None, Path]:
    """The auditor's models, its key, and the file they come from."""
    if v.get("auditor"):
        from lhd_train.config.auditor import AuditorConfig

        acfg = validate(AuditorConfig, read_config(v["auditor"]), v["auditor"])
        return acfg.models, acfg.auditor.model, Path(str(v["auditor"]))
    if cfg.auditor is None:
        return cfg.models, None, config
    return cfg.models, cfg.auditor.model, config


def _targets(cfg: Any, v: dict[str, Any], idx: str | int | None, shards: int) -> str:
    """The run dir a job works on: the merged run (`shards == 1`) or shard `idx`'s run dir."""
    if v.get("run_dir"):
        if shards > 1:
            raise InputError("command line", "--var run_dir", "give either run_dir (one job) or shards > 1 (an array)")
        return q(v["run_dir"])
    if shards == 1 or idx is None:
        return q(cfg.run_dir)
    return _shard_dir(cfg.output_dir, cfg.run_name, idx, shards)


def _plan_audit(config: Path, v: dict[str, Any]) -> Plan:
    cfg = _load_run_config(config)
    shards = v["shards"]
    models, key, source = _auditor_models(config, v, cfg)
    if key is None:
        raise InputError(config, "auditor", "the run config has no auditor role; pass --var auditor=AUDITOR.yaml")
    overrides = list(v["overrides"])
    alone = models[key].first_gpus() if v["device"] != "cpu" else {}
    if alone:  # this job runs the auditor's server alone: "1,2,3,4" asked for 5 GPUs
        models = {**models, key: models[key].model_copy(update=alone)}
        overrides += [f'models.{key}.{name}="{value}"' for name, value in alone.items()]
    gpus, notes = node_gpus(models, [key], {key: source}, on_gpu=v["device"] != "cpu", limit=v["max_gpus_per_node"])
    p = Plan("audit", cfg.run_name, array=shards if shards > 1 else None, gpus=gpus, notes=notes)
    _job_needs(p, models, [key], v)
    idx = TASK if shards > 1 else None
    opts = ["--auditor " + q(v["auditor"]) if v["auditor"] else None, command_argv(AuditOptions, v), "--no-progress"]
    p.commands = [_join("lhd audit", _targets(cfg, v, idx, shards), *[q(o) for o in overrides], *opts)]
    if shards > 1:
        shard_dirs = [_shard_dir(cfg.output_dir, cfg.run_name, i, shards) for i in range(shards)]
        p.merge_commands = [_join("lhd merge", *shard_dirs, "--out", q(cfg.run_dir))]
    return p


def _plan_data(config: Path, v: dict[str, Any]) -> Plan:
    cfg = _load_run_config(config)
    shards = v["shards"]
    models, akey, asource = _auditor_models(config, v, cfg)
    keys = role_model_keys(cfg, ("performer", "supervisor"))
    all_models = dict(cfg.models)
    sources: dict[str, str | Path] = dict.fromkeys(keys, config)
    if akey is not None:
        if akey in all_models and all_models[akey] != models[akey]:
            all_models[f"auditor:{akey}"] = models[akey]
            akey = f"auditor:{akey}"
        else:
            all_models[akey] = models[akey]
        if akey not in keys:
            keys.append(akey)
            sources[akey] = asource
    # `lhd data` grades each context's candidates as soon as they are sampled, so the performer, the
    # supervisor and the auditor are served at the same time (docs/cluster.md).
    why = ("`lhd data` samples with the performer while the supervisor and the auditor grade, so all three run "
           "at once (the run's own auditor shares the supervisor's server): ")
    gpus, notes = node_gpus(all_models, keys, sources, on_gpu=v["device"] != "cpu", limit=v["max_gpus_per_node"],
                            why=why)
    out = v["out"] or str(Path(cfg.run_dir) / "data" / f"{v['kind']}-{v['direction']}")
    p = Plan("data", cfg.run_name, array=shards if shards > 1 else None, gpus=gpus, notes=notes)
    _job_needs(p, all_models, keys, v)
    target_out = q(out) if shards == 1 else q(str(Path(out) / "shard")) + TASK + q(f"of{shards}")
    options = command_argv(DataOptions, v, exclude=("min_margin",) if v["kind"] == "bon" else ())
    opts = [f"--out {target_out}", "--auditor " + q(v["auditor"]) if v["auditor"] else None, options]
    p.commands = [_join(f"lhd data {v['kind']}", _targets(cfg, v, TASK if shards > 1 else None, shards),
                        *[q(o) for o in v["overrides"]], *opts)]
    if shards > 1:
        parts = [q(str(Path(out) / "shard")) + str(i) + q(f"of{shards}") for i in range(shards)]
        p.merge_commands = [_join("lhd data merge", *parts, "--out", q(out))]
    p.extra["out"] = out
    return p


# The rendezvous port of a multi-GPU training job: two jobs on one node (e.g. two of 4 GPUs each) must
# not both take accelerate's 29500. 15000-29999: below Linux's ephemeral ports (32768-60999).
PORT_FROM_JOB_ID = "$(( 15000 + SLURM_JOB_ID % 15000 ))"


def _plan_train(config: Path, v: dict[str, Any]) -> Plan:
    recipe = read_config(config, list(v["overrides"]), "recipe file")
    algo = v["algo"] or recipe.get("algo")
    if algo not in ALGOS:
        raise InputError(config, "algo", f"{algo!r}: not a training recipe (or pass --var algo={'|'.join(ALGOS)})")
    size = train_size(recipe, config, algo, v)
    v["nodes"], v["gpus_per_node"] = size.nodes, size.gpus_per_node
    overrides = list(v["overrides"])
    if size.fsdp_checkpointing and not any(o.startswith("trainer.gradient_checkpointing=") for o in overrides):
        # FSDP does activation checkpointing itself; both at once fail (configs/accelerate/fsdp2.yaml).
        overrides.append("trainer.gradient_checkpointing=false")
    p = Plan("train", Path(config).stem if not recipe.get("output_dir") else Path(recipe["output_dir"]).name,
             gpus=size.gpus_per_node)
    batch = size.batch_line(algo)
    p.notes = [f"{size.nodes} node(s) x {size.gpus_per_node} GPU(s) = {size.processes} process(es), {size.acc_file}",
               f"{algo} on {recipe.get('model')} -> {recipe.get('output_dir')}", batch]
    p.summary = [f"lhd slurm render train: {size.nodes} node(s) x {size.gpus_per_node} GPU(s), {batch}"]
    entry = ["-m", "lhd_train.cli", "train", q(algo), q(config), *[q(o) for o in overrides]]
    port = PORT_FROM_JOB_ID if v["main_port"] is None else str(int(v["main_port"]))
    p.extra.update(acc_file=size.acc_file, algo=algo, main_port=port, single=size.single)
    if size.single:  # one process: no srun, no rendezvous
        launch_args = ["--config_file", q(size.acc_file), "--num_machines", "1", "--num_processes", "1", *entry]
        p.commands = [_join("accelerate launch", " ".join(launch_args))]
    else:
        launch_args = ["--config_file", q(size.acc_file), "--num_machines", '"$NUM_MACHINES"',
                       "--num_processes", '"$NUM_PROCESSES"', "--main_process_ip", '"$MAIN_PROCESS_IP"',
                       "--main_process_port", '"$MAIN_PROCESS_PORT"', "--rdzv_backend", q(v["rdzv_backend"]),
                       "--same_network", *entry]
        # One `accelerate launch` per node; $SLURM_PROCID (0 .. nodes-1) is the machine rank.
        p.commands = [_join("accelerate launch", '--machine_rank "$SLURM_PROCID"', " ".join(launch_args))]
        # The rows are fitted in one process before the process group starts (fit_rows, issue 38).
        p.extra["fit_command"] = _join("lhd", *entry[2:], "--fit-only")
    p.extra["launch_args"] = " ".join(launch_args)
    return p


def _lens_model(config: Path, v: dict[str, Any]) -> tuple[str, str | None]:
    if v["model"]:
        return str(v["model"]), None
    data = read_config(config)
    if "models" in data and isinstance(data["models"], dict):
        from rollouts.backends import parse_spec

        key = (data.get("performer") or {}).get("model") if isinstance(data.get("performer"), dict) else None
        key = key or next(iter(data["models"]))
        spec = parse_spec(data["models"][key])
        return spec.model, spec.revision
    if "model" in data:
        return str(data["model"]), data.get("revision")
    raise InputError(config, "models",
                     "no model found (give a model config, a run config, a recipe, or --var model=ID)")


def _plan_lens(config: Path, v: dict[str, Any]) -> Plan:
    model, revision = _lens_model(config, v)
    if not v["corpus"]:
        raise InputError("command line", "--var corpus",
                         "the lens stage needs a corpus (text, JSONL or datasets folder)")
    shards = v["shards"]
    name = Path(model).name
    out = v["out"] or f"lenses/{name}"
    p = Plan("lens", name, array=shards, gpus=v["gpus_per_node"] or 0)
    shard_out = q(f"{out}-shards/shard") + TASK + q(f"of{shards}")
    opts = [f"--corpus {q(v['corpus'])}", f"--out {shard_out}", f"--shard {TASK}/{shards}", command_argv(FitArgs, v),
            f"--revision {q(revision)}" if revision else None,
            "--device cuda" if p.gpus else "--device cpu", "--no-progress", *[q(a) for a in v["fit_args"]]]
    p.commands = [_join("lhd lens fit", q(model), *opts)]
    parts = [q(f"{out}-shards/shard") + str(i) + q(f"of{shards}") for i in range(shards)]
    p.merge_commands = [_join("lhd lens merge", q(out), *parts)]
    p.notes = [f"lens of {model}: {shards} slices of the first {v['n_prompts']} prompts -> {out}"]
    return p


def _plan_merge(config: Path, v: dict[str, Any]) -> Plan:
    cfg = _load_run_config(config)
    shards = v["shards"] or min(4, len(cfg.trial_seeds()))
    shard_dirs = [_shard_dir(cfg.output_dir, cfg.run_name, i, shards) for i in range(shards)]
    p = Plan("merge", cfg.run_name, gpus=0)
    p.commands = [_join("lhd merge", *shard_dirs, "--out", q(cfg.run_dir))]
    return p


PLANNERS = {"rollout": _plan_rollout, "audit": _plan_audit, "data": _plan_data, "train": _plan_train,
            "lens": _plan_lens, "merge": _plan_merge}


def plan_stage(stage: str, config: Path, **vars: Any) -> tuple[Plan, dict[str, Any]]:
    v = _resolve_vars(stage, vars)
    plan = PLANNERS[stage](Path(config), v)
    if v["device"] == "cpu":
        plan.notes.append(f"device=cpu: no GPUs requested; models run on the node's CPUs "
                          f"(OMP_NUM_THREADS={v['cpus']})")
    else:
        _check_gpu_request(stage, plan, v)
    v["job_name"] = v["job_name"] or f"lhd-{stage}-{plan.name}"
    if not plan.merge_commands:
        v["merge_job"] = False
    return plan, v


def _check_gpu_request(stage: str, plan: Plan, v: dict[str, Any]) -> None:
    """Fill in `gpus_per_node` (what the models need) and refuse a request no node can satisfy."""
    if v["gpus_per_node"] is None:
        v["gpus_per_node"] = plan.gpus
    elif stage in ("rollout", "audit", "data") and v["gpus_per_node"] < plan.gpus:
        raise InputError("command line", "--var gpus_per_node", f"{v['gpus_per_node']}, but the models of the "
                         f"{stage} stage need {plan.gpus} GPUs on the node", f"at least {plan.gpus}")
    limit = v["max_gpus_per_node"]
    if limit is not None and v["gpus_per_node"] > limit:
        raise InputError("command line", "--var gpus_per_node", f"{v['gpus_per_node']} GPUs per node, more than "
                         f"the {limit} a node of the partition has (max_gpus_per_node)", f"at most {limit}")


# ----------------------------------------------------------------------------- rendering


def _env():
    import jinja2

    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(template_dir())), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True, autoescape=False,
                              finalize=_one_line_only)


def _context(plan: Plan, v: dict[str, Any], config: Path, merge_script: str | None) -> dict[str, Any]:
    exports = {}
    if v["hf_home"]:
        exports["HF_HOME"] = str(v["hf_home"])
    if v["offline"]:
        exports["HF_HUB_OFFLINE"] = "1"
    exports.update({"HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false"})
    if v["device"] == "cpu":  # torch and MKL use this many threads, the CPUs the job was given
        exports.update({"OMP_NUM_THREADS": str(v["cpus"]), "MKL_NUM_THREADS": str(v["cpus"])})
    exports.update({str(k): str(val) for k, val in v["env"].items()})
    for name in plan.required_env:  # `: "${NAME:?...}"`: a name from a model config, never shell syntax
        if not (name.isidentifier() and name.isascii()):
            raise InputError(config, "api_key_env", f"{name!r} is not an environment variable name",
                             "letters, digits, '_'")
    return {**v, "stage": plan.stage, "config": str(config), "plan": plan, "array": plan.array,
            "commands": plan.commands, "merge_commands": plan.merge_commands, "notes": plan.notes,
            "warnings": plan.warnings, "required_env": plan.required_env, "exports": exports,
            "merge_script": Block(merge_script) if merge_script is not None else None, "extra": plan.extra,
            "q": q, "qv": qv}


def render_slurm(stage: str, config: Path, **vars: Any) -> str:
    """The filled sbatch script of `stage` for `config`. Variables: `lhd_train.ops.slurm_vars`."""
    return render_job(stage, config, **vars)[0]


def render_job(stage: str, config: Path, **vars: Any) -> tuple[str, list[str]]:
    """The filled sbatch script, and the lines `lhd slurm render` prints on stderr (the training
    job's size and global batch)."""
    plan, v = plan_stage(stage, config, **vars)
    env = _env()
    merge_script = None
    if v["merge_job"]:
        mv = {**v, "job_name": f"{v['job_name']}-merge", "time": v["merge_time"], "cpus": v["merge_cpus"],
              "mem": v["merge_mem"], "nodes": 1, "gpus_per_node": 0, "exclusive": False,
              "partition": v["merge_partition"] or v["partition"], "sbatch_extra": []}
        mplan = Plan(f"{plan.stage}-merge", plan.name, commands=plan.merge_commands)
        merge_script = env.get_template("_merge_job.sbatch.j2").render(**_context(mplan, mv, config, None))
        if "LHD_MERGE_JOB_EOF" in merge_script:
            raise InputError("command line", "--var", "a value contains the heredoc marker LHD_MERGE_JOB_EOF")
    return env.get_template(f"{stage}.sbatch.j2").render(**_context(plan, v, config, merge_script)), plan.summary


def dry_run_commands(stage: str, config: Path, **vars: Any) -> list[str]:
    """The commands the job(s) would run, one shell line each, slurm variables filled in; lines
    starting with `#` say which task runs what (valid shell, so the list can be pasted)."""
    plan, v = plan_stage(stage, config, **vars)
    out: list[str] = [f"# WARNING: {w}" for w in plan.warnings]
    out += list(v["setup"])
    out += [f"export {k}={q(val)}" for k, val in _context(plan, v, config, None)["exports"].items()]
    if plan.extra.get("vllm_default"):
        out.append('export LHD_VLLM="$(command -v "${LHD_VLLM:-vllm}")"  # the job stops here without a vllm')
    out += [f"command -v {q(exe)}  # vllm_executable, checked" for exe in plan.extra.get("vllm_exes", [])]
    if stage == "train":
        out += [f"# {n}" for n in plan.notes]
        if plan.extra["single"]:
            return out + list(plan.commands)
        nodes = int(v["nodes"])
        procs = nodes * int(v["gpus_per_node"])
        out += ['export MAIN_PROCESS_IP=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)']
        out += [f"export MAIN_PROCESS_PORT={plan.extra['main_port']}", plan.extra["fit_command"]]
        fill = {'"$SLURM_PROCID"': None, '"$NUM_MACHINES"': str(nodes), '"$NUM_PROCESSES"': str(procs)}
        for rank in range(nodes):
            out.append(f"# node {rank} of {nodes} (srun task {rank}, {v['gpus_per_node']} processes)")
            for c in plan.commands:
                for k, val in fill.items():
                    c = c.replace(k, str(rank) if val is None else val)
                out.append(c)
        return out
    if plan.array:
        for i in range(plan.array):
            out.append(f"# array task {i} of {plan.array}")
            out += [c.replace(TASK, str(i)) for c in plan.commands]
            for s in plan.extra.get("servers", []):
                out.append(f"#   lhd run starts: {s}")
    else:
        out += list(plan.commands)
        for s in plan.extra.get("servers", []):
            out.append(f"#   lhd starts: {s}")
    if plan.merge_commands:
        out.append("# dependent job, after every array task succeeded")
        out += list(plan.merge_commands)
    return out


