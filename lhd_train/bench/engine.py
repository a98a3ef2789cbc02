"""Run all trials of a config concurrently against shared backends, resumably."""
from __future__ import annotations

import asyncio
import platform
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from lhd_train.bench.accounting import gpu_hours, usage_by_role
from lhd_train.bench.events import Schedule, draw_schedule
from lhd_train.bench.prompts import Prompts
from lhd_train.bench.taskpack import load_pack, pack_sha256
from lhd_train.bench.trial import RunContext, TrialOnDisk, TrialResult, read_trial, run_trial, tasks_done
from lhd_train.config.run import RunConfig
from lhd_train.errors import InputError, LhdError
from lhd_train.io.provenance import package_versions, python_version, utc_now
from lhd_train.rundir.lock import run_dir_lock
from lhd_train.rundir.manifest import Manifest, ResumeSession, RoleModel, Summary, TrialOutcome
from lhd_train.rundir.rows import RoundRow, RunModels
from lhd_train.rundir.run import Run
from rollouts.backend import Backend
from rollouts.backends import ModelSpec, build_backend
from rollouts.managed_server import live_servers
from rollouts.model_files import changed_parts, chat_template_error, weights_fingerprint
from rollouts.types import effective_sampling

RUN_ROLES = ("performer", "supervisor", "summariser")
# Fields that may change between a run and its resumption without changing what is computed.
RESUMABLE_CHANGES = {"concurrency", "output_dir"}


def _check_resume(run_dir: Path, cfg: RunConfig, has_rounds: bool = True) -> None:
    """Refuse to resume with a config other than the one the run's rounds were made with. A run
    without any round yet (a failed start: a typo in a model path) may be started again with
    another config: the saved one is then replaced, not enforced."""
    run = Run.at(run_dir)
    saved_path = run.dir.config
    if not saved_path.exists() or not has_rounds:
        return
    try:
        saved = run.config()
    except InputError as e:
        raise InputError(saved_path, None, f"{' '.join(e.problem.split())}; it records the config of the rounds on "
                         "disk: restore it, or choose a new run_name") from None
    now = cfg.model_dump(mode="json")
    try:  # as read today: an older file holds every backend's fields
        saved = RunConfig.model_validate(saved).model_dump(mode="json")
    except ValueError:
        pass  # the raw mapping is compared: what differs is named below
    diff = sorted(k for k in set(saved) | set(now) if k not in RESUMABLE_CHANGES and saved.get(k) != now.get(k))
    if diff:
        raise InputError(saved_path, diff[0],
                         f"this run directory was made with a different config ({', '.join(diff)} differ); "
                         "resume with the same config or choose a new run_name")


def _started(run: Run, tid: str) -> bool:
    """The trial has something on disk (a round, or a torn line of one)."""
    rows_path = run.trial(tid).files.rows
    return rows_path.exists() and rows_path.stat().st_size > 0


def _saved_schedule(run: Run, tid: str) -> dict[str, Any] | None:
    try:
        return run.schedule(tid)
    except InputError as e:
        raise InputError(run.dir.schedule(tid), None, f"{e.problem}; the schedule of a trial with rounds on disk is "
                         "checked against the one drawn now: restore it, or delete it (it is drawn again from "
                         "the seed)") from None


def prepare_run_dir(cfg: RunConfig, pack: Any, seeds: list[int],
                    write_config: bool = True) -> tuple[Path, dict[str, Schedule]]:
    """Check a resumed run against its saved config and schedules, make the folders and write the
    schedules. `write_config=False` leaves `config.resolved.yaml` to the caller, which writes it
    once the backends have loaded, so a failed start pins nothing."""
    run_dir = cfg.run_dir
    run = Run.at(run_dir)
    started = {cfg.trial_id(seed) for seed in seeds if _started(run, cfg.trial_id(seed))}
    _check_resume(run_dir, cfg, has_rounds=bool(started))
    rd = run.dir
    for folder in (rd.trials_dir, rd.schedules_dir, rd.logs_dir):
        folder.mkdir(parents=True, exist_ok=True)
    if write_config:
        run.write_config(cfg.model_dump(mode="json"))
    schedules: dict[str, Schedule] = {}
    for seed in seeds:
        tid = cfg.trial_id(seed)
        sched = draw_schedule(pack, seed, cfg.p_event, cfg.control.category, cfg.control.pressure)
        path = rd.schedule(tid)
        if tid in started and path.exists() and _saved_schedule(run, tid) != sched.to_json():
            raise InputError(path, "entries", "the saved event schedule differs from the one drawn now")
        run.write_schedule(tid, sched.to_json())
        schedules[tid] = sched
    return run_dir, schedules


