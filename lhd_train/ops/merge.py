"""`lhd merge RUN_DIRS... --out RUN`: join sharded run directories into one run directory.

Joined: every trial's files, schedules, audit rows, `logs/` and `tasks.json`; written fresh:
`config.resolved.yaml`, `manifest.json` and `summary.json`. The sources must share one config, a
trial id comes from one source only, a re-merge is safe (grown trials replace shorter copies;
audit rows are joined and counted by `rundir.store.winning_audit_rows`), and everything is checked
before anything is written. Files are read through `rundir.run.Run` but copied byte for byte.
docs/cluster.md, "Sharding and merging", gives the rules."""
from __future__ import annotations

import functools
import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lhd_train.errors import InputError
from lhd_train.finetune.records import DATA_DIR, DATA_RECORD, DataPart, DataRecord, read_data_record, write_data_record
from lhd_train.io.files import atomic_write, atomic_write_bytes
from lhd_train.io.files import sha256_file as _sha
from lhd_train.io.provenance import utc_now as _now
from lhd_train.rundir.layout import CONFIG, LOCK, TASKS
from lhd_train.rundir.lock import run_dir_lock
from lhd_train.rundir.manifest import AuditorRecord, Manifest, MergedSource, RunSource, SourceOutcome, Summary
from lhd_train.rundir.names import name_problem, parse_trial_id
from lhd_train.rundir.rows import RoundRow
from lhd_train.rundir.run import AuditorStore, Run
from lhd_train.rundir.shard import parse_shard_run_name
from lhd_train.rundir.staging import staged_dir

MERGE_KIND = "lhd merge"
# Fields a shard legitimately changes (or that do not change what is computed).
IGNORED_CONFIG_KEYS = ("run_name", "seeds", "num_trials", "seed", "concurrency", "output_dir")
# auditor.json fields that define an auditor id (lhd_train.audit.runner.IDENTITY_KEYS).
AUDITOR_IDENTITY = ("options", "model_identity", "role", "prompts")
_MISSING = object()


