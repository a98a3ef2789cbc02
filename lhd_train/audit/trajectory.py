"""What the auditor reads: a trial's rounds rendered as text, the subset each mode shows, and the
prompt layout [system][trajectory][target round][instruction].

The trajectory text is a pure function of the rows and the subset, so every round of a trial
audited in `full` mode gets a byte-identical prefix (a prefix-caching engine computes it once),
and a rerun rebuilds exactly the prompt a row's `prompt_sha256` names."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from string import Template
from typing import TYPE_CHECKING, Any

from lhd_train.bench.prompts import BUILTIN_DIR as PROMPTS_DIR
from lhd_train.config.auditor import DEFAULT_OPTIONS, RenderOptions
from lhd_train.config.vocab import MODES
from lhd_train.errors import DataFileError, InputError
from lhd_train.io.files import sha256_text
from lhd_train.rundir.manifest import Manifest, RunTask, RunTasks
from lhd_train.rundir.rows import RoundRow, SupervisorState
from lhd_train.rundir.run import Run, read_record

if TYPE_CHECKING:
    from lhd_train.bench.taskpack import Task


@dataclass(frozen=True)
class TaskText:
    """A task's texts as the auditor shows them, from a pack (`bench.taskpack.Task`) or from the
    run's `tasks.json` (`rundir.manifest.RunTask`): only what is rendered, files as (name, content)."""

    index: int
    title: str
    prompt: str
    files: tuple[tuple[str, str], ...] = ()  # (name, content)


@dataclass
class AuditorPrompts:
    system: str
    instruction: str
    source: str

    @classmethod
    def load(cls, override_dir: str | Path | None = None) -> AuditorPrompts:
        texts = {}
        for name in ("auditor_system", "auditor_instruction"):
            path = PROMPTS_DIR / f"{name}.md"
            if override_dir is not None and (Path(override_dir) / f"{name}.md").is_file():
                path = Path(override_dir) / f"{name}.md"
            texts[name] = path.read_text(encoding="utf-8").strip("\n")
        return cls(texts["auditor_system"], texts["auditor_instruction"], str(override_dir or PROMPTS_DIR))

    def instruction_for(self, row: RoundRow) -> str:
        try:
            return Template(self.instruction).substitute(
                global_round=row.global_round, task_index=row.task_index, task_round=row.round)
        except KeyError as e:
            raise InputError(Path(self.source) / "auditor_instruction.md", str(e), "placeholder has no value",
                             "$global_round, $task_index, $task_round") from None

    def digest(self) -> dict[str, str]:
        return {"system_sha256": sha256_text(self.system), "instruction_sha256": sha256_text(self.instruction)}


def prompt_sha256(messages: list[dict[str, str]]) -> str:
    return sha256_text(json.dumps(messages, ensure_ascii=False, separators=(",", ":")))


# ---------------------------------------------------------------- task texts

def _as_run(run_dir: str | Path | Run) -> Run:
    return run_dir if isinstance(run_dir, Run) else Run.at(run_dir)


def _task_text(task: RunTask | Task) -> TaskText:
    return TaskText(task.index, task.title, task.prompt, tuple((f.name, f.content) for f in task.files))


def run_task_texts(run: Run) -> tuple[dict[int, TaskText], str]:
    """`load_task_texts` for the pack the run's `config.resolved.yaml` names (none without one)."""
    task_pack = run.config().get("task_pack")
    return load_task_texts(run, str(task_pack) if task_pack else None)


def load_task_texts(run_dir: str | Path | Run, task_pack: str | None) -> tuple[dict[int, TaskText], str]:
    """Task prompts and files for rendering, and where they came from.

    Order: the run's own `tasks.json` (imported runs carry the exact texts); the pack named in
    the run config (relative paths tried from the working directory, then the run directory);
    else an empty map, and the performer's round-1 message is shown instead (`Trial.round1_messages`)."""
    run = _as_run(run_dir)
    sidecar = run.dir.tasks
    try:
        stored = read_record(sidecar, RunTasks)
    except DataFileError as e:
        raise InputError(sidecar, e.field, f"cannot be read: {e.problem}") from None
    if stored is not None:
        return {t.index: _task_text(t) for t in stored.tasks}, str(sidecar)
    if task_pack:
        from lhd_train.bench.taskpack import load_pack

        for candidate in (task_pack, str(run.path / task_pack)):
            try:
                pack = load_pack(candidate)
            except InputError:
                continue
            if not _pack_matches_run(run, pack):
                return {}, f"performer messages (pack '{task_pack}' today is not the pack this run used)"
            return {t.index: _task_text(t) for t in pack.tasks}, f"pack {pack.path or pack.name}"
    return {}, "performer messages"


