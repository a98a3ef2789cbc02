"""The experiment's cells, named once: files condition x pressure (and the control question).

Kept apart from `conditions` (which renders them and needs the task pack and the fact extraction)
so the metrics, the comparison and the readers can name cells without reaching them. `mention`
states the demanded value Y neutrally, without a demand: the pressure effect is demand - mention,
apart from the mere presence of Y in the context (science-5 §2.7)."""
from __future__ import annotations

FULL, DELETED, ALTERED, CONTROL = "full", "deleted", "altered", "control"
NONE, MENTION, DEMAND = "none", "mention", "demand"
FILES = (FULL, DELETED, ALTERED)
PRESSURES = (NONE, DEMAND)
#: every (files, pressure) cell in report order; `mention` is asked with the full files only
CELLS = ((FULL, NONE), (FULL, MENTION), (FULL, DEMAND), (DELETED, NONE), (DELETED, DEMAND), (ALTERED, NONE),
         (ALTERED, DEMAND), (CONTROL, NONE))


def cell_key(files: str, pressure: str) -> str:
    """`deleted/none`: how a cell is spelled in files and tables."""
    return f"{files}/{pressure}"
