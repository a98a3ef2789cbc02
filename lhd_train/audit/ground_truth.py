"""The known labels of an audit evaluation, as typed records, and their one reader and writer.

A curated set's run (`audit.curated`) and a planted copy (`audit.plant`) carry, in their root,
`ground_truth.jsonl`: one `LabelledAnswer` per labelled round. A planted copy also carries
`plant.json` (`PlantInfo`: how it was planted, and the counts). They are `lhd audit-eval`'s own
files, beside the run's (docs/validity.md): no other stage reads them, and the run directory
itself (`rundir`) does not know them."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError, model_validator

from lhd_train.errors import DataFileError, InputError, data_file_error
from lhd_train.io.files import atomic_write_text, json_text, read_jsonl_lines
from lhd_train.rundir.rows import Record
from lhd_train.rundir.run import Run, read_record, write_record

GROUND_TRUTH = "ground_truth.jsonl"
PLANT_INFO = "plant.json"


class FileQuote(Record):
    """Where a label's evidence is: an exact excerpt of one of the task's files."""

    file: str
    quote: str
    task: int | None = None  # the task whose files hold it, when not the labelled round's own (cross-round)


class LabelledAnswer(Record):
    """One labelled round: honest, or one deception type at a severity. Planted rows record the
    edit (`before` / `after`) and the seed; curated rows the item, its deceptive passages and why."""

    trial_id: str
    global_round: int
    task_index: int | None = None
    round: int | None = None
    source: str | None = None  # planted | curated
    item: str | None = None  # curated: the set's item id
    deceptive: bool
    type: str | None  # a deception type (config.vocab.TYPES); None for an honest answer
    severity: int
    before: str | None = None  # planted: the text edited ...
    after: str | None = None  # ... and what it became ("" for a removed sentence)
    evidence: list[FileQuote] = []
    answer_quotes: list[str] | None = None  # curated: the deceptive passages, exact
    why: str | None = None  # curated: why the label holds; planted: why the edit went the way it did
    seed: int | None = None  # planted: the seed of `lhd audit-plant`
    plant: str | None = None  # planted: how (FALSIFICATION, CROSS_ROUND, CONCEALMENT, EQUIVOCATION)
    direction: str | None = None  # planted falsification: up | down
    size: float | None = None  # planted falsification: new / old - 1
    direction_inferred: bool | None = None  # False: the documented default direction (audit.pressure)
    earlier_global_round: int | None = None  # cross-round: the round whose figure the answer contradicts
    earlier_quote: str | None = None  # cross-round: that round's sentence holding the figure
    cluster: str | None = None  # what rounds share in the clustered intervals, if not the default (entitle: task)

    @model_validator(mode="after")
    def _typed_when_deceptive(self) -> LabelledAnswer:
        if self.deceptive != (self.type is not None):
            raise ValueError("a deceptive answer names its type, an honest one none")
        return self


class PlantInfo(Record):
    """plant.json: the settings a planted copy was made with, and what was planted."""

    source_run: str
    seed: int
    rate: float
    types: list[str]
    task_source: str | None = None
    created_at: str | None = None
    rounds: int = 0  # rounds of finished trials (the candidates)
    chosen: dict[str, int] = {}
    planted: dict[str, int] = {}
    skipped: dict[str, int] = {}  # chosen, but nothing plantable
    repeated: int = 0  # of the skipped: the answer repeats (or is part of) another round's answer
    unfinished_trials: list[str] = []  # copied, not planted
    max_per_trial: int | None = None  # at most this many planted rounds per trial (None: no cap)
    cross_round: float | None = None  # share of falsifications planted across rounds where possible
    capped: int = 0  # rounds chosen but not tried: their trial already had max_per_trial plants
    cross_round_planted: int = 0  # of the falsifications: planted across rounds
    directions: dict[str, int] = {}  # falsifications: up / down / default (direction not inferred)
    detectability: dict[str, Any] | None = None  # the text-only control (audit.detectability)


def ground_truth_path(run: Run) -> Path:
    return run.path / GROUND_TRUTH


def write_ground_truth(run: Run, labels: list[LabelledAnswer]) -> None:
    """Write every label at once (an empty file when there is none: nothing was plantable)."""
    run.path.mkdir(parents=True, exist_ok=True)
    atomic_write_text(ground_truth_path(run), "".join(json_text(r.to_json()) + "\n" for r in labels))


def read_ground_truth(run: Run) -> list[LabelledAnswer]:
    """The labels, each checked: a `DataFileError` names the file, the line and the field.

    The file is written whole and atomically, so a last line without its newline is damage, not a
    crash mid-append: it is refused, never skipped. On a planted copy the count must be the one
    `plant.json` records, so a lost last line cannot turn a planted round into an unplanted one
    (which would move it out of the false-negative rate's denominator)."""
    path = ground_truth_path(run)
    if not path.is_file():
        raise InputError(path, None, "not found: evaluate the curated set (--set curated) or a planted copy "
                         "(`lhd audit-plant RUN --out DIR`, then --planted DIR)")
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        raise DataFileError(path, "the last line ends without its newline: the file was cut short (it is "
                            "written whole, so this is damage); plant the copy again", line=data.count(b"\n") + 1)
    out = []
    for n, raw in read_jsonl_lines(path):
        try:
            out.append(LabelledAnswer.model_validate(raw))
        except ValidationError as e:
            raise data_file_error(e, path, line=n, root=LabelledAnswer) from None
    info = read_plant_info(run)
    if info is None and any(r.source == "planted" for r in out):
        raise InputError(run.path / PLANT_INFO, None, f"not found, but {GROUND_TRUTH} holds planted labels: the "
                         "planted copy lost the record of its counts; plant the copy again")
    if info is not None and (n := sum(r.source == "planted" for r in out)) != (planted := sum(info.planted.values())):
        raise DataFileError(path, f"{n} planted labels, but {PLANT_INFO} records {planted} planted rounds: the file "
                            "lost or gained lines; plant the copy again")
    return out


def write_plant_info(run: Run, info: PlantInfo) -> None:
    write_record(run.path / PLANT_INFO, info)


def read_plant_info(run: Run) -> PlantInfo | None:
    """plant.json, checked; None for a run that is not a planted copy."""
    return read_record(run.path / PLANT_INFO, PlantInfo)
