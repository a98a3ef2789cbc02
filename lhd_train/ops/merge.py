"""`lhd merge RUN_DIRS... --out RUN`: join sharded run directories into one run directory.

What is joined (docs/formats.md): `trials/<trial>.jsonl`, `trials/<trial>.messages.jsonl`,
`trials/<trial>.done`, `schedules/<trial>.json`, `audit/<auditor-id>/<trial>.jsonl` (+ its
`auditor.json`), `logs/` (under `logs/<source run name>/`) and `tasks.json`. Written fresh:
`config.resolved.yaml` (the shared config, `seeds` = the union in shard order), `manifest.json`
(with `source: {kind: "lhd merge", sources: [...]}`) and `summary.json` (usage recomputed from the
rows, GPU-hours summed over the sources).

Rules:
- the sources must share one config, compared on `config.resolved.yaml` without `run_name`,
  `seeds`, `num_trials`, `seed`, `concurrency` and `output_dir`; the first differing field is named;
- a trial id may come from one source only (two sources with the same trial id are refused);
- merging again is safe: unchanged files are left alone (a re-merge of the same shards changes
  nothing on disk); a source whose trial grew since (it was resumed) replaces the shorter copy,
  as trajectory and message files are append-only; a new shard adds its trials; audit rows are
  joined by `global_round` (rows written into the merged run itself are kept);
- everything is checked before anything is written, so a refused merge leaves `out` as it was.

Rows are copied byte for byte, so each keeps the `run_id` of the shard that produced it; the
merged run's id is in its manifest and config (what `lhd report` reads)."""
from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lhd_train.errors import DataFileError, InputError
from lhd_train.ops.shard import parse_shard_run_name
from lhd_train.rundir.files import atomic_write, atomic_write_bytes
from lhd_train.rundir.files import read_json_mapping as _read_json
from lhd_train.rundir.files import read_yaml_mapping as _read_yaml
from lhd_train.rundir.files import sha256_file as _sha
from lhd_train.rundir.files import utc_now as _now
from lhd_train.rundir.layout import AUDITOR_INFO, CONFIG, LOCK, TASKS, RunDir
from lhd_train.rundir.lock import run_dir_lock
from lhd_train.rundir.names import name_problem
from lhd_train.rundir.staging import staged_dir
from lhd_train.rundir.store import read_trial_rows

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
    path: Path
    config: dict[str, Any]
    manifest: dict[str, Any]
    summary: dict[str, Any]
    trials: list[str]  # trial ids, in the source's manifest order
    shard: tuple[int, int] | None
    order: int  # position among the merge's inputs (tie-break)

    @property
    def run_name(self) -> str:
        return str(self.config.get("run_name") or self.path.name)

    def seeds(self) -> list[int]:
        """The seeds of the trials this source holds, in its config's order (a shard whose config
        lists the whole grid contributes only the seeds it ran)."""
        listed = [int(x) for x in (self.config.get("seeds") or self.manifest.get("seeds") or [])]
        present = []
        for t in self.trials:
            m = re.match(r"s(\d+)", t)
            if m and int(m.group(1)) not in present:
                present.append(int(m.group(1)))
        return [s for s in listed if s in present] + [s for s in present if s not in listed]

    def record(self) -> dict[str, Any]:
        return {"path": str(self.path), "run_name": self.run_name,
                "shard": list(self.shard) if self.shard else None, "seeds": self.seeds(), "trials": self.trials,
                "host": self.manifest.get("host"), "started_at": self.manifest.get("started_at"),
                "packages": self.manifest.get("packages")}


def _trial_ids(run_dir: Path) -> set[str]:
    rd = RunDir(run_dir)
    ids = set(rd.trial_ids()) | set(rd.done_trial_ids())
    ids |= {p.stem for p in rd.schedules_dir.glob("*.json")}
    return ids


