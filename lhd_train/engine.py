"""Run all trials of a config concurrently against shared backends, resumably."""
from __future__ import annotations

import asyncio
import json
import platform
import sys
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml
from tqdm.auto import tqdm

from lhd_train.accounting import gpu_hours, usage_by_role
from lhd_train.config import RunConfig, dump_resolved
from lhd_train.errors import InputError
from lhd_train.events import Schedule, draw_schedule
from lhd_train.prompts import Prompts
from lhd_train.store import read_jsonl, write_json_atomic
from lhd_train.taskpack import load_pack
from lhd_train.trial import RunContext, TrialResult, run_trial, trial_paths
from rollouts.backend import Backend
from rollouts.factory import build_backend

RUN_ROLES = ("performer", "supervisor", "summariser")
PACKAGES = ("lhd", "torch", "transformers", "trl", "peft", "accelerate", "datasets", "xgrammar", "openai", "vllm")
# Fields that may change between a run and its resumption without changing what is computed.
RESUMABLE_CHANGES = {"concurrency", "output_dir"}


def trial_id_for(seed: int, cfg: RunConfig) -> str:
    tid = f"s{seed}"
    c, p = cfg.control.category, cfg.control.pressure
    if "NONE" in (c, p):
        return tid + "-none"
    if c:
        tid += f"-cat-{c}"
    if p:
        tid += f"-lvl-{p}"
    return tid


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _check_resume(run_dir: Path, cfg: RunConfig) -> None:
    saved_path = run_dir / "config.resolved.yaml"
    if not saved_path.exists():
        return
    saved = yaml.safe_load(saved_path.read_text())
    now = cfg.model_dump(mode="json")
    diff = sorted(k for k in set(saved) | set(now) if k not in RESUMABLE_CHANGES and saved.get(k) != now.get(k))
    if diff:
        raise InputError(saved_path, diff[0],
                         f"this run directory was made with a different config ({', '.join(diff)} differ); "
                         "resume with the same config or choose a new run_name")


def prepare_run_dir(cfg: RunConfig, pack: Any, seeds: list[int]) -> tuple[Path, dict[str, Schedule]]:
    run_dir = cfg.run_dir
    _check_resume(run_dir, cfg)
    for sub in ("trials", "schedules", "logs"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    (run_dir / "config.resolved.yaml").write_text(dump_resolved(cfg))
    schedules: dict[str, Schedule] = {}
    for seed in seeds:
        tid = trial_id_for(seed, cfg)
        sched = draw_schedule(pack, seed, cfg.p_event, cfg.control.category, cfg.control.pressure)
        path = run_dir / "schedules" / f"{tid}.json"
        if path.exists() and json.loads(path.read_text()) != sched.to_json():
            raise InputError(path, "entries", "the saved event schedule differs from the one drawn now")
        write_json_atomic(path, sched.to_json())
        schedules[tid] = sched
    return run_dir, schedules


def build_role_backends(cfg: RunConfig, roles: tuple[str, ...], log_dir: Path) -> tuple[dict[str, Backend], dict[str, dict[str, Any]]]:
    """One backend per model key, shared by every role that names it."""
    by_key: dict[str, Backend] = {}
    backends: dict[str, Backend] = {}
    models: dict[str, dict[str, Any]] = {}
    for role in roles:
        rc = cfg.role(role)
        spec = cfg.models[rc.model]
        if rc.adapter and rc.adapter not in spec.adapters:
            spec.adapters[rc.adapter] = rc.adapter
        if rc.model not in by_key:
            by_key[rc.model] = build_backend(spec, name=rc.model, log_dir=str(log_dir))
        backends[role] = by_key[rc.model]
        models[role] = {"key": rc.model, "model": spec.model, "revision": spec.revision,
                        "backend": spec.backend, "adapter": rc.adapter}
    return backends, models


async def close_backends(backends: dict[str, Backend]) -> None:
    for b in {id(b): b for b in backends.values()}.values():
        await b.aclose()


async def run_benchmark(cfg: RunConfig, progress: bool = True) -> list[TrialResult]:
    pack = load_pack(cfg.task_pack)
    seeds = cfg.trial_seeds()
    run_dir, schedules = prepare_run_dir(cfg, pack, seeds)
    n_tasks = min(len(pack.tasks), cfg.max_tasks or len(pack.tasks))
    todo = [(trial_id_for(s, cfg), s) for s in seeds]

    results: list[TrialResult] = []
    pending = [(tid, s) for tid, s in todo if not trial_paths(run_dir, tid)[2].exists()]
    finished = [(tid, s) for tid, s in todo if (tid, s) not in pending]

    backends, models = build_role_backends(cfg, RUN_ROLES, run_dir / "logs") if pending else ({}, {})
    manifest = {
        "run_id": cfg.run_name, "pack": pack.name, "pack_source": str(pack.path),
        "seeds": seeds, "trials": [tid for tid, _ in todo],
        "models": {role: {**models.get(role, {}), "describe": backends[role].describe()} for role in backends},
        "sampling": {r: cfg.role(r).sampling.model_dump() for r in RUN_ROLES},
        "packages": package_versions(), "python": sys.version.split()[0],
        "host": platform.node(), "platform": platform.platform(),
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if pending:
        write_json_atomic(run_dir / "manifest.json", manifest)

    bar = tqdm(total=len(todo) * n_tasks, desc=f"run {cfg.run_name}", unit="task", disable=not progress)
    for tid, _ in finished:
        bar.update(n_tasks)

    def on_round(tid: str, row: dict[str, Any]) -> None:
        if row["task_complete"] or row["round"] >= cfg.max_rounds_per_task:
            bar.update(1)
        bar.set_postfix_str(f"{tid} task {row['task_index']} round {row['round']}")

    ctx = RunContext(cfg, cfg.run_name, run_dir, pack, Prompts(cfg.prompts_dir), backends, models)
    gate = asyncio.Semaphore(cfg.concurrency)

    async def one(tid: str, seed: int) -> TrialResult:
        async with gate:
            return await run_trial(ctx, tid, seed, schedules[tid], on_round)

    t0 = time.perf_counter()
    try:
        # Finished trials are summarised from disk without touching a model.
        for tid, seed in finished:
            results.append(await run_trial(ctx, tid, seed, schedules[tid]))
        outcomes = await asyncio.gather(*(one(tid, s) for tid, s in pending), return_exceptions=True)
    finally:
        await close_backends(backends)
        bar.close()
    for (tid, seed), out in zip(pending, outcomes):
        if isinstance(out, BaseException):
            results.append(TrialResult(tid, seed, status="failed", error=f"{type(out).__name__}: {out}"))
        else:
            results.append(out)
    results.sort(key=lambda r: [tid for tid, _ in todo].index(r.trial_id))
    wall = time.perf_counter() - t0
    used_keys = {cfg.role(r).model for r in RUN_ROLES}
    all_rows = [row for tid, _ in todo for row in read_jsonl(trial_paths(run_dir, tid)[0])]
    write_json_atomic(run_dir / "summary.json", {
        "run_id": cfg.run_name, "wall_s": round(wall, 2),
        "gpu_hours_this_invocation": gpu_hours((cfg.models[k] for k in used_keys), wall) if pending else 0.0,
        "usage_by_role": usage_by_role(all_rows),
        "trials": [r.__dict__ for r in results],
    })
    return results
