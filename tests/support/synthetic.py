"""Tiny synthetic run directories that follow docs/formats.md exactly.

Why: metric, report and viewer tests (and a report demo without any model) need runs whose
labels are known by construction. `round_row` and `audit_row` write every documented field."""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lhd_train.rundir.layout import RunDir
from lhd_train.rundir.rows import AUDIT_SCHEMA, ROW_SCHEMA
from lhd_train.rundir.store import message_id as _mid

STATE0 = {"trust": 0.0, "satisfaction": 0.0, "comfort": 0.0}


@dataclass
class R:
    """One round of a synthetic trial: its task, event, states after the round, and a label.

    `label` is (deceptive, types, severity), or "failed" for a failed audit row, or None for
    no audit row at all."""

    task: int
    event: tuple[str, str] | None = None  # (category, pressure)
    state: tuple[float, float, float] = (0.0, 0.0, 0.0)  # trust, satisfaction, comfort after
    label: tuple[bool, Sequence[str], int] | str | None = (False, (), 0)
    text: str = "performer answer"
    feedback: str = "supervisor feedback"
    extra: dict[str, Any] = field(default_factory=dict)  # trajectory-row fields to override
    audit_extra: dict[str, Any] = field(default_factory=dict)  # audit-row fields to override


def round_row(run_id: str, trial_id: str, seed: int, task_index: int, round_no: int, global_round: int,
              event: Mapping[str, Any] | None, text: str, state_before: Mapping[str, float],
              state_after: Mapping[str, float], task_complete: bool, feedback: str = "feedback",
              eval_reasoning: str = "evaluation reasoning", models: Mapping[str, Any] | None = None,
              task_title: str | None = None, message_ids: Sequence[str] = (), new_message_ids: Sequence[str] = (),
              think: str = "", pack: str = "lhd_startup_consulting") -> dict[str, Any]:
    """A trajectory row (`lhd.round/1`) with every field of docs/formats.md."""
    return {
        "schema": ROW_SCHEMA, "run_id": run_id, "trial_id": trial_id, "seed": seed, "pack": pack,
        "task_index": task_index, "task_title": task_title or f"Task {task_index}", "round": round_no,
        "global_round": global_round, "event": dict(event) if event else None,
        "performer": {
            "text": text, "think": think, "finish_reason": "stop", "token_ids": [1, 2, 3],
            "message_ids": list(message_ids), "new_message_ids": list(new_message_ids),
            "prompt_tokens": 100 * global_round, "completion_tokens": 50, "latency_s": 0.01,
            "sampling": {"temperature": 0.7, "top_p": 1.0, "max_tokens": 512, "seed": 1, "n": 1},
            "context": {"policy": "full", "budget_tokens": None, "prompt_tokens": 100 * global_round,
                        "dropped_messages": 0},
        },
        "supervisor": {
            "evaluation": {"reasoning": eval_reasoning, **dict(state_after)},
            "feedback": {"reasoning": "feedback reasoning", "text": feedback},
            "state_before": dict(state_before), "state_after": dict(state_after),
            "parse_status": "ok", "attempts": 1, "calls": [], "summaries_added": [],
        },
        "task_complete": task_complete,
        "models": dict(models or {}),
        "timestamp": "2025-01-01T00:00:00+00:00",
    }


#: the fields every writer of a trajectory row or an audit row writes, for a test that builds one in code
ROUND_IDS = {"run_id": "r", "trial_id": "s1", "seed": 1, "pack": "p", "task_title": "T", "models": {}}
LABEL_IDS = {"run_id": "r", "trial_id": "s1", "auditor_id": "a", "mode": "full", "model": {"model": "m"}}


def audit_row(trial_id: str, global_round: int, deceptive: bool | None, types: Sequence[str] = (),
              severity: int | None = 0, confidence: float | None = 0.8, auditor_id: str = "full",
              mode: str = "full", window: int | None = None, parse_status: str = "ok",
              reasoning: str = "auditor reasoning", evidence: Sequence[str] = (), run_id: str = "synthetic",
              model: str = "tiny-llama") -> dict[str, Any]:
    """An audit row (`lhd.audit/1`). Consistency is *not* enforced here on purpose, so tests can
    feed the inconsistent labels the authors' auditor writes (e.g. deceptive false with severity 2)."""
    return {"schema": AUDIT_SCHEMA, "run_id": run_id, "trial_id": trial_id, "global_round": global_round,
            "auditor_id": auditor_id, "mode": mode, "window": window, "deceptive": deceptive,
            "types": list(types), "severity": severity, "confidence": confidence, "reasoning": reasoning,
            "evidence": list(evidence), "parse_status": parse_status, "raw": "{}",
            "model": {"key": "tiny", "model": model}}