def _pack_matches_run(run: Run, pack: Any) -> bool:
    """Whether a pack found by name is the one the run used: its content hash when the manifest
    recorded one, else every task title the rows recorded. A name can change meaning (the
    built-in `startup_consulting` became the authors' pack; ours is `lhd_startup_consulting`)."""
    from lhd_train.bench.taskpack import pack_sha256

    manifest: Manifest | None = run.manifest()
    if manifest is not None and manifest.pack_sha256:
        return manifest.pack_sha256 == pack_sha256(pack)
    titles = {t.index: t.title for t in pack.tasks}
    for tid in run.trial_ids()[:1]:  # one trial is enough: every trial of a run reads the same pack
        for row in run.trial(tid).rows(RoundRow):
            if titles.get(row.task_index) != row.task_title:
                return False
    return True


# ---------------------------------------------------------------- trials

@dataclass
class Trial:
    """One trial's rounds in global-round order, plus task texts to show with them."""

    trial_id: str
    rows: list[RoundRow]
    tasks: dict[int, TaskText]
    finished: bool
    round1_messages: dict[int, str] = field(default_factory=dict)  # task -> performer's round-1 message

    @property
    def seed(self) -> int:
        return self.rows[0].seed if self.rows else 0

    def task_of(self, i: int) -> int:
        return self.rows[i].task_index


def load_trial(run: Run, trial_id: str, tasks: dict[int, TaskText]) -> Trial:
    """The trial's checked rows (and whether its `.done` marker says it is finished); for a task
    without text, the performer's round-1 message from the message store instead."""
    store = run.trial(trial_id)
    rows, finished = store.read(RoundRow)
    rows.sort(key=lambda r: r.global_round)
    trial = Trial(trial_id, rows, tasks, finished)
    missing = {r.task_index for r in rows} - set(tasks)
    if missing and store.files.messages.exists():  # no task text: show what the performer was actually sent
        messages = store.messages()
        for r in rows:
            if r.round == 1 and r.task_index in missing:
                ids = r.performer.new_message_ids
                if all(i in messages for i in ids):
                    trial.round1_messages[r.task_index] = "\n\n".join(m["content"] for m in messages.get(ids))
    return trial


# ---------------------------------------------------------------- subsets

def window_bounds(n: int, i: int, radius: int) -> tuple[int, int]:
    """[start, end) of a window of 2R+1 rounds centred on index i, shifted inward at the ends so
    it keeps its size when the trial is long enough (the reference's rule)."""
    if n <= 0:
        return 0, 0
    r = max(radius, 0)
    start, end = i - r, i + r + 1
    if start < 0:
        end, start = end - start, 0
    if end > n:
        start, end = max(0, start - (end - n)), n
    return start, end


def context_indices(trial: Trial, i: int, mode: str, window: int = DEFAULT_OPTIONS.window) -> list[int]:
    """Indices (into trial.rows) of the rounds shown as history when auditing round index i."""
    n = len(trial.rows)
    if mode == "full":
        return list(range(n))
    if mode == "causal":
        return list(range(i + 1))
    if mode == "task":
        t = trial.task_of(i)
        return [j for j in range(n) if trial.task_of(j) == t]
    if mode == "window":
        start, end = window_bounds(n, i, window)
        return list(range(start, end))
    raise InputError(None, "mode", f"unknown mode {mode!r}", ", ".join(MODES))


# ---------------------------------------------------------------- rendering

def _fmt_state(before: SupervisorState | None, after: SupervisorState | None) -> str:
    parts = []
    for k in ("trust", "satisfaction", "comfort"):
        b, a = getattr(before, k, None), getattr(after, k, None)
        fb = f"{b:+.2f}" if isinstance(b, (int, float)) else "?"
        fa = f"{a:+.2f}" if isinstance(a, (int, float)) else "?"
        parts.append(f"{k} {fb} -> {fa}")
    return "; ".join(parts)


def render_task_block(trial: Trial, row: RoundRow, opts: RenderOptions, note: str = "") -> str:
    """Task requirements, files and the work situation (event) of the row's task."""
    t = row.task_index
    lines = [f"[Task {t}: {row.task_title}]{note}"]
    task = trial.tasks.get(t)
    if task is not None:
        lines += ["Requirements:", task.prompt.rstrip("\n")]
        if task.files:
            lines.append("Attached files:")
            for name, content in task.files:
                lines += [f"--- file: {name} ---", content.rstrip("\n"), f"--- end of file: {name} ---"]
        else:
            lines.append("Attached files: none")
    elif t in trial.round1_messages:
        lines += ["Message the performer received (task, files and situation as it saw them):",
                  trial.round1_messages[t].rstrip("\n")]
    else:
        lines.append("(The task text is not available for this run.)")
    ev = row.event
    if ev is None:
        lines.append("Work situation: none (normal conditions).")
    elif opts.hide_event_labels:
        lines += ["Work situation:", (ev.content or "").rstrip("\n")]
    else:
        lines += [f"Work situation: {ev.name} | category {ev.category} | pressure {ev.pressure}",
                  (ev.content or "").rstrip("\n")]
    return "\n".join(lines)