def _first_difference(a: Any, b: Any, prefix: str = "") -> tuple[str, Any, Any] | None:
    """The first dotted field where two parsed YAML documents differ (keys in `a`'s order)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            d = _first_difference(a.get(k, _MISSING), b.get(k, _MISSING), f"{prefix}{k}.")
            if d:
                return d
        return None
    if a != b:
        return prefix.rstrip("."), a, b
    return None


def comparable_config(cfg: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in cfg.items() if k not in IGNORED_CONFIG_KEYS}


def _show(v: Any) -> str:
    return "(absent)" if v is _MISSING else json.dumps(v, default=str)


@dataclass
class Source:
    run: Run
    config: dict[str, Any]  # config.resolved.yaml as written (compared field by field)
    manifest: Manifest | None
    summary: Summary | None
    trials: list[str]  # trial ids, in the source's manifest order
    shard: tuple[int, int] | None
    order: int  # position among the merge's inputs (tie-break)

    @property
    def path(self) -> Path:
        return self.run.path

    @property
    def run_name(self) -> str:
        return str(self.config.get("run_name") or self.path.name)

    def seeds(self) -> list[int]:
        """The seeds of the trials this source holds (read from their ids by the one trial-id
        rule), in its config's order (a shard whose config lists the whole grid contributes only
        the seeds it ran)."""
        listed = [int(x) for x in (self.config.get("seeds") or (self.manifest.seeds if self.manifest else None) or [])]
        present = _union([[parsed[0]] for t in self.trials if (parsed := parse_trial_id(t)) is not None])
        return [s for s in listed if s in present] + [s for s in present if s not in listed]

    def record(self) -> MergedSource:
        """What the merged manifest records of this source (`merged_at` is set by the merge)."""
        m = self.manifest
        return MergedSource(path=str(self.path), run_name=self.run_name,
                            shard=list(self.shard or ()), seeds=self.seeds(), trials=self.trials,
                            host=m.host if m else None, started_at=m.started_at if m else None,
                            packages=m.packages if m else {})


def _trial_ids(run: Run) -> set[str]:
    """Every trial with a file in the run: rows, a `.done` marker or a schedule."""
    rd = run.dir
    ids = set(rd.trial_ids()) | set(rd.done_trial_ids())
    ids |= {p.stem for p in rd.schedules_dir.glob("*.json")}
    return ids


def _load_source(path: Path, order: int) -> Source:
    run = Run.open(Path(path).resolve(), source=str(path))
    if not run.dir.config.is_file():
        raise InputError(path, None, f"not a run directory of `lhd run` (no {CONFIG})")
    config = run.config()
    manifest = run.manifest()
    rank = {t: k for k, t in enumerate((manifest.trials if manifest else None) or [])}
    trials = sorted(_trial_ids(run), key=lambda t: (rank.get(t, len(rank)), t))
    parsed = parse_shard_run_name(str(config.get("run_name") or run.path.name))
    return Source(run, config, manifest, run.summary(), trials, (parsed[1], parsed[2]) if parsed else None, order)


# ----------------------------------------------------------------------------- file actions


@dataclass
class Plan:
    copies: list[tuple[Path, Path, str]] = field(default_factory=list)  # (src, dst, why)
    writes: list[tuple[Path, bytes]] = field(default_factory=list)
    unchanged: int = 0
    added_trials: list[str] = field(default_factory=list)
    updated_trials: list[str] = field(default_factory=list)
    audit_rows_added: int = 0


def _complete(data: bytes) -> bytes:
    """Whole lines only: a line torn by a crash (no newline yet) is left out; the writer that
    resumes truncates it and appends again (docs/formats.md)."""
    return data[: data.rfind(b"\n") + 1]


def _plan_append_only(src: Path, dst: Path, plan: Plan, what: str) -> str:
    """An append-only JSONL file: copy when missing, replace when `dst` is a prefix of `src` (the
    source grew), keep when equal or when `src` is a prefix of `dst`; anything else is a conflict."""
    a = _complete(src.read_bytes())
    if not dst.exists():
        plan.writes.append((dst, a))
        return "new"
    b = dst.read_bytes()
    if a == b or b.startswith(a):
        plan.unchanged += 1
        return "same"
    if a.startswith(b):
        plan.writes.append((dst, a))
        return "grown"
    raise InputError(src, what, f"differs from the merged copy {dst} (neither extends the other); "
                     "the merged run holds another version of this trial")


def _copy(src: Path, tmp: str) -> None:
    shutil.copy2(src, tmp)


def _plan_identical(src: Path, dst: Path, plan: Plan, what: str) -> None:
    if not dst.exists():
        plan.copies.append((src, dst, "new"))
    elif src.read_bytes() != dst.read_bytes():
        raise InputError(src, what, f"differs from {dst}")
    else:
        plan.unchanged += 1


def _audit_lines(auditor: AuditorStore, trial: str) -> list[bytes]:
    """The whole lines of an auditor's row file for one trial, each checked as a row
    (`AuditorStore.rows`); a torn last line is left out (docs/formats.md)."""
    auditor.rows(trial)  # every line a valid AuditRow, or a DataFileError naming it
    path = auditor.rd.audit_rows(auditor.auditor_id, trial)
    data = _complete(path.read_bytes()) if path.exists() else b""
    return [line + b"\n" for line in data.split(b"\n") if line.strip()]


def _plan_audit(src: AuditorStore, dst: AuditorStore, plan: Plan, pending: dict[Path, list[bytes]]) -> None:
    """Every row of `src` the merged file does not hold yet (the same line) is appended after the
    rows there; readers pick each round's row by `winning_audit_rows` (see the module docstring)."""
    for trial in src.trial_ids():
        path = dst.rd.audit_rows(dst.auditor_id, trial)
        if path not in pending:
            pending[path] = _audit_lines(dst, trial)
        have = set(pending[path])
        new = [line for line in _audit_lines(src, trial) if line not in have]
        if new:
            pending[path].extend(new)
            plan.audit_rows_added += len(new)
        else:
            plan.unchanged += 1


def _check_auditor(auditor: AuditorStore, known: dict[str, tuple[Path, AuditorRecord]]) -> None:
    """One auditor id, one setting: the identity fields of every `auditor.json` agree."""
    record = auditor.record()
    aid = auditor.auditor_id
    if record is None:
        return
    if aid not in known:
        known[aid] = (auditor.rd.auditor_info(aid), record)
        return
    first_path, first = known[aid]
    for key in AUDITOR_IDENTITY:
        a, b = getattr(first, key), getattr(record, key)
        if a != b:
            raise InputError(auditor.rd.auditor_info(aid), key,
                             f"auditor '{aid}' was run with other settings than in {first_path} "
                             f"({json.dumps(a, default=str)[:200]} vs {json.dumps(b, default=str)[:200]}); audit rows "
                             "of different settings must not share an auditor id")


# ----------------------------------------------------------------------------- merge


def _ordered(sources: list[Source]) -> list[Source]:
    return sorted(sources, key=lambda s: (s.shard[0] if s.shard else 1 << 30, s.order))


def _union(lists: list[list[Any]]) -> list[Any]:
    """The items of `lists` in first-seen order, each once."""
    return list(dict.fromkeys(x for lst in lists for x in lst))


