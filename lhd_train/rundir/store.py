"""The checked readers of trajectory and audit rows, the content-addressed message store and the
`.done` markers (see docs/formats.md)."""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sized
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar, overload

from pydantic import ValidationError

from lhd_train.errors import DataFileError, data_file_error, explain
from lhd_train.io.files import append_jsonl, read_jsonl_lines
from lhd_train.rundir.layout import DONE_SUFFIX, ROWS_SUFFIX, TrialFiles, trial_id_of_messages
from lhd_train.rundir.manifest import DoneMarker
from lhd_train.rundir.rows import AuditRow, Record, RoundRow

R = TypeVar("R", bound=Record)
RR = TypeVar("RR", bound=RoundRow)


def _trial_repair(path: Path) -> str:
    """The safe repair for a trajectory file damaged at line {line}: later rounds depend on it."""
    t = TrialFiles.from_rows(path)
    return (f"keep only the lines before line {{line}}, delete {t.done.name} and the audit rows "
            f"(audit/*/{t.rows.name}) of the rounds cut, then rerun `lhd run` to redo them")


def _check_row(path: Path, n: int, row: dict[str, Any], model: type[R], repair: str | None) -> R:
    """Validate one line against its row model; the first problem becomes a `DataFileError` naming
    the line and the field (dotted, e.g. `performer.latency_s`)."""
    try:
        return model.model_validate(row)
    except ValidationError as e:
        raise data_file_error(e, path, line=n, repair=repair and repair.format(line=n), root=model) from None


@overload
def load_trial_rows(path: Path) -> list[RoundRow]: ...
@overload
def load_trial_rows(path: Path, model: type[RR]) -> list[RR]: ...
def load_trial_rows(path: Path, model: type[RoundRow] = RoundRow) -> list[Any]:
    """A trial's trajectory rows, checked: each row is a valid `model` (`ResumableRoundRow` for a
    resume, which needs the supervisor's state), and no (task, round) or global round appears
    twice — two writers or a botched copy would otherwise be counted as extra rounds. Raises
    `DataFileError` naming the file, line and field."""
    repair = _trial_repair(path)
    rows: list[RoundRow] = []
    seen_key: dict[tuple[int, int], int] = {}
    seen_g: dict[int, int] = {}
    for n, raw in read_jsonl_lines(path, repair):
        row = _check_row(path, n, raw, model, repair)
        key, g = (row.task_index, row.round), row.global_round
        first = seen_key.get(key) or seen_g.get(g)
        if first is not None:
            raise DataFileError(path, f"task {key[0]} round {key[1]} (global round {g}) is also at line {first}: "
                                "a round written twice (two writers on one run?)", line=n,
                                repair=repair.format(line=n))
        seen_key[key], seen_g[g] = n, n
        rows.append(row)
    return rows


def load_audit_rows(path: Path) -> list[AuditRow]:
    """An auditor's rows for one trial, each a valid `AuditRow`, in file order. A round may appear
    more than once (a repaired or resumed audit); `winning_audit_rows` says which one counts."""
    repair = "delete line {line}; a rerun of `lhd audit` with the same auditor id redoes that round"
    return [_check_row(path, n, raw, AuditRow, repair) for n, raw in read_jsonl_lines(path, repair)]


NO_LABEL_STATUSES = ("failed", "cut")  # an audit row without a usable label (cut: stopped at its token limit)


def _replaces(new: AuditRow, old: AuditRow | None) -> bool:
    """Whether `new`, written after `old` for the same round, counts instead of it."""
    if old is None or new.parse_status not in NO_LABEL_STATUSES or old.parse_status in NO_LABEL_STATUSES:
        return True
    # `new` has no label, `old` has one: that label stays, unless it was made from the trial while
    # it was unfinished and `new` from the finished trial (a failed relabel: the stale label goes).
    return bool(old.trial_unfinished) and not new.trial_unfinished


def winning_audit_rows(rows: Iterable[AuditRow]) -> dict[int, AuditRow]:
    """The one rule for a round labelled twice (a resumed, repaired, relabelled or merged audit):
    the later row wins, except that a failed or cut row never replaces a usable one, unless that
    one was labelled while the trial was unfinished (`trial_unfinished`) and the failed row after
    the trial finished. Keyed by global round."""
    chosen: dict[int, AuditRow] = {}
    for row in rows:
        if _replaces(row, chosen.get(row.global_round)):
            chosen[row.global_round] = row
    return chosen


def message_id(role: str, content: str) -> str:
    """The content address of a message. `surrogatepass`: an answer holding a lone UTF-16
    surrogate still has an id (the same bytes as before for every other text)."""
    return hashlib.sha256(f"{role}\0{content}".encode("utf-8", "surrogatepass")).hexdigest()[:16]


