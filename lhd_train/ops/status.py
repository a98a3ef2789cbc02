"""`lhd slurm status RUN`: which shards and stages of a run are pending, running, finished or failed.

Two sources, joined per shard/stage: Slurm where its commands exist (`squeue`, `scontrol show job`,
`sacct`; jobs found by the names `lhd slurm render` gives them, the newest job of a resubmitted
shard counting) and the run directory, always, read through `rundir.run.Run` (`finished`,
`incomplete`, `not started`, `damaged`). Trials are named by the one trial-id rule
(`RunConfig.trials`). docs/cluster.md, "Where a run stands"."""
from __future__ import annotations

import logging
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lhd_train.errors import DataFileError, InputError, LhdError
from lhd_train.rundir.manifest import Manifest
from lhd_train.rundir.rows import RoundRow
from lhd_train.rundir.run import Run

log = logging.getLogger(__name__)

PENDING = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SUSPENDED", "STOPPED"}
RUNNING = {"RUNNING", "CONFIGURING", "COMPLETING", "RESIZING", "SIGNALING", "STAGE_OUT"}
FINISHED = {"COMPLETED"}
# everything else (FAILED, CANCELLED, TIMEOUT, NODE_FAIL, OUT_OF_MEMORY, PREEMPTED, BOOT_FAIL, DEADLINE) is failed
STAGE_JOBS = ("rollout", "merge", "audit", "data", "lens")


@dataclass
class Job:
    """One Slurm job or array task, as squeue/scontrol/sacct report it."""

    job_id: int  # the id Slurm gives this job or array task (its own, not the array's)
    name: str
    state: str  # Slurm's state, e.g. RUNNING, COMPLETED, CANCELLED
    array_job_id: int | None = None
    task: int | None = None  # array task id
    start: str | None = None
    end: str | None = None
    source: str = ""

    @property
    def label(self) -> str:
        return f"{self.array_job_id}_{self.task}" if self.task is not None else str(self.job_id)

    @property
    def status(self) -> str:
        return job_status(self.state)


def job_status(state: str) -> str:
    """Slurm's state → pending | running | finished | failed."""
    s = state.split()[0].rstrip("+").upper() if state else ""
    if s in PENDING:
        return "pending"
    if s in RUNNING:
        return "running"
    if s in FINISHED:
        return "finished"
    return "failed"


def _time(value: str | None) -> str | None:
    return None if not value or value in ("N/A", "NONE", "Unknown", "None") else value


def _expand_tasks(spec: str) -> list[int]:
    """`0-3,5%2` → [0, 1, 2, 3, 5] (squeue without -r or scontrol on a pending array)."""
    out: list[int] = []
    for part in spec.split("%")[0].strip("[]").split(","):
        if "-" in part:
            a, b = part.split("-", 1)
            out += list(range(int(a), int(b) + 1))
        elif part.strip().isdigit():
            out.append(int(part))
    return out


