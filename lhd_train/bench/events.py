"""The event schedule: which pressure event each task gets, drawn before any model call.

The draw order copies the authors' code exactly (docs/reference.md, "Event schedule"), so a seed
gives the authors' schedule on their packs; but it uses a local `random.Random(seed)`, never the global RNG, so
concurrent trials cannot disturb each other."""
from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict

from lhd_train.bench.taskpack import TaskPack
from lhd_train.config.base import validate
from lhd_train.config.vocab import CATEGORIES, LEVELS, Category, Level
from lhd_train.errors import InputError

NONE = "NONE"
# The reference's spelling of "no control"; accepted so its command lines carry over.
UNCONTROL = "UNCONTROL"


class ScheduledEvent(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    task_index: int
    name: str
    category: Category
    level: Level
    content: str
    event_id: str


class Schedule(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    seed: int
    p_event: float
    control_category: Category | Literal["NONE"] | None = None
    control_pressure: Level | Literal["NONE"] | None = None
    entries: list[ScheduledEvent | None]  # position i is task i + 1

    @property
    def n_events(self) -> int:
        return sum(e is not None for e in self.entries)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the project's convention), written as `schedules/<trial>.json`."""
        return self.model_dump(mode="json")

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str | Path | None = None) -> Schedule:
        return validate(cls, data, source)


def _control(value: str | None, choices: tuple[str, ...], field: str) -> str | None:
    if value is None or value == UNCONTROL:
        return None
    if value == NONE or value in choices:
        return value
    raise InputError(None, field, f"{value!r} is not allowed", ", ".join((UNCONTROL, NONE) + choices))


def draw_schedule(pack: TaskPack, seed: int, p_event: float = 0.5, control_category: str | None = None,
                  control_pressure: str | None = None) -> Schedule:
    """One entry per task in task order, drawn exactly as the reference does.

    Per task: NONE control => no event and no draw; else u = random() and an event iff u < p_event;
    then always ci = randint(0, 4), ei = randint(0, len(phase events) - 1), pi = randint(0, 3).
    Controls only replace the category or level, so a controlled schedule keeps the same event
    tasks, event index and level index as the uncontrolled one for the same seed."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InputError(None, "seed", f"{seed!r} is not an integer")
    if isinstance(p_event, bool) or not isinstance(p_event, (int, float)) or math.isnan(p_event) \
            or not 0.0 <= p_event <= 1.0:
        raise InputError(None, "p_event", f"{p_event!r} is not a probability", "a number from 0 to 1")
    cat = _control(control_category, CATEGORIES, "control_category")
    lvl = _control(control_pressure, LEVELS, "control_pressure")

    rng = random.Random(seed)
    entries: list[ScheduledEvent | None] = []
    for task in pack.tasks:
        if cat == NONE or lvl == NONE or not rng.random() < p_event:
            entries.append(None)
            continue
        pool = pack.events_of_phase(task.phase)
        ci = rng.randint(0, len(CATEGORIES) - 1)
        ei = rng.randint(0, len(pool) - 1)
        pi = rng.randint(0, len(LEVELS) - 1)
        category = cat or pack.categories_in_order(task.phase)[ci]
        same = pack.events_of(category, task.phase)
        event = same[ei % len(same)]
        # LEVELS holds exactly Level's values (vocab.py), and `_control` lets no other value through.
        level = cast(Level, lvl or LEVELS[pi])
        entries.append(ScheduledEvent(task_index=task.index, name=event.name, category=category, level=level,
                                      content=event.variants[level], event_id=event.id))
    return Schedule(seed=seed, p_event=float(p_event), control_category=cat, control_pressure=lvl, entries=entries)
