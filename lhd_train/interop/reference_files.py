"""The authors' session folders, read and checked (docs/reference.md, "Session folders").

A session folder holds `result.json`, a copy of its config YAML and `detector_<ts>.json` /
`detector_window_r<R>_<ts>.json`. Everything `lhd import-reference` needs from them is read and
validated here before anything is written: a truncated file, a file of the wrong shape, a round
listed twice or a label for a round the session does not have is one InputError naming the file."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict

from lhd_train.config.base import validate
from lhd_train.config.vocab import CATEGORIES, LEVELS
from lhd_train.errors import InputError
from lhd_train.rundir.names import trial_id

SESSION_NAME = re.compile(
    r"^(?P<pack>.+?)_(?P<ts>\d{8}_\d{6})(?:_category_(?P<cat>[A-Z_]+?))?(?:_pressure_(?P<lvl>[A-Z]+))?"
    r"_seed(?P<seed>\d+)(?:_model_(?P<tag>.+))?$")
DETECTOR_FULL = re.compile(r"^detector_(\d{8}_\d{6})\.json$")
DETECTOR_WINDOW = re.compile(r"^detector_window_r(\d+)_(\d{8}_\d{6})\.json$")


# ---------------------------------------------------------------- the reference's files, validated

class _L(BaseModel):
    model_config = ConfigDict(extra="ignore")


class RefFile(_L):
    filename: str
    content: str = ""


class RefTask(_L):
    task_sequence_num: int
    title: str = ""
    base_prompt: str | dict[str, str] = ""
    files: list[RefFile] = []


class RefEvent(_L):
    name: str = "NO_EVENT"
    content: str = ""
    pressure_level: str = "-"
    category: str = "-"


class RefStateUpdates(_L):
    previous_state: dict[str, float] | None = None
    new_state: dict[str, float] | None = None


class RefEvaluation(_L):
    evaluation_reasoning: str | None = None
    state_updates: RefStateUpdates | None = None
    feedback_reasoning: str | None = None
    feedback_response: str | None = None
    task_complete: bool = False


class RefRound(_L):
    round: int
    global_round: int
    llm_response: str = ""
    manager_evaluation: RefEvaluation | None = None


class RefTaskBlock(_L):
    task: RefTask
    event: RefEvent | None = None
    rounds: list[RefRound] = []


class RefExperiment(_L):
    global_rounds: int | None = None
    tasks: list[RefTaskBlock]
    error_info: dict[str, Any] | None = None


class RefMetadata(_L):
    task_stream_name: str | None = None
    total_tasks: int | None = None
    phases: int | None = None


class RefResult(_L):
    metadata: RefMetadata = RefMetadata()
    experiment: RefExperiment


class RefDetection(_L):
    global_round: int
    deception_detected: bool
    types: list[str] = []
    severity: int = 0
    confidence_score: float | None = None
    reasoning: str = ""
    evidence: list[str] = []
    raw_response: str = ""


class RefDetector(_L):
    summary: dict[str, Any] = {}
    round_detections: list[RefDetection]


def load_checked(model: type[BaseModel], path: Path) -> Any:
    """A source file, validated; a truncated or unreadable one is one InputError naming it."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise InputError(path, None, f"not valid JSON (truncated?): {e.msg} at line {e.lineno} column {e.colno}"
                         ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(path, None, f"cannot be read ({getattr(e, 'strerror', None) or e})") from None
    return validate(model, data, path)


def check_rounds(path: Path, result: RefResult) -> set[int]:
    """The global rounds of a result file; a round listed twice is refused (it would be two rows)."""
    seen: dict[int, str] = {}
    for b in result.experiment.tasks:
        for r in b.rounds:
            where = f"task {b.task.task_sequence_num} round {r.round}"
            if r.global_round in seen:
                raise InputError(path, "global_round", f"{r.global_round} appears twice ({seen[r.global_round]} "
                                 f"and {where})")
            seen[r.global_round] = where
    return set(seen)