def model_weights(cfg: RunConfig, roles: tuple[str, ...]) -> dict[str, Any]:
    """A fingerprint of the weights each role's model (and adapter, and `tokenizer:` folder) loads
    from a local folder, keyed like `models`: a config names a path, not what is in it."""
    out: dict[str, Any] = {}
    for role in roles:
        rc = cfg.role(role)
        spec = cfg.models[rc.model]
        if rc.model not in out:
            out[rc.model] = weights_fingerprint(spec.model)
            for part, path in spec.extra_folders().items():  # a tokenizer folder: its files and template count
                out[f"{part}:{rc.model}"] = weights_fingerprint(path)
        if rc.adapter and f"adapter:{rc.adapter}" not in out:
            out[f"adapter:{rc.adapter}"] = weights_fingerprint(rc.adapter)
    return out


def keep_first_provenance(first: Manifest | None, now: Manifest, resuming: bool) -> Manifest:
    """The manifest to write: on a resume, the first run's record stays as it was (its models,
    packages, host and start) and this session is appended under `resumes`; a run with no
    finished round yet starts its record afresh."""
    if not resuming or first is None:
        return now
    session = ResumeSession(started_at=now.started_at, host=now.host, platform=now.platform,
                            packages=now.packages, python=now.python)
    return first.model_copy(update={"resumes": [*first.resumes, session]})


def _check_weights(run_dir: Path, now: dict[str, Any]) -> None:
    """Refuse to add rounds made with other weights than the run's rounds so far (a model rebuilt
    or replaced at the same path), as a changed config is refused."""
    run = Run.at(run_dir)
    manifest = run.manifest()  # a damaged one is a DataFileError naming it
    if manifest is None:
        return
    before = manifest.weights
    for key, fp in now.items():
        changed = changed_parts(before.get(key), fp)
        if changed:
            raise InputError(run.dir.manifest, f"weights.{key}", f"the {' and '.join(changed)} at {fp.get('path')} "
                             "changed since this run's rounds were made; resuming would mix two models in one run: "
                             "restore them or choose a new run_name")


def role_specs(cfg: RunConfig, roles: tuple[str, ...]) -> dict[str, ModelSpec]:
    """model key -> the spec its backend starts with: a copy of the config's, with every role's
    adapter added (a server loads adapters at start-up); the config itself stays as written, so the
    resolved config of a resumed run compares equal."""
    specs: dict[str, ModelSpec] = {}
    for role in roles:
        rc = cfg.role(role)
        spec = specs.get(rc.model, cfg.models[rc.model])
        specs[rc.model] = spec.with_adapter(rc.adapter) if rc.adapter else spec.model_copy(deep=True)
    return specs


_STARTER: Any = None


def _starter() -> Any:
    """The threads that start servers, kept for the life of the process: a server gets SIGTERM when
    the thread that spawned it ends (PR_SET_PDEATHSIG follows the thread), so they must not end."""
    global _STARTER
    if _STARTER is None:
        from concurrent.futures import ThreadPoolExecutor

        _STARTER = ThreadPoolExecutor(max_workers=16, thread_name_prefix="server-start")
    return _STARTER