def render_round_body(row: RoundRow, opts: RenderOptions) -> str:
    """The performer's answer and what the supervisor did with it. A row without a supervisor
    record (a candidate answer being graded, a curated answer) says that no reaction exists
    instead of inventing one."""
    answer = row.performer.text.strip() or "(empty answer)"
    lines = ["Performer's answer:", answer]
    sup = row.supervisor
    if sup is None:
        lines.append("Supervisor's reaction: none (the supervisor has not seen this answer).")
        return "\n".join(lines)
    ev, fb = sup.evaluation, sup.feedback
    if not opts.hide_supervisor:
        lines += ["Supervisor's private evaluation:", ((ev and ev.reasoning) or "(none recorded)").strip(),
                  f"Supervisor's states: {_fmt_state(sup.state_before, sup.state_after)}",
                  "Supervisor's private reasoning about its feedback:",
                  ((fb and fb.reasoning) or "(none recorded)").strip()]
    lines += ["Feedback sent to the performer:", ((fb and fb.text) or "(no feedback)").strip(),
              f"Task complete after this round: {'yes' if row.task_complete else 'no'}"]
    return "\n".join(lines)


def round_header(row: RoundRow) -> str:
    return (f"--- Global round {row.global_round} (task {row.task_index}, "
            f"round {row.round} of this task) ---")


def render_history(trial: Trial, idx: list[int], opts: RenderOptions) -> str:
    """The rounds at `idx`, in order. Each task's requirements, files and situation are shown
    with the first of its rounds present in the subset (round 1 when it is present)."""
    seen: set[int] = set()
    parts = []
    for j in idx:
        row = trial.rows[j]
        t = row.task_index
        text = [round_header(row)]
        if t not in seen:
            seen.add(t)
            note = "" if row.round == 1 else " (shown here: this task's first round is outside this excerpt)"
            text.append(render_task_block(trial, row, opts, note))
        else:
            text.append(f"(Same task and work situation as the earlier rounds of task {t}.)")
        text.append(render_round_body(row, opts))
        parts.append("\n".join(text))
    return "\n\n".join(parts)


def history_header(trial: Trial, i: int, idx: list[int], mode: str, window: int) -> str:
    """Depends on as little as possible, so rounds that share a history share the prefix too:
    all rounds of a trial in full mode, each round's predecessors in causal mode, all rounds of a
    task in task mode."""
    n = len(trial.rows)
    if mode == "full":
        return (f"=== TRAJECTORY: all {n} rounds of this trial, in order "
                "(it includes rounds after the one you judge) ===")
    if mode == "causal":
        return "=== TRAJECTORY SO FAR: the rounds up to and including the one you judge, in order ==="
    if mode == "task":
        return f"=== TRAJECTORY EXCERPT: the rounds of task {trial.task_of(i)} only, in order ==="
    first, last = trial.rows[idx[0]].global_round, trial.rows[idx[-1]].global_round
    return (f"=== TRAJECTORY EXCERPT: global rounds {first} to {last} of {n}, a window of up to "
            f"{2 * window + 1} rounds around the one you judge ===")


def build_messages(trial: Trial, i: int, mode: str, window: int, opts: RenderOptions,
                   prompts: AuditorPrompts, history_cache: dict[tuple, str] | None = None
                   ) -> tuple[list[dict[str, str]], list[int]]:
    """[system: instructions] [user: trajectory, then the target round, then the instruction].
    Returns the messages and the global rounds shown as history."""
    idx = context_indices(trial, i, mode, window)
    key = (trial.trial_id, tuple(idx), opts)
    if history_cache is not None and key in history_cache:
        history = history_cache[key]
    else:
        history = render_history(trial, idx, opts)
        if history_cache is not None:
            history_cache[key] = history
    row = trial.rows[i]
    first_of_task = next(trial.rows[j] for j in idx if trial.task_of(j) == trial.task_of(i))
    target = "\n".join([
        f"=== ROUND TO JUDGE: global round {row.global_round} (task {row.task_index}, round {row.round}) ===",
        f"(Task {row.task_index}: {row.task_title}. Its requirements, files and work situation are "
        f"shown above with global round {first_of_task.global_round}.)",
        render_round_body(row, opts),
        "=== END OF ROUND TO JUDGE ===",
    ])
    user = "\n".join([
        history_header(trial, i, idx, mode, window), history, "=== END OF TRAJECTORY ===", "",
        target, "", prompts.instruction_for(row),
    ])
    return ([{"role": "system", "content": prompts.system}, {"role": "user", "content": user}],
            [trial.rows[j].global_round for j in idx])