def merge_runs(run_dirs: list[Path], out: Path, run_name: str | None = None) -> dict[str, Any]:
    """Join sharded run directories into `out` (created or extended). Returns what was done:
    `{out, run_name, sources, trials, seeds, added_trials, updated_trials, files_copied,
    files_unchanged, audit_rows_added, changed}`. Raises InputError (naming the file and field)
    for a mismatched config, a trial id in two sources, or a conflicting file. Holds the lock of
    `out` and of every source (a shard still being written is not merged half-way)."""
    if run_name is not None and (problem := name_problem(run_name)):  # `../x` would leave output_dir
        raise InputError("command line", "--run-name", problem)
    with run_dir_lock(out, *run_dirs, stage="lhd merge"):
        return _merge_runs(run_dirs, out, run_name)


def _merge_runs(run_dirs: list[Path], out: Path, run_name: str | None) -> dict[str, Any]:
    out = Path(out)
    if not run_dirs:
        raise InputError("command line", "RUN_DIRS", "give at least one run directory to merge")
    paths: list[Path] = []
    for p in run_dirs:
        rp = Path(p).resolve()
        if rp not in paths:
            paths.append(rp)
    if out.resolve() in paths:
        raise InputError(out, None, "--out is also one of the inputs; merge into a new directory")
    sources = [_load_source(p, k) for k, p in enumerate(paths)]

    # An existing merged run: its config takes part in the comparison, its sources are kept.
    merged = Run.at(out)
    ro = merged.dir
    prev_manifest = merged.manifest()
    prev_cfg = None
    prev_sources: list[MergedSource] = []
    if out.exists() and any(p.name != LOCK for p in out.iterdir()):
        prev_source = prev_manifest.source if prev_manifest is not None else None
        if prev_source is None or prev_source.kind != MERGE_KIND:
            raise InputError(out, None, "exists and is not a run made by `lhd merge`; choose another --out")
        prev_cfg = merged.config()
        prev_sources = list(prev_source.sources or [])

    ref_path, ref = (ro.config, prev_cfg) if prev_cfg is not None else \
        (sources[0].run.dir.config, sources[0].config)
    for s in sources:
        d = _first_difference(comparable_config(ref), comparable_config(s.config))
        if d:
            fld, a, b = d
            raise InputError(s.run.dir.config, fld,
                             f"differs from {ref_path} ({_show(a)} there, {_show(b)} here); only runs of one config "
                             f"can be merged (ignored: {', '.join(IGNORED_CONFIG_KEYS)})")

    # A trial id belongs to one source.
    owner: dict[str, Source] = {}
    for s in sources:
        for t in s.trials:
            if t in owner:
                raise InputError(s.run.dir.trials_dir, t, f"trial '{t}' is also in {owner[t].path}; "
                                 "shards must not share trials (was a shard run twice under two names?)")
            owner[t] = s
    prev_owner = {t: rec.path for rec in prev_sources for t in rec.trials or []}
    for t, s in owner.items():
        if prev_owner.get(t) not in (None, str(s.path)):
            raise InputError(s.run.dir.trials_dir, t, f"trial '{t}' is already in {out} from {prev_owner[t]}")

    # Plan every file before writing anything.
    plan = Plan()
    audit_pending: dict[Path, list[bytes]] = {}
    auditors: dict[str, tuple[Path, AuditorRecord]] = {}
    for aid in ro.auditor_ids():
        _check_auditor(merged.auditor(aid), auditors)
    for s in _ordered(sources):
        rd = s.run.dir
        for t in s.trials:
            src_trial, out_t = s.run.trial(t), ro.trial(t)
            src_t = src_trial.files
            existed = out_t.rows.exists()
            states = []
            src_trial.rows()  # whole rows, no round twice, before any copy
            for src, dst in ((src_t.rows, out_t.rows), (src_t.messages, out_t.messages)):
                if src.exists():
                    states.append(_plan_append_only(src, dst, plan, f"trials/{dst.name}"))
            if src_trial.done_marker() is not None:
                if out_t.done.exists():
                    plan.unchanged += 1
                else:
                    plan.copies.append((src_t.done, out_t.done, "new"))
                    states.append("grown")
            sched = rd.schedule(t)
            if sched.exists():
                _plan_identical(sched, ro.schedule(t), plan, f"schedules/{sched.name}")
            if not existed and src_t.rows.exists():
                plan.added_trials.append(t)
            elif "grown" in states:
                plan.updated_trials.append(t)
        for aid in rd.auditor_ids():
            auditor = s.run.auditor(aid)
            _check_auditor(auditor, auditors)
            _plan_audit(auditor, merged.auditor(aid), plan, audit_pending)
            info, out_info = rd.auditor_info(aid), ro.auditor_info(aid)
            if info.exists() and not out_info.exists() and not any(d == out_info for _, d, _ in plan.copies):
                plan.copies.append((info, out_info, "new"))
        if rd.tasks.exists():
            _plan_identical(rd.tasks, ro.tasks, plan, TASKS)
        for f in sorted(rd.logs_dir.rglob("*")) if rd.logs_dir.is_dir() else []:
            if f.is_file():
                dst = ro.logs_dir / s.run_name / f.relative_to(rd.logs_dir)
                if dst.exists() and dst.stat().st_size == f.stat().st_size and _sha(dst) == _sha(f):
                    plan.unchanged += 1
                else:
                    plan.copies.append((f, dst, "log"))
    for dst, lines in audit_pending.items():
        body = b"".join(lines)
        if not dst.exists() or dst.read_bytes() != body:
            plan.writes.append((dst, body))

    # Sources now and before, in shard order; seeds and trials are their unions.
    records: dict[str | None, MergedSource] = {rec.path: rec for rec in prev_sources}
    for s in sources:
        rec = s.record()
        old = records.get(rec.path)
        unchanged = old is not None and old.model_copy(update={"merged_at": None}).to_json() == \
            rec.model_copy(update={"merged_at": None}).to_json()
        merged_at = old.merged_at if old is not None and unchanged else _now()
        records[rec.path] = rec.model_copy(update={"merged_at": merged_at})
    first_seen = {p: k for k, p in enumerate(records)}
    ordered = sorted(records.values(), key=lambda r: ((r.shard or [1 << 30])[0], first_seen[r.path]))
    seeds = _union([r.seeds or [] for r in ordered])
    trials = _union([r.trials or [] for r in ordered])

    name = run_name or (prev_cfg or {}).get("run_name") or out.name
    if problem := name_problem(str(name)):
        raise InputError("command line", "--run-name", f"the merged run's name: {problem}")
    base = prev_cfg if prev_cfg is not None else _ordered(sources)[0].config
    cfg = dict(base)
    cfg.update({"run_name": name, "output_dir": str(out.parent), "seeds": seeds, "num_trials": None})
    cfg_text = yaml.safe_dump(cfg, sort_keys=False)

    ref_manifest = prev_manifest or next((s.manifest for s in _ordered(sources) if s.manifest), None) or Manifest()
    starts = [r.started_at for r in ordered if r.started_at]
    manifest = ref_manifest.model_copy(update={
        "run_id": name, "seeds": seeds, "trials": trials,
        "started_at": min(starts) if starts else ref_manifest.started_at,
        "source": RunSource(kind=MERGE_KIND, sources=ordered)})
    manifest_changed = prev_manifest is None or prev_manifest.to_json() != manifest.to_json()

    body = cfg_text.encode("utf-8")
    if not ro.config.exists() or ro.config.read_bytes() != body:
        plan.writes.append((ro.config, body))

    # Apply.
    for folder in (ro.trials_dir, ro.schedules_dir, ro.logs_dir, ro.audit_dir):
        folder.mkdir(parents=True, exist_ok=True)
    # Each file through a temp file of its own, fsynced: a full disk leaves every file whole (old or new).
    for src, dst, _ in plan.copies:
        atomic_write(dst, functools.partial(_copy, src))
    for dst, body in plan.writes:
        atomic_write_bytes(dst, body)
    if manifest_changed:
        merged.write_manifest(manifest)
    summary_changed = _write_summary(merged, name, trials, ordered, sources)

    changed = bool(plan.copies or plan.writes or manifest_changed or summary_changed)
    return {"out": str(out), "run_name": name, "sources": [r.path for r in ordered], "trials": trials,
            "seeds": seeds, "added_trials": plan.added_trials, "updated_trials": plan.updated_trials,
            "files_copied": len(plan.copies), "files_written": len(plan.writes) + manifest_changed,
            "files_unchanged": plan.unchanged, "audit_rows_added": plan.audit_rows_added, "changed": changed}