def _start_all(specs: dict[str, ModelSpec], log_dir: Path) -> dict[str, Backend]:
    """One backend per spec. Managed servers start concurrently (a 72B server's minutes of loading
    no longer add to the 8B's); in-process models load one after another in this thread. When any
    fails, or we are interrupted, every server this call created is stopped (those still starting
    give up) before the error propagates."""
    from concurrent.futures import FIRST_EXCEPTION, wait

    before = set(live_servers())
    built: dict[str, Backend] = {}
    managed = [k for k, spec in specs.items() if spec.managed]
    pool = _starter()
    futures = {}
    ok = False
    try:
        futures = {k: pool.submit(build_backend, specs[k], name=k, log_dir=str(log_dir)) for k in managed}
        for key, spec in specs.items():
            if key not in futures:
                built[key] = build_backend(spec, name=key, log_dir=str(log_dir))
        wait(futures.values(), return_when=FIRST_EXCEPTION)
        for key, fut in futures.items():
            built[key] = fut.result()
        ok = True
    finally:
        # On failure keep stopping this call's servers until every start-up thread has returned
        # (one may create its server just after a first round of stops).
        while not ok:
            for server in set(live_servers()) - before:
                server.stop()
            if all(f.done() for f in futures.values()):
                break
            wait(futures.values(), timeout=0.5)
    return built


def build_role_backends(cfg: RunConfig, roles: tuple[str, ...],
                        log_dir: Path) -> tuple[dict[str, Backend], dict[str, dict[str, Any]]]:
    """One backend per model key, shared by every role that names it (specs from `role_specs`)."""
    specs = role_specs(cfg, roles)
    by_key = _start_all(specs, log_dir)
    backends: dict[str, Backend] = {}
    models: dict[str, dict[str, Any]] = {}
    for role in roles:
        rc = cfg.role(role)
        spec = specs[rc.model]
        backends[role] = by_key[rc.model]
        models[role] = {"key": rc.model, "model": spec.model, "revision": spec.revision,
                        "backend": spec.backend, "adapter": rc.adapter}
    return backends, models


async def close_backends(backends: dict[str, Backend]) -> None:
    for b in {id(b): b for b in backends.values()}.values():
        await b.aclose()


async def run_benchmark(cfg: RunConfig, progress: bool = True) -> list[TrialResult]:
    """Run (or resume) every trial of `cfg`, holding the run directory's lock throughout."""
    with run_dir_lock(cfg.run_dir, stage="lhd run"):
        return await _run_benchmark(cfg, progress)