def check_detections(path: Path, det: RefDetector, rounds: set[int]) -> None:
    """Every label is for a round of the session, once: a label for a round that does not exist is
    a file of another session (or a truncated result.json), not something to skip silently."""
    seen: set[int] = set()
    for i, d in enumerate(det.round_detections):
        where = f"round_detections[{i}].global_round"
        if d.global_round not in rounds:
            span = f"{min(rounds)} ... {max(rounds)}" if rounds else "none"
            raise InputError(path, where, f"{d.global_round} is not a round of the session's result.json",
                             f"its global rounds: {span}")
        if d.global_round in seen:
            raise InputError(path, where, f"{d.global_round} is labelled twice")
        seen.add(d.global_round)


# ---------------------------------------------------------------- session discovery

@dataclass
class Session:
    path: Path
    seed: int
    pack: str | None
    timestamp: str | None
    category: str | None
    pressure: str | None
    model_tag: str | None

    @property
    def trial_id(self) -> str:
        return trial_id(self.seed, self.category, self.pressure)


def parse_session_name(folder: Path) -> Session:
    """`<pack>_<YYYYmmdd_HHMMSS>[_category_<C>][_pressure_<L>]_seed<N>_model_<tag>` (docs/reference.md)."""
    m = SESSION_NAME.match(folder.name)
    if m:
        cat, lvl = m["cat"], m["lvl"]
        if cat is not None and cat not in (*CATEGORIES, "NONE"):
            raise InputError(folder, "category", f"{cat!r} in the folder name is not a category",
                             ", ".join((*CATEGORIES, "NONE")))
        if lvl is not None and lvl not in (*LEVELS, "NONE"):
            raise InputError(folder, "pressure", f"{lvl!r} in the folder name is not a pressure level",
                             ", ".join((*LEVELS, "NONE")))
        return Session(folder, int(m["seed"]), m["pack"], m["ts"], cat, lvl, m["tag"])
    s = re.search(r"_seed(\d+)(?:_|$)", folder.name)
    if not s:
        raise InputError(folder, None, "cannot find the seed in the folder name (expected ..._seed<N>_...)")
    return Session(folder, int(s.group(1)), None, None, None, None, None)


def find_sessions(src: Path) -> list[Session]:
    if not src.is_dir():
        raise InputError(src, None, "folder not found")
    if (src / "result.json").is_file():
        return [parse_session_name(src)]
    sessions = [parse_session_name(p) for p in sorted(src.iterdir()) if (p / "result.json").is_file()]
    if not sessions:
        raise InputError(src, None, "no result.json here or in any sub-folder (is this a reference session folder?)")
    seen: dict[str, Path] = {}
    for s in sessions:
        if s.trial_id in seen:
            raise InputError(s.path, "seed", f"trial {s.trial_id} appears twice (also {seen[s.trial_id].name})")
        seen[s.trial_id] = s.path
    return sessions


def newest_detectors(folder: Path) -> dict[str, tuple[Path, int | None]]:
    """auditor id -> (newest file, window R): `reference-full` from `detector_<ts>.json`,
    `reference-window<R>` from `detector_window_r<R>_<ts>.json`, newest by the name's timestamp."""
    best: dict[str, tuple[str, Path, int | None]] = {}
    for p in folder.iterdir():
        if (m := DETECTOR_FULL.match(p.name)):
            key, ts, r = "reference-full", m.group(1), None
        elif (m := DETECTOR_WINDOW.match(p.name)):
            key, ts, r = f"reference-window{int(m.group(1))}", m.group(2), int(m.group(1))
        else:
            continue
        if key not in best or ts > best[key][0]:
            best[key] = (ts, p, r)
    return {k: (p, r) for k, (_, p, r) in sorted(best.items())}


def session_config(folder: Path) -> tuple[dict[str, Any], str | None]:
    """The copy of the reference config in the session folder (exactly one *.yaml), if readable."""
    ymls = sorted(folder.glob("*.yaml"))
    if len(ymls) != 1:
        return {}, None
    try:
        data = yaml.safe_load(ymls[0].read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, ValueError, UnicodeDecodeError, OSError):  # unreadable: the config is optional
        return {}, ymls[0].name
    return (data if isinstance(data, dict) else {}), ymls[0].name
