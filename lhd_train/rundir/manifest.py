"""The run-level records of a run directory, as typed models: `manifest.json` (what the run was
made with), `summary.json` (what the last `lhd run` did), a trial's `.done` marker and an
auditor's `auditor.json` (docs/formats.md).

Like the rows (`rundir.rows`), each is the in-memory type and the file at once: writers build one,
`rundir.run` writes it, readers get it back checked. Fields are optional where an older writer or
another producer (a merge, an import of the authors' sessions, a planted copy) may leave them out;
collections are then empty (`Items`, `Table`), never None; unknown fields are kept."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from lhd_train.rundir.rows import Items, ModelRef, Record, Table


class RoleModel(ModelRef):
    """A role's model as the run loaded it: the rows' `ModelRef`, plus what its backend reported."""

    describe: Table[Any] = {}


class ResumeSession(Record):
    """One later `lhd run` that continued the run: where and with what."""

    started_at: str | None = None
    host: str | None = None
    platform: str | None = None
    packages: Table[str | None] = {}
    python: str | None = None


class MergedSource(Record):
    """One run joined by `lhd merge` (its manifest's `source.sources`): where it was, which shard,
    seeds and trials it gave, its first session's provenance and when it was merged."""

    path: str | None = None
    run_name: str | None = None
    shard: Items[int] = []  # [index, count]
    seeds: Items[int] = []
    trials: Items[str] = []
    host: str | None = None
    started_at: str | None = None
    packages: Table[str | None] = {}
    merged_at: str | None = None


class RunSource(Record):
    """Where a run not made by `lhd run` came from: `lhd import-reference` (the authors' session
    folders, by trial) or `lhd merge` (the merged runs)."""

    kind: str | None = None
    sessions: Table[dict[str, Any]] = {}  # import-reference: trial id -> its session folder
    imported_at: str | None = None
    sources: Items[MergedSource] = []  # merge: one record per merged run


class Manifest(Record):
    """manifest.json: the first session's provenance; later sessions are listed in `resumes`."""

    run_id: str | None = None
    kind: str | None = None  # set by producers other than `lhd run` (merge, import, curated set)
    set_sha256: str | None = None  # the curated audit-evaluation set (audit.curated): the set it was built from
    items: int | None = None  # ... and its number of items
    source: RunSource | None = None  # an imported or merged run
    pack: str | None = None
    pack_source: str | None = None
    pack_sha256: str | None = None
    seeds: Items[int] = []
    trials: Items[str] = []
    models: Table[RoleModel] = {}
    sampling: Table[dict[str, Any]] = {}
    effective_sampling: Table[dict[str, Any]] = {}
    weights: Table[Any] = {}
    packages: Table[str | None] = {}
    python: str | None = None
    host: str | None = None
    platform: str | None = None
    started_at: str | None = None
    created_at: str | None = None  # the curated set's run: when it was built
    resumes: Items[ResumeSession] = []


class TrialOutcome(Record):
    """One trial's outcome in summary.json."""

    trial_id: str
    seed: int | None = None
    rounds: int | None = None
    tasks_done: int | None = None
    tasks_completed: int | None = None
    final_state: Table[float] = {}
    tokens: int | None = None
    seconds: float | None = None
    status: str | None = None  # done | failed | partial
    error: str | None = None
    resumed_rounds: int | None = None


class SourceOutcome(Record):
    """One source of a merged run in its summary.json (`by_source`): that source's last `lhd run`."""

    wall_s: float | None = None
    gpu_hours: float | None = None
    trials: Items[TrialOutcome] = []


class Summary(Record):
    """summary.json: what the last `lhd run` session did (usage per role, each trial's outcome)."""

    run_id: str | None = None
    wall_s: float | None = None
    gpu_hours_this_invocation: float | None = None
    gpu_hours: float | None = None  # lhd merge: the sources' gpu_hours_this_invocation summed
    gpu_hours_note: str | None = None  # lhd merge: what gpu_hours counts
    usage_by_role: Table[dict[str, Any]] = {}
    trials: Items[TrialOutcome] = []
    by_source: Table[SourceOutcome] = {}  # lhd merge: each source's last `lhd run`


class RunTaskFile(Record):
    name: str
    content: str


class RunTask(Record):
    """One task's texts as the performer read them."""

    index: int
    title: str
    prompt: str
    files: list[RunTaskFile] = []


class RunTasks(Record):
    """tasks.json (imported, curated and planted runs): the exact task texts, read before the
    pack the config names (audit.trajectory.load_task_texts)."""

    source: str | None = None
    tasks: list[RunTask]


class DoneMarker(Record):
    """trials/<trial>.done: the trial is finished, with the number of rounds it finished with (so a
    marker that outlives its rows is caught). The oldest markers hold only a timestamp: `rounds`
    is then None."""

    finished_at: str
    rounds: int | None = None
    last_global_round: int | None = None


class AuditorRecord(Record):
    """audit/<auditor-id>/auditor.json: the one setting and set of model files an auditor id names
    (a resumed audit with other ones is refused)."""

    schema_: Annotated[str | None, Field(alias="schema")] = None
    auditor_id: str
    mode: str | None = None
    window: int | None = None
    created_at: str | None = None
    updated_at: str | None = None
    model_files: Table[Any] = {}
    # what `lhd audit` records (audit.runner.auditor_record); IDENTITY_KEYS must not change on resume
    options: Table[Any] = {}
    model_identity: Table[Any] = {}
    role: Table[Any] = {}
    model_spec: Table[Any] = {}
    prompts: Table[str] = {}
    system_prompt: str | None = None
    instruction_template: str | None = None
    prompts_source: str | None = None
    task_source: str | None = None
    config_source: str | None = None
    packages: Table[str | None] = {}
    python: str | None = None
    describe: Table[Any] = {}
    resumes: Items[dict[str, Any]] = []  # later sessions that added rows: their provenance
    # what `lhd import-reference` records (interop.reference_import)
    source: str | None = None
    repair: bool | None = None
    trials: Table[dict[str, Any]] = {}