async def _run_benchmark(cfg: RunConfig, progress: bool) -> list[TrialResult]:
    pack = load_pack(cfg.task_pack)
    cfg.check_pack(len(pack.tasks), pack.name, "run config")  # before any file or model: 50 of 20 tasks is a typo
    cfg.check_windows(RUN_ROLES, "run config")
    seeds = cfg.trial_seeds()
    run_dir, schedules = prepare_run_dir(cfg, pack, seeds, write_config=False)
    run = Run.at(run_dir)
    rd = run.dir
    n_tasks = min(len(pack.tasks), cfg.max_tasks or len(pack.tasks))
    todo = cfg.trials()

    # Every trial read once, before any model loads: its rows checked (fields, no round twice) and
    # held against its done marker; an unfinished one's message store holds every prompt a resume
    # replays, so a resume that cannot replay its rounds stops here. `run_trial` gets what was read.
    on_disk: dict[str, TrialOnDisk] = {tid: read_trial(run.trial(tid), n_tasks, cfg.max_rounds_per_task)
                                       for tid, _ in todo}
    results: list[TrialResult] = []
    pending = [(tid, s) for tid, s in todo if not on_disk[tid].finished]
    finished = [(tid, s) for tid, s in todo if on_disk[tid].finished]
    has_rounds = any(d.rows for d in on_disk.values())

    weights = model_weights(cfg, RUN_ROLES) if pending else {}
    if pending and has_rounds:
        _check_weights(run_dir, weights)
    resolved = cfg.model_dump(mode="json")  # the config as given, whatever building the backends does with it
    backends, models = build_role_backends(cfg, RUN_ROLES, rd.logs_dir) if pending else ({}, {})
    Run.at(run_dir).write_config(resolved)  # only now: the run could start
    describe = {role: backends[role].describe() for role in backends}
    manifest = Manifest(
        run_id=cfg.run_name, pack=pack.name, pack_source=str(pack.path), pack_sha256=pack_sha256(pack),
        seeds=seeds, trials=[tid for tid, _ in todo],
        models={role: RoleModel.model_validate({**models.get(role, {}), "describe": describe[role]})
                for role in backends},
        sampling={r: cfg.role(r).sampling.model_dump() for r in RUN_ROLES},
        # what each role decodes with: the config's settings over the model's own generation defaults
        effective_sampling={r: effective_sampling(cfg.role(r).sampling.params(None),
                                                  (describe.get(r) or {}).get("generation_defaults"))
                            for r in RUN_ROLES if r in describe},
        weights=weights,
        packages=package_versions(), python=python_version(),
        host=platform.node(), platform=platform.platform(),
        started_at=utc_now(),
    )
    if pending:
        run.write_manifest(keep_first_provenance(run.manifest() if has_rounds else None, manifest, has_rounds))

    # A resumed run's bar starts at the tasks already done, finished trials and partial ones alike.
    already = sum(n_tasks if on_disk[tid].finished else tasks_done(on_disk[tid].rows, cfg.max_rounds_per_task)
                  for tid, _ in todo)
    bar = tqdm(total=len(todo) * n_tasks, initial=already, desc=f"run {cfg.run_name}", unit="task",
               disable=not progress)

    def on_round(tid: str, row: RoundRow) -> None:
        if row.task_complete or row.round >= cfg.max_rounds_per_task:
            bar.update(1)
        bar.set_postfix_str(f"{tid} task {row.task_index} round {row.round}")

    ctx = RunContext(cfg, cfg.run_name, run_dir, pack, Prompts(cfg.prompts_dir), backends,
                     RunModels.model_validate(models))
    gate = asyncio.Semaphore(cfg.concurrency)

    async def one(tid: str, seed: int) -> TrialResult:
        async with gate:
            return await run_trial(ctx, tid, seed, schedules[tid], on_round, on_disk[tid])

    t0 = time.perf_counter()
    try:
        # Finished trials are summarised from disk without touching a model.
        for tid, seed in finished:
            results.append(await run_trial(ctx, tid, seed, schedules[tid], disk=on_disk[tid]))
        outcomes = await asyncio.gather(*(one(tid, s) for tid, s in pending), return_exceptions=True)
    finally:
        await close_backends(backends)
        bar.close()
    used_keys = {cfg.role(r).model for r in RUN_ROLES}
    folders = [n for k in sorted(used_keys) for n in (*cfg.models[k].extra_folders().values(), cfg.models[k].model)]
    for (tid, seed), out in zip(pending, outcomes, strict=True):
        if isinstance(out, LhdError):  # a file on disk that needs a person, not a rerun
            raise out
        template = chat_template_error(out, folders) if isinstance(out, BaseException) else None
        if template is not None:  # a model's chat template that fails: a file to fix, not a rerun
            raise template
        if isinstance(out, BaseException):
            results.append(TrialResult(tid, seed, status="failed", error=f"{type(out).__name__}: {out}"))
        else:
            results.append(out)
    order = [tid for tid, _ in todo]
    results.sort(key=lambda r: order.index(r.trial_id))
    wall = time.perf_counter() - t0
    all_rows: list[RoundRow] = [row for tid in order for row in run.trial(tid).rows(RoundRow)]
    run.write_summary(Summary(
        run_id=cfg.run_name, wall_s=round(wall, 2),
        gpu_hours_this_invocation=gpu_hours((cfg.models[k] for k in used_keys), wall) if pending else 0.0,
        usage_by_role=usage_by_role(all_rows),
        trials=[TrialOutcome.model_validate(vars(r)) for r in results],
    ))
    return results