def _run(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def _squeue(names: set[str]) -> list[Job]:
    # %A: the job's own id (each array task has one once it starts; pending tasks share the array's),
    # %F: the array's job id, %K: the array task id (N/A outside arrays); -r lists tasks one by one
    out = _run(["squeue", "-h", "-r", "-o", "%A|%F|%K|%j|%T|%S|%e"])
    jobs = []
    for line in (out or "").splitlines():
        parts = line.split("|")
        if len(parts) != 7 or parts[3] not in names or not parts[0].isdigit():
            continue
        own, array_id, task, name, state, start, end = parts
        if task.strip().isdigit() and array_id.isdigit():
            jobs.append(Job(int(own), name, state, int(array_id), int(task), _time(start), _time(end), "squeue"))
        else:
            jobs.append(Job(int(own), name, state, None, None, _time(start), _time(end), "squeue"))
    return jobs


def _scontrol(names: set[str]) -> list[Job]:
    out = _run(["scontrol", "-o", "show", "job"])
    jobs = []
    for line in (out or "").splitlines():
        kv: dict[str, str] = {m.group(1): m.group(2) for m in re.finditer(r"(\w+)=(\S*)", line)}
        if kv.get("JobName") not in names or not kv.get("JobId", "").isdigit():
            continue
        state = kv.get("JobState", "")
        tasks = _expand_tasks(kv["ArrayTaskId"]) if kv.get("ArrayTaskId") else []
        array_id = int(kv["ArrayJobId"]) if kv.get("ArrayJobId", "").isdigit() else None
        if not tasks:
            jobs.append(Job(int(kv["JobId"]), kv["JobName"], state, None, None, _time(kv.get("StartTime")),
                            _time(kv.get("EndTime")), "scontrol"))
        for t in tasks:
            jobs.append(Job(int(kv["JobId"]), kv["JobName"], state, array_id, t, _time(kv.get("StartTime")),
                            _time(kv.get("EndTime")), "scontrol"))
    return jobs


def _sacct(names: set[str]) -> list[Job]:
    """Finished jobs from Slurm accounting (absent where the cluster has no slurmdbd)."""
    out = _run(["sacct", "-X", "-P", "-n", "--starttime", "now-14days", "--name", ",".join(sorted(names)),
                "-o", "JobIDRaw,JobID,JobName,State,Start,End"])
    jobs = []
    for line in (out or "").splitlines():
        parts = line.split("|")
        if len(parts) != 6 or parts[2] not in names or not parts[0].isdigit():
            continue
        raw, jid, name, state, start, end = parts
        m = re.fullmatch(r"(\d+)_(\d+)", jid)
        jobs.append(Job(int(raw), name, state, int(m.group(1)) if m else None, int(m.group(2)) if m else None,
                        _time(start), _time(end), "sacct"))
    return jobs


def slurm_jobs(names: set[str]) -> tuple[list[Job], str | None]:
    """The jobs with one of `names`, from squeue, then scontrol, then sacct (first source wins per
    job or array task), and a note when Slurm's commands are not on PATH."""
    if shutil.which("squeue") is None:
        return [], "Slurm commands not found (no squeue on PATH): states come from the run directories only"
    if _run(["squeue", "-h", "-o", "%i"]) is None:
        return [], "squeue failed (controller down or unreachable?): states come from the run directories only"
    seen: dict[tuple[int, int | None], Job] = {}
    for source in (_squeue, _scontrol, _sacct):
        for j in source(names):
            key = (j.array_job_id or j.job_id, j.task)
            seen.setdefault(key, j)
    return sorted(seen.values(), key=lambda j: ((j.array_job_id or j.job_id), j.task or 0)), None


# ----------------------------------------------------------------------------- the run directory


@dataclass
class Row:
    """One line of the status table."""

    stage: str
    part: str
    status: str  # pending | running | finished | failed | incomplete | not started | damaged
    detail: str = ""
    job: str = ""
    slurm_state: str = ""


@dataclass
class RunStatus:
    run_name: str
    run_dir: Path
    rows: list[Row] = field(default_factory=list)
    note: str | None = None

    def get(self, stage: str, part: str = "") -> Row:
        for r in self.rows:
            if r.stage == stage and r.part == part:
                return r
        raise KeyError((stage, part))


def _locate(run: Path) -> tuple[str, Path, list[str] | None, str | None]:
    """(run_name, output_dir, the run's trial ids in order or None, performer model) from a run
    config or a run directory."""
    run = Path(run)
    if run.is_file():
        from lhd_train.config.run import load_config

        cfg = load_config(run)
        model = cfg.models[cfg.performer.model].model if cfg.performer else None
        return cfg.run_name, Path(cfg.output_dir), [tid for tid, _ in cfg.trials()], model
    if run.is_dir():
        return run.name, run.parent, None, None
    raise InputError(run, None, "neither a run config nor a run directory (runs/<run_name>)")


def _manifest(run: Run) -> Manifest | None:
    """The run's manifest; a damaged one is logged and read as absent (status only reports)."""
    try:
        return run.manifest()
    except DataFileError as e:
        log.warning("%s", e)
        return None


def run_trial_ids(run: Run) -> list[str]:
    """A run directory's trials, in order: the manifest's list (written by `lhd run` from
    `RunConfig.trials` before the first round, or by `lhd merge`), else the saved config's
    `RunConfig.trials`, else the trials with a file on disk."""
    manifest = _manifest(run)
    if manifest is not None and manifest.trials:
        return list(manifest.trials)
    if run.dir.config.is_file():
        from lhd_train.config.run import load_config

        try:
            return [tid for tid, _ in load_config(run.dir.config).trials()]
        except LhdError as e:  # not a whole run config (a hand-made folder): the files on disk say
            log.info("%s: %s", run.dir.config, e)
    return run.trial_ids()


@dataclass
class DirProgress:
    """One run directory's progress from its files alone."""

    status: str  # finished | incomplete | not started | damaged
    detail: str
    rounds: dict[str, int] = field(default_factory=dict)  # trial id -> rounds on disk


def _dir_progress(run_dir: Path, trial_ids: list[str] | None) -> DirProgress:
    """How far a run directory is: each trial read as `lhd run` reads it (`TrialStore.read`: the
    rows checked, the `.done` marker held against them), safe beside a writer."""
    if not run_dir.is_dir():
        return DirProgress("not started", "no run directory")
    run = Run.at(run_dir)
    ids = run_trial_ids(run) if trial_ids is None else trial_ids
    done = 0
    rounds: dict[str, int] = {}
    for tid in ids:
        try:
            rows, finished = run.trial(tid).read(RoundRow)
        except DataFileError as e:
            return DirProgress("damaged", f"trial {tid}: {e}", rounds)
        done += finished
        if rows:
            rounds[tid] = len(rows)
    n_rows = sum(rounds.values())
    status = "finished" if ids and done == len(ids) else ("incomplete" if n_rows or done else "not started")
    return DirProgress(status, f"{done}/{len(ids)} trials done, {n_rows} rows", rounds)


def _shard_counts(output_dir: Path, run_name: str, jobs: list[Job]) -> list[int]:
    counts = set()
    for p in output_dir.glob(f"{run_name}-shard*of*"):
        m = re.fullmatch(re.escape(run_name) + r"-shard(\d+)of(\d+)", p.name)
        if m and p.is_dir():
            counts.add(int(m.group(2)))
    if not counts:  # nothing on disk yet: the array's size, as far as Slurm shows it
        tasks = [j.task for j in jobs if j.name == f"lhd-rollout-{run_name}" and j.task is not None]
        if tasks:
            counts.add(max(tasks) + 1)
    return sorted(counts)


def _newest(jobs: list[Job], name: str, task: int | None = None, any_task: bool = False) -> list[Job]:
    js = [j for j in jobs if j.name == name and (any_task or j.task == task)]
    if not js:
        return []
    newest = max(j.array_job_id or j.job_id for j in js)
    return [j for j in js if (j.array_job_id or j.job_id) == newest]


def _combine(jobs: list[Job]) -> tuple[str, str, str]:
    """(status, job label, slurm state) of the newest submission of one shard/stage (an array
    counts as failed if a task failed, running if one runs, pending if one waits)."""
    if not jobs:
        return "", "", ""
    states = [j.status for j in jobs]
    for s in ("failed", "running", "pending", "finished"):
        if s in states:
            pick = next(j for j in jobs if j.status == s)
            label = pick.label if len(jobs) == 1 else str(pick.array_job_id or pick.job_id)
            return s, label, pick.state
    return "", "", ""


def run_status(run: Path, shards: int | None = None, use_slurm: bool = True) -> RunStatus:
    """The state of every shard and stage of a run (RUN: its config or its merged run directory)."""
    run_name, output_dir, trial_ids, model = _locate(run)
    names = {f"lhd-{s}-{run_name}{m}" for s in STAGE_JOBS for m in ("", "-merge")}
    if model:
        names |= {f"lhd-lens-{Path(model).name}", f"lhd-lens-{Path(model).name}-merge"}
    jobs, note = slurm_jobs(names) if use_slurm else ([], "Slurm not asked (--no-slurm)")
    st = RunStatus(run_name, output_dir / run_name, note=note)
    from lhd_train.ops.merge import MERGE_KIND
    from lhd_train.rundir.shard import shard_items

    for n in ([shards] if shards else _shard_counts(output_dir, run_name, jobs)):
        for i in range(n):
            ids = shard_items(trial_ids, i, n) if trial_ids else None
            shard = _dir_progress(output_dir / f"{run_name}-shard{i}of{n}", ids)
            s, label, raw = _combine(_newest(jobs, f"lhd-rollout-{run_name}", i))
            st.rows.append(Row("rollout", f"shard {i}/{n}", s or shard.status, shard.detail, label, raw))
    merged = Run.at(output_dir / run_name)
    manifest = _manifest(merged) if merged.path.is_dir() else None
    source = manifest.source if manifest is not None else None
    is_merge = source is not None and source.kind == MERGE_KIND
    mjobs = _newest(jobs, f"lhd-rollout-{run_name}-merge") or _newest(jobs, f"lhd-merge-{run_name}")
    s, label, raw = _combine(mjobs)
    audits = merged.dir.auditor_ids() if merged.path.is_dir() else []
    shown = merged.path.is_dir() and bool(s or is_merge or not st.rows)
    progress = _dir_progress(merged.path, trial_ids) if shown or audits else None
    rounds = progress.rounds if progress is not None else {}
    if shown and progress is not None:
        detail = progress.detail
        if source is not None and is_merge:
            detail = f"merged from {len(source.sources)} shard(s); {detail}"
        st.rows.append(Row("merge" if (is_merge or s) else "run", "", s or progress.status, detail, label, raw))
    elif s:
        st.rows.append(Row("merge", "", s, "no merged run directory yet", label, raw))
    s, label, raw = _combine(_newest(jobs, f"lhd-audit-{run_name}", any_task=True))
    for aid in audits:
        auditor = merged.auditor(aid)
        try:  # labelled rounds: each round once, by the one winning-row rule
            got = {tid: len(auditor.labels(tid)) for tid in auditor.trial_ids()}
        except DataFileError as e:
            st.rows.append(Row("audit", aid, s or "damaged", str(e), label, raw))
            continue
        complete = bool(rounds) and all(got.get(t, 0) >= n for t, n in rounds.items())
        detail = f"{sum(got.values())} rounds labelled of {sum(rounds.values())}"
        st.rows.append(Row("audit", aid, s or ("finished" if complete else "incomplete"), detail, label, raw))
    if s and not audits:
        st.rows.append(Row("audit", "", s, "no audit rows yet", label, raw))
    for stage, name in (("data", f"lhd-data-{run_name}"), ("lens", f"lhd-lens-{Path(model).name}" if model else "")):
        s, label, raw = _combine(_newest(jobs, name, any_task=True))
        if s:
            st.rows.append(Row(stage, "", s, "", label, raw))
        ms, mlabel, mraw = _combine(_newest(jobs, f"{name}-merge"))
        if ms:
            st.rows.append(Row(stage, "merge", ms, "", mlabel, mraw))
    return st


def status_json(st: RunStatus) -> dict[str, Any]:
    return {"run_name": st.run_name, "run_dir": str(st.run_dir), "note": st.note,
            "rows": [r.__dict__ for r in st.rows]}