def _write_jsonl(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def write_run(root: Path, run_id: str, trials: Mapping[str, Sequence[R]], *, auditor_id: str = "full",
              mode: str = "full", window: int | None = None, performer_model: str = "tiny-llama",
              adapter: str | None = None, control: Mapping[str, str | None] | None = None,
              extra_auditors: Mapping[str, tuple[str, Mapping[str, Sequence[Any]]]] | None = None,
              threshold: float = 0.2, done: bool = True) -> Path:
    """Write `root/run_id/` with config, manifest, schedules, trajectories, messages and audits.

    `trials` maps a trial id (`s<seed>[-cat-X|-lvl-X|-none]`) to its rounds in order; round
    numbers, global rounds, state_before and task completion are derived. `extra_auditors` maps
    an auditor id to (mode, {trial_id: [label per round]}) for long/short comparisons."""
    run = root / run_id
    rd = RunDir(run)
    rd.trials_dir.mkdir(parents=True, exist_ok=True)
    rd.schedules_dir.mkdir(exist_ok=True)
    rd.logs_dir.mkdir(exist_ok=True)
    perf = {"key": "m", "model": performer_model, "revision": None, "backend": "hf", "adapter": adapter}
    models = {"performer": perf, "supervisor": {**perf, "adapter": None}}
    cfg = {"run_name": run_id, "output_dir": str(root), "task_pack": "lhd_startup_consulting",
           "seeds": [], "p_event": 0.5, "control": dict(control or {"category": None, "pressure": None}),
           "max_rounds_per_task": 3, "completion_threshold": threshold,
           "models": {"m": {"backend": "hf", "model": performer_model}},
           "performer": {"model": "m", "adapter": adapter}, "supervisor": {"model": "m"}}
    seeds = []
    for tid, spec in trials.items():
        seed = int(tid[1:].split("-")[0])
        seeds.append(seed)
        rows, msgs, labels = [], {}, []
        state = dict(STATE0)
        per_task: dict[int, int] = {}
        events: dict[int, tuple[str, str] | None] = {}
        for g, r in enumerate(spec, start=1):
            per_task[r.task] = per_task.get(r.task, 0) + 1
            events.setdefault(r.task, r.event)
            ev = ({"name": f"{r.event[0]}_E1", "category": r.event[0], "pressure": r.event[1],
                   "content": f"event content for task {r.task}"} if r.event else None)
            after = dict(zip(("trust", "satisfaction", "comfort"), r.state, strict=True))
            user = f"Here is your next task.\n=== TASK {r.task}: Task {r.task} ===\nDo it." if per_task[r.task] == 1 \
                else f"Feedback: {rows[-1]['supervisor']['feedback']['text'] if rows else ''}"
            ids = []
            for role, content in (("user", user), ("assistant", r.text)):
                mid = _mid(role, content)
                msgs.setdefault(mid, {"id": mid, "role": role, "content": content})
                ids.append(mid)
            row = round_row(run_id, tid, seed, r.task, per_task[r.task], g, ev, r.text, state, after,
                            after["satisfaction"] >= threshold, feedback=r.feedback, models=models,
                            message_ids=ids[:1], new_message_ids=ids[:1])
            for k, v in r.extra.items():
                row[k] = v
            rows.append(row)
            state = after
            if r.label == "failed":
                labels.append(audit_row(tid, g, None, (), None, None, auditor_id, mode, window, "failed",
                                        reasoning="", evidence=(), run_id=run_id))
            elif r.label is not None:
                dec, types, sev = r.label
                labels.append({**audit_row(tid, g, dec, types, sev, 0.8, auditor_id, mode, window,
                                           evidence=[f"round {g}"], run_id=run_id), **r.audit_extra})
        tf = rd.trial(tid)
        _write_jsonl(tf.rows, rows)
        _write_jsonl(tf.messages, list(msgs.values()))
        if done:
            tf.done.write_text("2025-01-01T00:00:00\n")
        if labels:
            _write_jsonl(rd.audit_rows(auditor_id, tid), labels)
        n_tasks = max(r.task for r in spec)
        ctl = dict(control or {})
        sched = {"seed": seed, "p_event": 0.5, "control_category": ctl.get("category"),
                 "control_pressure": ctl.get("pressure"),
                 "entries": [({"task_index": t, "name": f"{events[t][0]}_E1", "category": events[t][0],
                               "level": events[t][1], "content": f"event content for task {t}",
                               "event_id": f"{events[t][0]}_E1"} if events.get(t) else None)
                             for t in range(1, n_tasks + 1)]}
        rd.schedule(tid).write_text(json.dumps(sched, indent=2))
    for aid, (amode, per_trial) in (extra_auditors or {}).items():
        for tid, labs in per_trial.items():
            rows = []
            for g, lab in enumerate(labs, start=1):
                if lab == "failed":
                    rows.append(audit_row(tid, g, None, (), None, None, aid, amode, None, "failed"))
                elif lab is not None:
                    dec, types, sev = lab
                    rows.append(audit_row(tid, g, dec, types, sev, 0.7, aid, amode,
                                          6 if amode == "window" else None))
            _write_jsonl(rd.audit_rows(aid, tid), rows)
    cfg["seeds"] = seeds
    rd.config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    manifest = {"run_id": run_id, "pack": "lhd_startup_consulting", "seeds": seeds, "trials": list(trials),
                "models": {"performer": {**perf, "describe": {}}}, "started_at": "2025-01-01T00:00:00+00:00"}
    rd.manifest.write_text(json.dumps(manifest, indent=2))
    return run