def _load_source(path: Path, order: int) -> Source:
    path = Path(path)
    if not path.is_dir():
        raise InputError(path, None, "run directory not found")
    rd = RunDir(path)
    cfg_path = rd.config
    if not cfg_path.is_file() or not rd.is_run():
        raise InputError(path, None, f"not a run directory (needs {CONFIG} and trials/)")
    config = _read_yaml(cfg_path)
    manifest = _read_json(rd.manifest)
    ids = _trial_ids(path)
    rank = {t: k for k, t in enumerate(manifest.get("trials") or [])}
    trials = sorted(ids, key=lambda t: (rank.get(t, len(rank)), t))
    parsed = parse_shard_run_name(str(config.get("run_name") or path.name))
    return Source(path.resolve(), config, manifest, _read_json(rd.summary), trials,
                  (parsed[1], parsed[2]) if parsed else None, order)


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


def _plan_identical(src: Path, dst: Path, plan: Plan, what: str) -> None:
    if not dst.exists():
        plan.copies.append((src, dst, "new"))
    elif src.read_bytes() != dst.read_bytes():
        raise InputError(src, what, f"differs from {dst}")
    else:
        plan.unchanged += 1


def _rows(path: Path) -> list[tuple[dict[str, Any], str]]:
    """(row, raw line) pairs of a JSONL file; a torn last line is ignored (docs/formats.md)."""
    out = []
    if not path.exists():
        return out
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.endswith("\n"):
                break
            if line.strip():
                try:
                    out.append((json.loads(line), line))
                except ValueError as e:
                    raise DataFileError(path, f"not valid JSON ({e})", line=n) from None
    return out


def _plan_audit(src_dir: Path, dst_dir: Path, plan: Plan, pending: dict[Path, list[str]]) -> None:
    """Audit rows joined by global_round; existing rows (in `dst` or from an earlier source) win."""
    for src in sorted(src_dir.glob("*.jsonl")):
        dst = dst_dir / src.name
        if dst not in pending:
            pending[dst] = [raw for _, raw in _rows(dst)]
        have = {json.loads(raw)["global_round"] for raw in pending[dst]}
        new = [raw for row, raw in _rows(src) if row.get("global_round") not in have]
        if new:
            pending[dst].extend(new)
            plan.audit_rows_added += len(new)
        else:
            plan.unchanged += 1


def _check_auditor(src: Path, known: dict[str, tuple[Path, dict[str, Any]]], aid: str) -> None:
    info = _read_json(src)
    if not info:
        return
    if aid not in known:
        known[aid] = (src, info)
        return
    first_path, first = known[aid]
    for key in AUDITOR_IDENTITY:
        if first.get(key) != info.get(key):
            raise InputError(src, key, f"auditor '{aid}' was run with other settings than in {first_path} "
                             f"({json.dumps(first.get(key), default=str)[:200]} vs "
                             f"{json.dumps(info.get(key), default=str)[:200]}); audit rows of different "
                             "settings must not share an auditor id")


# ----------------------------------------------------------------------------- merge


def _ordered(sources: list[Source]) -> list[Source]:
    return sorted(sources, key=lambda s: (s.shard[0] if s.shard else 1 << 30, s.order))