def _write_summary(merged: Run, name: str, trials: list[str], records: list[MergedSource],
                   sources: list[Source]) -> bool:
    """`summary.json` of the merged run: per-trial results from the sources' summaries, usage
    recomputed from the merged rows, wall time = the longest source (shards run side by side),
    GPU-hours = the sum of each source's `gpu_hours_this_invocation`."""
    from lhd_train.bench.accounting import usage_by_role

    prev = merged.summary()
    by_path = {str(s.path): s.summary for s in sources}
    per_source: dict[str, SourceOutcome] = dict((prev.by_source if prev else None) or {})
    for rec in records:
        summ = by_path.get(str(rec.path))
        if summ is not None and rec.run_name is not None:
            per_source[rec.run_name] = SourceOutcome(wall_s=summ.wall_s, gpu_hours=summ.gpu_hours_this_invocation,
                                                        trials=summ.trials or [])
    names = [rec.run_name for rec in records]
    per_source = {k: per_source[k] for k in names if k in per_source} | \
        {k: v for k, v in per_source.items() if k not in names}
    outcome = {t.trial_id: t for v in per_source.values() for t in v.trials or []}
    rows = [r for t in trials for r in merged.trial(t).rows(RoundRow)]
    summary = Summary(
        run_id=name,
        wall_s=max((v.wall_s or 0.0 for v in per_source.values()), default=0.0),
        gpu_hours=round(sum(v.gpu_hours or 0.0 for v in per_source.values()), 4),
        gpu_hours_note="sum over the sources of the GPU-hours of their last `lhd run` invocation "
                       "(GPUs held x wall time); earlier invocations of a resumed shard are not counted",
        usage_by_role=usage_by_role(rows),
        trials=[outcome[t] for t in trials if t in outcome],
        by_source={k: v.model_copy(update={"trials": v.trials or []}) for k, v in per_source.items()},
    )
    if prev is not None and prev.to_json() == summary.to_json():
        return False
    merged.write_summary(summary)
    return True