class MessageStore:
    """Each distinct message stored once; calls reference messages by id. Opening one only reads
    it (a torn last line is ignored, never cut: a reader must not change a run); `put` appends, and
    `append_jsonl` cuts a torn line first."""

    def __init__(self, path: Path):
        self.path = path
        tid = trial_id_of_messages(path)
        lines = read_jsonl_lines(path, f"none is safe (the lost message cannot be rebuilt): restore the file from a "
                                       f"copy, or delete trials/{tid}.* and its audit rows to redo the trial")
        for n, r in lines:
            if not all(isinstance(r.get(k), str) for k in ("id", "role", "content")):
                raise DataFileError(path, "a message needs string fields id, role and content", line=n)
        self._known: dict[str, dict[str, str]] = {r["id"]: r for _, r in lines}

    def put(self, messages: list[dict[str, str]]) -> list[str]:
        ids = []
        for m in messages:
            mid = message_id(m["role"], m["content"])
            if mid not in self._known:
                row = {"id": mid, "role": m["role"], "content": m["content"]}
                append_jsonl(self.path, row)
                self._known[mid] = row
            ids.append(mid)
        return ids

    def get(self, ids: list[str]) -> list[dict[str, str]]:
        missing = [i for i in ids if i not in self._known]
        if missing:
            what = "is missing" if not self.path.exists() else f"has no message {missing[0]}"
            tid = trial_id_of_messages(self.path)
            raise DataFileError(self.path, f"{what}, but the trial's rows refer to it", repair=(
                f"restore the file from a copy, or delete trials/{tid}.* and its audit rows to redo the trial"))
        return [{"role": self._known[i]["role"], "content": self._known[i]["content"]} for i in ids]

    def __contains__(self, mid: str) -> bool:
        return mid in self._known

    def ids(self) -> list[str]:
        """Every stored message's id, in the order stored (`get(ids())`: the whole store)."""
        return list(self._known)


def _done_marker_error(path: Path, what: str, field: str | None = None) -> DataFileError:
    tid = path.name.removesuffix(DONE_SUFFIX)
    return DataFileError(path, f"not a .done marker ({what}), so trial {tid} cannot be taken as finished",
                         field=field, repair="delete it so that `lhd run` continues the trial from the rows there are")


def _is_timestamp(text: str) -> bool:
    try:
        datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return False
    return True


def read_done_marker(path: Path) -> DoneMarker | None:
    """A trial's `.done` marker (None without one): JSON with the round count the trial finished
    with, or, in the oldest runs, a bare ISO timestamp (read as a marker without a count).
    Anything else (empty, binary, a JSON marker without its count) is a `DataFileError` naming
    the trial: taken for the oldest format it would pass rows cut short as a finished trial."""
    if not path.exists():
        return None
    try:
        text = path.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError:
        raise _done_marker_error(path, "not UTF-8 text") from None
    try:
        data = json.loads(text)
    except ValueError:
        if _is_timestamp(text):
            return DoneMarker(finished_at=text)  # the oldest marker: an ISO timestamp
        raise _done_marker_error(path, f"neither JSON nor a timestamp: {text[:40]!r}") from None
    try:
        marker = DoneMarker.model_validate(data)
    except ValidationError as e:
        problem = explain(e, DoneMarker)
        raise _done_marker_error(path, problem.problem, problem.field) from None
    if marker.rounds is None:  # every JSON marker has recorded its round count
        raise _done_marker_error(path, "no round count", "rounds")
    return marker


def check_done_marker(done_path: Path, rows_path: Path, rows: Sized) -> bool:
    """True when the trial is marked finished and the marker agrees with its rows; False when
    there is no marker. A marker over no rows, or over a different number of rounds than it
    recorded, is a `DataFileError`: the trajectory was lost or cut, and silence would drop the
    trial from every count. Old markers (a timestamp only) are checked for rows alone."""
    marker = read_done_marker(done_path)
    if marker is None:
        return False
    expected = marker.rounds
    tid = rows_path.name.removesuffix(ROWS_SUFFIX)
    repair = (f"restore {rows_path.name} from a copy, or delete {done_path.name} so that `lhd run` "
              "continues the trial from the rows there are")
    if not len(rows):
        state = "is missing" if not rows_path.exists() else "has no rows"
        raise DataFileError(done_path, f"marks trial {tid} finished"
                            + (f" with {expected} rounds" if expected is not None else "")
                            + f", but {rows_path} {state}", repair=repair)
    if expected is not None and expected != len(rows):
        raise DataFileError(done_path, f"marks trial {tid} finished with {expected} rounds, but {rows_path} "
                            f"has {len(rows)}", repair=repair)
    return True