def _union(lists: list[list[Any]]) -> list[Any]:
    out, seen = [], set()
    for lst in lists:
        for x in lst:
            if x not in seen:
                seen.add(x)
                out.append(x)
    return out


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
    ro = RunDir(out)
    prev_manifest = _read_json(ro.manifest)
    prev_cfg = None
    prev_sources: list[dict[str, Any]] = []
    if out.exists() and any(p.name != LOCK for p in out.iterdir()):
        if (prev_manifest.get("source") or {}).get("kind") != MERGE_KIND:
            raise InputError(out, None, "exists and is not a run made by `lhd merge`; choose another --out")
        prev_cfg = _read_yaml(ro.config)
        prev_sources = list(prev_manifest["source"].get("sources") or [])

    ref_path, ref = (ro.config, prev_cfg) if prev_cfg is not None else \
        (RunDir(sources[0].path).config, sources[0].config)
    for s in sources:
        d = _first_difference(comparable_config(ref), comparable_config(s.config))
        if d:
            fld, a, b = d
            raise InputError(RunDir(s.path).config, fld,
                             f"differs from {ref_path} ({_show(a)} there, {_show(b)} here); only runs of one config "
                             f"can be merged (ignored: {', '.join(IGNORED_CONFIG_KEYS)})")

    # A trial id belongs to one source.
    owner: dict[str, Source] = {}
    for s in sources:
        for t in s.trials:
            if t in owner:
                raise InputError(s.path / "trials", t, f"trial '{t}' is also in {owner[t].path}; "
                                 "shards must not share trials (was a shard run twice under two names?)")
            owner[t] = s
    prev_owner = {t: rec.get("path") for rec in prev_sources for t in rec.get("trials") or []}
    for t, s in owner.items():
        if prev_owner.get(t) not in (None, str(s.path)):
            raise InputError(s.path / "trials", t, f"trial '{t}' is already in {out} from {prev_owner[t]}")

    # Plan every file before writing anything.
    plan = Plan()
    audit_pending: dict[Path, list[str]] = {}
    auditors: dict[str, tuple[Path, dict[str, Any]]] = {}
    for aid_dir in sorted((out / "audit").glob("*/")):
        _check_auditor(aid_dir / AUDITOR_INFO, auditors, aid_dir.name)
    for s in _ordered(sources):
        for t in s.trials:
            src_t, out_t = RunDir(s.path).trial(t), ro.trial(t)
            existed = out_t.rows.exists()
            states = []
            read_trial_rows(src_t.rows)  # whole rows, no round twice, before any copy
            for src, dst in ((src_t.rows, out_t.rows), (src_t.messages, out_t.messages)):
                if src.exists():
                    states.append(_plan_append_only(src, dst, plan, f"trials/{dst.name}"))
            done = src_t.done
            if done.exists():
                if out_t.done.exists():
                    plan.unchanged += 1
                else:
                    plan.copies.append((done, out_t.done, "new"))
                    states.append("grown")
            sched = RunDir(s.path).schedule(t)
            if sched.exists():
                _plan_identical(sched, ro.schedule(t), plan, f"schedules/{sched.name}")
            if not existed and src_t.rows.exists():
                plan.added_trials.append(t)
            elif "grown" in states:
                plan.updated_trials.append(t)
        for aid_dir in sorted((s.path / "audit").glob("*/")):
            aid = aid_dir.name
            _check_auditor(aid_dir / AUDITOR_INFO, auditors, aid)
            _plan_audit(aid_dir, ro.auditor_dir(aid), plan, audit_pending)
            if (aid_dir / AUDITOR_INFO).exists() and not ro.auditor_info(aid).exists() \
                    and not any(d == ro.auditor_info(aid) for _, d, _ in plan.copies):
                plan.copies.append((aid_dir / AUDITOR_INFO, ro.auditor_info(aid), "new"))
        tasks = RunDir(s.path).tasks
        if tasks.exists():
            _plan_identical(tasks, ro.tasks, plan, TASKS)
        for f in sorted((s.path / "logs").rglob("*")) if (s.path / "logs").is_dir() else []:
            if f.is_file():
                dst = out / "logs" / s.run_name / f.relative_to(s.path / "logs")
                if dst.exists() and dst.stat().st_size == f.stat().st_size and _sha(dst) == _sha(f):
                    plan.unchanged += 1
                else:
                    plan.copies.append((f, dst, "log"))
    for dst, lines in audit_pending.items():
        body = "".join(lines).encode("utf-8")
        if not dst.exists() or dst.read_bytes() != body:
            plan.writes.append((dst, body))

    # Sources now and before, in shard order; seeds and trials are their unions.
    records: dict[str, dict[str, Any]] = {rec["path"]: rec for rec in prev_sources}
    changed_sources = set()
    for s in sources:
        rec = s.record()
        old = records.get(rec["path"])
        keep_time = old and {k: v for k, v in old.items() if k != "merged_at"} == rec
        rec["merged_at"] = old["merged_at"] if keep_time else _now()
        if not keep_time:
            changed_sources.add(rec["path"])
        records[rec["path"]] = rec
    first_seen = {p: k for k, p in enumerate(records)}
    ordered = sorted(records.values(), key=lambda r: ((r["shard"] or [1 << 30])[0], first_seen[r["path"]]))
    seeds = _union([r["seeds"] for r in ordered])
    trials = _union([r["trials"] for r in ordered])

    name = run_name or (prev_cfg or {}).get("run_name") or out.name
    if problem := name_problem(str(name)):
        raise InputError("command line", "--run-name", f"the merged run's name: {problem}")
    base = prev_cfg if prev_cfg is not None else _ordered(sources)[0].config
    cfg = dict(base)
    cfg.update({"run_name": name, "output_dir": str(out.parent), "seeds": seeds, "num_trials": None})
    cfg_text = yaml.safe_dump(cfg, sort_keys=False)

    ref_manifest = prev_manifest or next((s.manifest for s in _ordered(sources) if s.manifest), {})
    manifest = {k: v for k, v in ref_manifest.items() if k not in ("source",)}
    starts = [r["started_at"] for r in ordered if r.get("started_at")]
    manifest.update({"run_id": name, "seeds": seeds, "trials": trials,
                     "started_at": min(starts) if starts else manifest.get("started_at"),
                     "source": {"kind": MERGE_KIND, "sources": ordered}})
    manifest_text = json.dumps(manifest, indent=2, ensure_ascii=False)

    for path, text in ((ro.config, cfg_text), (ro.manifest, manifest_text)):
        body = text.encode("utf-8")
        if not path.exists() or path.read_bytes() != body:
            plan.writes.append((path, body))

    # Apply.
    for sub in ("trials", "schedules", "logs", "audit"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    # Each file through a temp file of its own, fsynced: a full disk leaves every file whole (old or new).
    for src, dst, _ in plan.copies:
        atomic_write(dst, lambda tmp, src=src: shutil.copy2(src, tmp))
    for dst, body in plan.writes:
        atomic_write_bytes(dst, body)
    summary_changed = _write_summary(out, name, trials, ordered, sources)

    changed = bool(plan.copies or plan.writes or summary_changed)
    return {"out": str(out), "run_name": name, "sources": [r["path"] for r in ordered], "trials": trials,
            "seeds": seeds, "added_trials": plan.added_trials, "updated_trials": plan.updated_trials,
            "files_copied": len(plan.copies), "files_written": len(plan.writes),
            "files_unchanged": plan.unchanged, "audit_rows_added": plan.audit_rows_added, "changed": changed}


def _write_summary(out: Path, name: str, trials: list[str], records: list[dict[str, Any]],
                   sources: list[Source]) -> bool:
    """`summary.json` of the merged run: per-trial results from the sources' summaries, usage
    recomputed from the merged rows, wall time = the longest source (shards run side by side),
    GPU-hours = the sum of each source's `gpu_hours_this_invocation`."""
    from lhd_train.bench.accounting import usage_by_role

    prev = _read_json(RunDir(out).summary)
    by_path = {str(s.path): s.summary for s in sources}
    per_source = dict(prev.get("by_source") or {})
    for rec in records:
        summ = by_path.get(rec["path"])
        if summ:
            per_source[rec["run_name"]] = {"wall_s": summ.get("wall_s"),
                                           "gpu_hours": summ.get("gpu_hours_this_invocation"),
                                           "trials": summ.get("trials") or []}
    names = [rec["run_name"] for rec in records]
    per_source = {k: per_source[k] for k in names if k in per_source} | \
        {k: v for k, v in per_source.items() if k not in names}
    trial_rows = {t["trial_id"]: t for v in per_source.values() for t in v.get("trials") or []
                  if isinstance(t, dict) and "trial_id" in t}
    rows = [r for t in trials for r in read_trial_rows(RunDir(out).trial(t).rows)]
    summary = {
        "run_id": name,
        "wall_s": max((v.get("wall_s") or 0.0 for v in per_source.values()), default=0.0),
        "gpu_hours": round(sum(v.get("gpu_hours") or 0.0 for v in per_source.values()), 4),
        "gpu_hours_note": "sum over the sources of the GPU-hours of their last `lhd run` invocation "
                          "(GPUs held x wall time); earlier invocations of a resumed shard are not counted",
        "usage_by_role": usage_by_role(rows),
        "trials": [trial_rows[t] for t in trials if t in trial_rows],
        "by_source": {k: {kk: vv for kk, vv in v.items() if kk != "trials"} | {"trials": v.get("trials") or []}
                      for k, v in per_source.items()},
    }
    body = json.dumps(summary, indent=2, ensure_ascii=False).encode("utf-8")
    path = RunDir(out).summary
    if path.exists() and path.read_bytes() == body:
        return False
    atomic_write_bytes(path, body)
    return True


# ----------------------------------------------------------------------------- datasets


def merge_datasets(parts: list[Path], out: Path) -> dict[str, Any]:
    """Join dataset folders built from shard runs (`lhd data bon|dpo|grpo` on each shard) into one
    `DatasetDict` at `out/dataset` with a `dataset.json` (rows, sha256, the parts' metadata).

    Splits are by trial (`lhd_train.finetune.contexts.split_of`), so the union of the shards' splits is
    the split the unsharded run would give. Parts must be of one kind and direction."""
    from datasets import DatasetDict, concatenate_datasets, load_from_disk

    if not parts:
        raise InputError("command line", "PARTS", "give at least one dataset folder")
    metas, dicts = [], []
    seen: dict[Path, Path] = {}
    for p in map(Path, parts):
        if p.resolve() in seen:  # `data merge P P` would count every row twice
            raise InputError("command line", "PARTS", f"{p} is given twice (also as {seen[p.resolve()]})")
        seen[p.resolve()] = p
    for p in parts:
        p = Path(p)
        meta = _read_json(p / "dataset.json")
        if not (p / "dataset").is_dir() or not meta:
            raise InputError(p, None, "not a dataset folder of `lhd data` (needs dataset/ and dataset.json)")
        for key in ("kind", "direction"):
            if metas and meta.get(key) != metas[0].get(key):
                raise InputError(p / "dataset.json", key, f"{meta.get(key)!r} differs from {metas[0].get(key)!r} "
                                 f"in {parts[0]}")
        twin = next((q for q, m in zip(parts, metas, strict=False) if meta.get("sha256") and
                     m.get("sha256") == meta.get("sha256")), None)
        if twin is not None:  # a copy of a part under another name
            raise InputError(p / "dataset.json", "sha256", f"the same rows as {twin} (a copy of one part)")
        metas.append(meta)
        try:
            dicts.append(load_from_disk(str(p / "dataset")))
        except (FileNotFoundError, ValueError) as e:
            raise InputError(p / "dataset", None, f"not a saved dataset ({e})") from None
    splits = _union([list(d.keys()) for d in dicts])
    merged = DatasetDict({s: concatenate_datasets([d[s] for d in dicts if s in d]) for s in splits})
    out = Path(out)
    with staged_dir(out / "dataset") as stage:  # a full disk leaves the old dataset/, never half of one
        merged.save_to_disk(str(stage))
    rows = {s: merged[s].num_rows for s in splits}
    blob = json.dumps({s: merged[s].to_list() for s in splits}, sort_keys=True, default=str).encode()
    meta = {k: v for k, v in metas[0].items() if k not in ("rows", "sha256", "stats", "run")}
    meta.update({"rows": rows, "sha256": hashlib.sha256(blob).hexdigest(),
                 "parts": [{"path": str(Path(p).resolve()), "run": m.get("run"), "rows": m.get("rows"),
                            "stats": m.get("stats")} for p, m in zip(parts, metas, strict=True)]})
    atomic_write_bytes(out / "dataset.json", json.dumps(meta, indent=2, default=str).encode("utf-8"))
    return {"out": str(out / "dataset"), "rows": rows, "parts": len(parts)}