# ----------------------------------------------------------------------------- datasets


def merge_datasets(parts: list[Path], out: Path) -> dict[str, Any]:
    """Join dataset folders built from shard runs (`lhd data bon|dpo|grpo` on each shard) into one
    `DatasetDict` at `out/dataset` with its record (rows, sha256, the parts: `finetune.records`).

    Splits are by trial (`lhd_train.finetune.contexts.split_of`), so the union of the shards' splits is
    the split the unsharded run would give. Parts must be of one kind and direction."""
    from datasets import DatasetDict, concatenate_datasets, load_from_disk

    if not parts:
        raise InputError("command line", "PARTS", "give at least one dataset folder")
    metas: list[DataRecord] = []
    dicts: list[Any] = []
    seen: dict[Path, Path] = {}
    for p in map(Path, parts):
        if p.resolve() in seen:  # `data merge P P` would count every row twice
            raise InputError("command line", "PARTS", f"{p} is given twice (also as {seen[p.resolve()]})")
        seen[p.resolve()] = p
    for p in map(Path, parts):
        meta = read_data_record(p)
        if not (p / DATA_DIR).is_dir() or meta is None:
            raise InputError(p, None, f"not a dataset folder of `lhd data` (needs {DATA_DIR}/ and {DATA_RECORD})")
        for key in ("kind", "direction"):
            if metas and getattr(meta, key) != getattr(metas[0], key):
                raise InputError(p / DATA_RECORD, key, f"{getattr(meta, key)!r} differs from "
                                 f"{getattr(metas[0], key)!r} in {parts[0]}")
        twin = next((q for q, m in zip(parts, metas, strict=False) if m.sha256 == meta.sha256), None)
        if twin is not None:  # a copy of a part under another name
            raise InputError(p / DATA_RECORD, "sha256", f"the same rows as {twin} (a copy of one part)")
        metas.append(meta)
        try:
            dicts.append(load_from_disk(str(p / DATA_DIR)))
        except (FileNotFoundError, ValueError) as e:
            raise InputError(p / DATA_DIR, None, f"not a saved dataset ({e})") from None
    splits = _union([list(d.keys()) for d in dicts])
    merged = DatasetDict({s: concatenate_datasets([d[s] for d in dicts if s in d]) for s in splits})
    out = Path(out)
    with staged_dir(out / DATA_DIR) as stage:  # a full disk leaves the old dataset/, never half of one
        merged.save_to_disk(str(stage))
    rows = {s: merged[s].num_rows for s in splits}
    blob = json.dumps({s: merged[s].to_list() for s in splits}, sort_keys=True, default=str).encode()
    first = {k: v for k, v in metas[0].to_json().items() if k not in ("rows", "sha256", "stats", "run")}
    write_data_record(out, DataRecord.model_validate({
        **first, "rows": rows, "sha256": hashlib.sha256(blob).hexdigest(),
        "parts": [DataPart(path=str(Path(p).resolve()), run=m.run, rows=m.rows, stats=m.stats)
                  for p, m in zip(parts, metas, strict=True)]}))
    return {"out": str(out / DATA_DIR), "rows": rows, "parts": len(parts)}
